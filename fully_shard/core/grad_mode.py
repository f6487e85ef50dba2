"""``no_grad()`` that costs nothing where grad mode is already off (the backward's hooks).

The runtime's buffer work (copy-ins, copy-outs, gradient views) must not be recorded by autograd. The
backward's hooks already run with grad mode off (the engine turns it off unless ``create_graph``), where
entering ``torch.no_grad()`` is pure host work, once per group per hook: there a shared null context is
returned instead. Where grad mode is on (the forward's unshard), a shared context that flips the C switch
``torch.no_grad`` itself ends in, without building its three Python objects per use.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["GradOff", "no_grad"]

_ALREADY_OFF = contextlib.nullcontext()  # stateless, so one object serves every (nested) use
# private (design/private-torch.md): the C switch ``torch.no_grad`` ends in, without its three Python
# objects per use (``no_grad``, then ``set_grad_enabled`` on entry and on exit); torch.no_grad without it
_set_grad_enabled = getattr(torch._C, "_set_grad_enabled", None)


class GradOff:
    """Grad mode off inside, back on at exit (only made where it was on): the C switch itself."""

    __slots__ = ()

    def __enter__(self) -> None:
        _set_grad_enabled(False)  # type: ignore[misc]

    def __exit__(self, *exc: object) -> None:
        _set_grad_enabled(True)  # type: ignore[misc]


_TURN_OFF = GradOff()  # stateless: it always restores "on", the only mode it is entered from


def no_grad() -> Any:
    """``torch.no_grad()`` where grad mode is on, else a null context."""
    if not torch.is_grad_enabled():
        return _ALREADY_OFF
    return _TURN_OFF if _set_grad_enabled is not None else torch.no_grad()
