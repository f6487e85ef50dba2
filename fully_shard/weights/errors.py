"""WeightSyncError, the one exception of the weights package: what is wrong, where, and the fix."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """Weights could not be gathered, sent or received; the message names the tensor (or rank) and the fix.

    During ``Sender.send``/``Receiver.receive`` the same error is raised on every rank of the transfer
    (trainer ranks and receivers), and the receiver's weights are left as they were before the send.
    """


def short_list(names: list[str], limit: int = 8) -> str:
    """``['a', 'b', ...] (+12 more)`` for error messages."""
    head = ", ".join(repr(n) for n in names[:limit])
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"[{head}]{more}"
