"""``no_grad()`` that costs nothing where grad mode is already off (the backward's hooks).

The runtime's buffer work (copy-ins, copy-outs, gradient views) must not be recorded by autograd. The
backward's hooks already run with grad mode off (the engine turns it off unless ``create_graph``), where
entering ``torch.no_grad()`` is pure host work, once per group per hook: there a shared null context is
returned instead.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["no_grad"]

_ALREADY_OFF = contextlib.nullcontext()  # stateless, so one object serves every (nested) use


def no_grad() -> Any:
    """``torch.no_grad()`` where grad mode is on, else a null context."""
    return torch.no_grad() if torch.is_grad_enabled() else _ALREADY_OFF
