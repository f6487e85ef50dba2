"""The FSDP runtime: fully_shard(), sharded parameters, unit groups, hooks, and the reduce side (no tools)."""

from __future__ import annotations

from .api import fully_shard
from .init import default_init, materialize_meta_module
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .state import FSDPState, get_state, states_under

__all__ = ["FSDPModule", "FSDPState", "UnshardHandle", "default_init", "fully_shard", "get_state",
           "materialize_meta_module", "register_fsdp_forward_method", "share_comm_ctx", "states_under"]
