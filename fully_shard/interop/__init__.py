"""Meeting torch's own FSDP2 names: ``patch.py``'s ``patch_torch()`` rebinds them to this library's.

``patch.py`` sits on top of the core and is imported only by name (``from fully_shard import compat``, the
public name of that module), never from here. What the core itself needs of torch.compile and of torch's
composable ``replicate()`` lives in the core (core/dynamo.py, core/composable.py).
"""

from __future__ import annotations
