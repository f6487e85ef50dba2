"""Create an optimizer's state before its first step, exactly as that step would, without stepping.

A replica group that heals copies its peer's optimizer state into its own state tensors, and a group that
serves its state must hold one from step 0 on, so the state has to exist before the first step. The usual
trick (torchtitan's: a step with zero gradients at learning rate 0) also runs the step's bookkeeping:
AdamW's step count becomes 1 and its bias correction is shifted for the whole run. Here the entries are
built the way torch's ``_init_group`` builds them on the first step (zeros like the parameter, a step
count of 0), so the first real step runs the same arithmetic as without this call, bit for bit.

Only classes whose first-step state is known are pre-created (exact classes: a subclass may keep other
state): ``Adam``, ``AdamW``, and ``SGD`` with momentum and no dampening (its buffer is created from the
first gradient otherwise, which zeros cannot reproduce). Any other optimizer keeps creating its state in its
first step; recovery then creates the entries a peer sends (recovery.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer

__all__ = ["create_optimizer_state", "creates_state"]


def _scalar_dtype(fused: bool | None) -> torch.dtype:
    """torch's ``_get_scalar_dtype``: the dtype of Adam's step count."""
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _adam_entry(group: dict[str, Any], p: torch.Tensor) -> dict[str, Any] | None:
    if group.get("capturable") or group.get("fused"):
        step = torch.zeros((), dtype=_scalar_dtype(group.get("fused")), device=p.device)
    else:
        step = torch.tensor(0.0, dtype=_scalar_dtype(None), device="cpu")
    entry = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        entry["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return entry


def _sgd_entry(group: dict[str, Any], p: torch.Tensor) -> dict[str, Any] | None:
    if group["momentum"] == 0 or group.get("dampening", 0) != 0:
        return None  # no state, or a buffer the first step clones from the gradient
    # the first step with this buffer: buf * momentum + grad * (1 - 0) = grad, what clone(grad) gives
    return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}


_ENTRIES: dict[type[Optimizer], Callable[[dict[str, Any], torch.Tensor], dict[str, Any] | None]] = {
    Adam: _adam_entry, AdamW: _adam_entry, SGD: _sgd_entry,
}


def creates_state(optimizer: Optimizer) -> bool:
    """Whether ``create_optimizer_state`` knows this optimizer's first-step state."""
    return type(optimizer) in _ENTRIES


def create_optimizer_state(optimizer: Optimizer) -> int:
    """Give every trainable parameter without state the entry its first step would create; return how
    many entries were created (0 for an optimizer this module does not know: its first step creates them).
    Runs no step: step counts stay 0, parameters unchanged."""
    make = _ENTRIES.get(type(optimizer))
    if make is None:
        return 0
    created = 0
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad or optimizer.state.get(p):
                    continue
                entry = make(group, p)
                if entry is not None:
                    optimizer.state[p] = entry
                    created += 1
    return created
