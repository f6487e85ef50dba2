"""CheckpointError, the one exception of the checkpoint package (PartialLoadError: a load that had started
writing), and the helpers that word its messages.

Every message names the file or key that is wrong, what was expected and found, and the fix. Structure
mismatches (model vs checkpoint, state dict vs model) print a diff: missing, unexpected, dtype/shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Signature = tuple[str, tuple[int, ...]]  # (dtype name, global shape)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, loaded or consolidated; the message names the file/key and the fix."""


class PartialLoadError(CheckpointError):
    """``checkpoint.load`` failed after it had begun writing into the model or optimizer (an in-place load
    whose digest failed or whose file ended early, or an I/O error while copying): the message, and these
    attributes, say what this rank's tensors hold now (logical names: model FQNs, ``"fqn/state"`` for
    optimizer state). Every rank raises one, each with its own tensors."""

    def __init__(self, message: str, *, rank: int, whole: tuple[str, ...], partly: tuple[str, ...],
                 untouched: tuple[str, ...], unverified: tuple[str, ...]) -> None:
        super().__init__(message)
        self.rank = rank
        self.whole = whole  # every element overwritten by this load
        self.partly = partly  # some elements overwritten, the others as before
        self.untouched = untouched  # as before the load
        self.unverified = unverified  # of whole + partly: written from a file whose digest had not passed here


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def structure_diff(expected: Mapping[str, Signature],
                   found: Mapping[str, Signature]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, mismatched) names; mismatched lines show expected vs found dtype[shape]."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = []
    for name in expected:
        if name in found and expected[name] != found[name]:
            mismatched.append(f"{name}: expected {_sig(expected[name])}, found {_sig(found[name])}")
    return missing, unexpected, mismatched


def check_structure(expected: Mapping[str, Signature], found: Mapping[str, Signature], *, strict: bool,
                    title: str, fix: str) -> None:
    """Raise CheckpointError with the diff when ``found`` differs from ``expected`` (dtype/shape
    differences always; missing/unexpected names only when ``strict``)."""
    missing, unexpected, mismatched = structure_diff(expected, found)
    if not strict:
        missing, unexpected = [], []
    if missing or unexpected or mismatched:
        raise CheckpointError(format_diff(title, missing, unexpected, mismatched, fix))


def format_diff(title: str, missing: Sequence[str], unexpected: Sequence[str], mismatched: Sequence[str],
                fix: str, limit: int = 20) -> str:
    lines = [title]
    for label, items in (("missing in checkpoint (expected by the model)", missing),
                         ("unexpected in checkpoint (not in the model)", unexpected),
                         ("dtype/shape differs", mismatched)):
        if items:
            lines.append(f"  {label}: {len(items)}")
            lines += [f"    - {item}" for item in items[:limit]]
            if len(items) > limit:
                lines.append(f"    ... and {len(items) - limit} more")
    lines.append(f"  fix: {fix}")
    return "\n".join(lines)


def _sig(sig: Signature) -> str:
    return f"{sig[0]}{list(sig[1])}"
