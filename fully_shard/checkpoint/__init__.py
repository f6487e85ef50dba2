"""Distributed checkpoints as safetensors shards: save/load at any world size, consolidate, state dicts.

``save(path, model, optimizer, extra=...)`` writes each rank's rows once (replicas deduplicated) into
safetensors files plus a versioned JSON index with per-file xxh3 digests, committed atomically.
``load`` reshards onto whatever world size/mesh the model has now (or an unsharded module in a single
process) after verifying the index, headers and digests on every rank. ``consolidate`` turns a checkpoint
into Hugging Face-style ``model.safetensors`` files. See design/checkpoint-format.md.
"""

from __future__ import annotations

from .consolidate import consolidate
from .errors import CheckpointError
from .format import FORMAT_VERSION
from .reader import load
from .state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .writer import SaveHandle, save, wait_pending

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "SaveHandle",
    "consolidate",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "load",
    "save",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "wait_pending",
]
