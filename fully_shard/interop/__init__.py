"""Meeting torch's own FSDP2 names (compat): ``patch_torch()`` rebinds them to this library's.

``compat`` sits on top of the core and is imported only by name (``from fully_shard import compat``),
never from here. What the core itself needs of torch.compile and of torch's composable ``replicate()``
lives in the core (core/dynamo.py, core/composable.py).
"""

from __future__ import annotations
