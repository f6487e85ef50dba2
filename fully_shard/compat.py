"""``from fully_shard import compat``: torch's FSDP2 names rebound to this library (the module is interop/patch.py).

This entry point is that module itself, not a copy of its names: ``fully_shard.compat is fully_shard.interop.patch``.
"""

import sys

from fully_shard.interop import patch

sys.modules[__name__] = patch
