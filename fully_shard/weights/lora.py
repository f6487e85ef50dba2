"""peft LoRA layers merged on the fly: which layers, their merged names, and the merged weight.

``iter_full(..., merge_lora=True)`` yields what ``peft_model.merge_and_unload().state_dict()`` would hold,
without touching the trainer's weights: names relative to the base model, ``<layer>.base_layer.weight``
as ``<layer>.weight``, the adapter tensors left out, and each LoRA layer's weight plus the delta of every
active, not yet merged adapter, computed by peft's own ``get_delta_weight`` on the gathered adapter
weights (so the result is bitwise the one ``merge_and_unload`` computes). Layers are recognised by
duck typing (peft is not a dependency). Refused, naming the layer: LoRA variants (DoRA and the like)
and ``lora_bias``, whose merge is not a delta, and ``modules_to_save`` copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .errors import WeightSyncError


@dataclass
class LoraLayer:
    """One peft LoRA layer at ``path`` (state_dict naming) with the adapters to merge into its weight."""

    path: str
    module: nn.Module
    adapters: list[str]
    tensors: list[str] = field(default_factory=list)  # its adapter tensors' state_dict names (relative)


def _is_lora(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("base_layer", "get_delta_weight", "merged_adapters", "active_adapters"))


def base_prefix(model: nn.Module) -> str:
    """The state_dict prefix of a peft model's base model (``base_model.model.``), or ''."""
    get = getattr(model, "get_base_model", None)
    if not callable(get):
        return ""
    base = get()
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    return ""


def find_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """The LoRA layers under ``model`` by module path; refuses what ``merge_lora`` cannot merge."""
    out: dict[str, LoraLayer] = {}
    for path, module in model.named_modules():
        if hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
            raise WeightSyncError(
                f"merge_lora=True: {path!r} is a peft modules_to_save copy, which merge_lora does not unwrap; fix: "
                "train without modules_to_save, or merge_and_unload() a copy and send that")
        if not _is_lora(module):
            continue
        active = module.active_adapters
        active = [active] if isinstance(active, str) else list(active)
        adapters = [a for a in active if a not in module.merged_adapters]
        for a in adapters:
            if a in (getattr(module, "lora_variant", None) or {}) or (getattr(module, "use_dora", None) or {}).get(a):
                raise WeightSyncError(
                    f"merge_lora=True: LoRA layer {path!r} adapter {a!r} is a LoRA variant (DoRA or the like), whose "
                    "merge is not a delta added to the weight; fix: use plain LoRA, or send merge_lora=False "
                    "weights and merge on the receiver")
            if (getattr(module, "lora_bias", None) or {}).get(a):
                raise WeightSyncError(
                    f"merge_lora=True: LoRA layer {path!r} adapter {a!r} has lora_bias=True, which merge_lora does not "
                    "merge; fix: train with lora_bias=False")
        out[path] = LoraLayer(path, module, adapters)
    return out


def owner(name: str, layers: Mapping[str, LoraLayer]) -> tuple[LoraLayer, str] | None:
    """The LoRA layer whose state_dict entry ``name`` is and the name relative to it, or None."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        layer = layers.get(".".join(parts[:i]))
        if layer is not None:
            return layer, ".".join(parts[i:])
    return None


def merged_name(layer: LoraLayer, relative: str) -> str | None:
    """``base_layer.weight`` -> ``<path>.weight``; None for the adapter tensors (left out)."""
    if relative.startswith("base_layer."):
        return f"{layer.path}.{relative[len('base_layer.'):]}"
    return None


def merge(layer: LoraLayer, weight: torch.Tensor, adapter_values: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``weight`` (the full base weight) plus every adapter's delta, as peft's merge computes it; a new
    tensor. ``adapter_values``: the full value of each of the layer's adapter tensors (relative names)."""
    merged = weight.clone()
    with _registered(layer.module, adapter_values):
        for a in layer.adapters:
            delta = layer.module.get_delta_weight(a)  # type: ignore[operator]
            merged += delta
    return merged


@contextlib.contextmanager
def _registered(module: nn.Module, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``values`` registered in place of the layer's adapter tensors for the duration (restored after)."""
    saved: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor | None]] = []
    try:
        for relative, value in values.items():
            prefix, _, attr = relative.rpartition(".")
            holder = module.get_submodule(prefix) if prefix else module
            table = holder._parameters if attr in holder._parameters else holder._buffers
            saved.append((table, attr, table[attr]))  # type: ignore[arg-type]
            table[attr] = value  # type: ignore[assignment]
        yield
    finally:
        for table, attr, old in reversed(saved):
            table[attr] = old
