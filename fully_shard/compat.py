"""``from fully_shard import compat``: torch's FSDP2 names rebound to this library (the module is interop/compat.py).

This entry point is that module itself, not a copy of its names: ``fully_shard.compat is fully_shard.interop.compat``.
"""

import sys

from fully_shard.interop import compat

sys.modules[__name__] = compat
