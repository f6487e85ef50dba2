"""What a model's full weights are called and how they are cut: its entries and the tensors yielded.

The entries are the plain module's ``state_dict()`` (wrapper prefixes ``_checkpoint_wrapped_module.`` and
``_orig_mod.`` dropped, a tied tensor once under its first name, non-persistent buffers absent); with
``merge_lora`` the names of the merged model (lora.py). A key map (``checkpoint.KeyMap`` or a rename,
exactly as ``save_hf`` takes it) turns the entries into the tensors yielded, through the links of
``KeyMap.resolve_save``: a fused tensor cut back into its parts, stacked experts one tensor per expert,
split parts joined, transposes undone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..checkpoint.errors import CheckpointError
from ..checkpoint.hf_keys import KeyMap, Link, RenameSpec
from . import lora
from .errors import WeightSyncError

_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")


@dataclass
class Entry:
    """One state_dict tensor: its plain name (``name``), the model's key (``key``), the tensor as held."""

    name: str
    key: str
    tensor: torch.Tensor
    lora: lora.LoraLayer | None = None  # a LoRA layer's base weight: merge its adapters into it
    hidden: bool = False  # a LoRA adapter tensor: read for a merge, not yielded


@dataclass
class Output:
    """One tensor yielded: its name, shape and dtype, and the links that make it from the entries."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    links: list[Link] = field(default_factory=list)


@dataclass
class Plan:
    entries: list[Entry]
    outputs: list[Output]
    links_of: dict[str, list[tuple[int, Link]]]  # entry name -> (output index, link)


def plain_name(key: str) -> str:
    return ".".join(p for p in key.split(".") if p not in _WRAPPERS)


def entries_of(model: nn.Module, *, merge_lora: bool = False) -> list[Entry]:
    """The model's state_dict entries (shared tensors once), plain-named; LoRA-merged names when asked."""
    state = model.state_dict(keep_vars=True)  # (a fully_shard unit reshards for it: its sharded DTensors)
    layers = lora.find_layers(model) if merge_lora else {}
    prefix = lora.base_prefix(model) if merge_lora else ""
    out: list[Entry] = []
    seen: set[int] = set()
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"state_dict entry {key!r} is a {type(tensor).__name__}, not a tensor; fix: keep "
                                  "such state out of the module's state_dict (get_extra_state)")
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if tensor.device.type == "meta":
            raise WeightSyncError(f"{key}: on the meta device, no values to gather; fix: materialize the model "
                                  "(to_empty + init, or checkpoint.load_hf) first")
        name = plain_name(key)
        entry = Entry(name, key, tensor)
        found = lora.owner(key, layers) if layers else None
        if found is not None:
            layer, relative = found
            merged = lora.merged_name(layer, relative)
            if merged is None:
                entry.hidden = True
                layer.tensors.append(relative)
            else:
                entry.name = plain_name(merged)
                entry.lora = layer if relative == "base_layer.weight" else None
        if prefix and entry.name.startswith(plain_name(prefix[:-1]) + "."):
            entry.name = entry.name[len(plain_name(prefix[:-1])) + 1:]
        out.append(entry)
    return out


def plan(model: nn.Module, *, key_map: KeyMap | RenameSpec = None, dtype: torch.dtype | None = None,
         merge_lora: bool = False, what: str = "iter_full") -> Plan:
    """The entries and the tensors they make, through ``key_map``, each cast to ``dtype`` (default: its own)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"{what}: dtype must be a torch.dtype or None, found {dtype!r}; fix: e.g. "
                              "dtype=torch.bfloat16")
    entries = entries_of(model, merge_lora=merge_lora)
    shown = [e for e in entries if not e.hidden]
    shapes = {e.name: tuple(e.tensor.shape) for e in shown}
    if len(shapes) != len(shown):
        dup = sorted({e.name for e in shown if sum(f.name == e.name for f in shown) > 1})
        raise WeightSyncError(f"{what}: several state_dict entries have the plain name(s) {dup}; fix: rename them "
                              "(wrappers other than checkpoint_wrapper and torch.compile keep their prefixes)")
    try:
        resolved = KeyMap.of(key_map).resolve_save(shapes)
    except CheckpointError as e:
        raise WeightSyncError(f"{what}(key_map=...): {str(e).replace('save_hf: ', '')}") from None
    outputs: list[Output] = []
    index: dict[str, int] = {}
    links_of: dict[str, list[tuple[int, Link]]] = {}
    for entry in shown:
        for link in resolved.links[entry.name]:
            if link.hf not in index:
                index[link.hf] = len(outputs)
                outputs.append(Output(link.hf, tuple(resolved.shapes[link.hf]), dtype or entry.tensor.dtype))
            outputs[index[link.hf]].links.append(link)
            links_of.setdefault(entry.name, []).append((index[link.hf], link))
    return Plan(entries, outputs, links_of)


def signature(outputs: list[Output]) -> list[list[object]]:
    """``[[name, shape, dtype name], ...]``: the plan as plain data (the wire header, checks)."""
    return [[o.name, list(o.shape), str(o.dtype).replace("torch.", "")] for o in outputs]
