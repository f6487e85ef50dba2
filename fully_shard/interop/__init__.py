"""Meeting torch's own machinery: compile (dynamo), composable replicate(), and torch's FSDP2 names (compat).

``dynamo`` and ``composable`` are leaves the core calls; ``compat`` sits on top of the core and is
imported only by name (``from fully_shard import compat``), never from here.
"""

from __future__ import annotations

from . import composable, dynamo

__all__ = ["composable", "dynamo"]
