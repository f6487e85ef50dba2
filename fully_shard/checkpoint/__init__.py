"""Distributed checkpoints as safetensors shards: save/load at any world size, consolidate, state dicts.

``save(path, model, optimizer, extra=...)`` writes each rank's rows once (replicas deduplicated) into
safetensors files plus a versioned JSON index with per-file xxh3 digests, committed atomically.
``load`` reshards onto whatever world size/mesh the model has now (or an unsharded module in a single
process) after verifying the index, headers and digests on every rank (``mode=LoadMode.IN_PLACE``:
straight into the tensors, digests checked as the bytes arrive, a failure reported as
``PartialLoadError``). ``consolidate`` turns a checkpoint
into Hugging Face-style ``model.safetensors`` files. ``load_hf`` reads a Hugging Face ``save_pretrained``
directory into a sharded model, each rank reading only its blocks, and ``save_hf`` writes one back,
through a ``KeyMap`` of renames and fused/stacked/split/transposed tensors. See design/checkpoint-format.md
and design/hf-interop.md.
"""

from __future__ import annotations

from .consolidate import consolidate
from .errors import CheckpointError, PartialLoadError
from .format import FORMAT_VERSION
from .hf_keys import Fuse, KeyMap, Split, Stack, Transpose
from .hf_load import HFLoadResult, load_hf
from .hf_save import save_hf
from .reader import LoadMode, load
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
    "Fuse",
    "HFLoadResult",
    "KeyMap",
    "LoadMode",
    "PartialLoadError",
    "Split",
    "Stack",
    "Transpose",
    "SaveHandle",
    "consolidate",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "load",
    "load_hf",
    "save",
    "save_hf",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "wait_pending",
]
