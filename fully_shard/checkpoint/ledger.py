"""What a load writes into the model and optimizer: its planned reads, and how much of each tensor they wrote.

A ``Read`` is one box of a stored chunk bound for a view of a target tensor. The ``Ledger`` of a load
knows every tensor of the user's model and optimizer that its reads write into, counts the elements
written into each as the copies happen (marking a tensor before its first byte is written, so a copy
that fails half way still counts it), and which files those bytes came from. When a load fails after
it started writing (an in-place load whose digest fails, an I/O error while copying), ``written``
says exactly what each tensor of this rank now holds: the partial-load report of reader.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .boxes import Box


@dataclass
class Read:
    """One contiguous read: a box of a stored tensor into a destination view (also consolidate.py's)."""

    file: str
    key: str
    src: Box  # the part of the stored chunk tensor, relative to the chunk
    dst: torch.Tensor  # where it goes (a view of the target)
    take: Callable[[torch.Tensor], None] | None = None  # fresh ``dst`` of a whole chunk: may take a view instead
    name: str = ""  # the logical tensor ``dst`` belongs to (model FQN, or "fqn/state"), for the ledger


@dataclass(frozen=True)
class Written:
    """What a failed load left in this rank's tensors, by logical name, in the order the load planned them."""

    whole: tuple[str, ...]  # every element overwritten
    partly: tuple[str, ...]  # some elements overwritten, the rest as before the load
    untouched: tuple[str, ...]  # as before the load
    unverified: tuple[str, ...]  # of whole + partly: bytes from a file whose digest had not passed on this rank


@dataclass
class Ledger:
    """The tensors a load writes into, and the elements of each written so far (see the module doc)."""

    need: dict[str, int] = field(default_factory=dict)  # name -> elements the load writes into it (plan order)
    done: dict[str, int] = field(default_factory=dict)  # name -> elements written so far (present once begun)
    sources: dict[str, set[str]] = field(default_factory=dict)  # name -> files its written bytes came from

    def expect(self, reads: Iterable[Read]) -> None:
        """Plan: these reads write into the user's tensors."""
        for r in reads:
            self.need[r.name] = self.need.get(r.name, 0) + r.src.numel

    def begin(self, read: Read) -> None:
        """Bytes of ``read`` are about to be written (call before the first byte)."""
        self.done.setdefault(read.name, 0)
        self.sources.setdefault(read.name, set()).add(read.file)

    def wrote(self, read: Read, numel: int) -> None:
        self.done[read.name] = self.done.get(read.name, 0) + numel

    @property
    def started(self) -> bool:
        return bool(self.done)

    def written(self, verified: Callable[[str], bool]) -> Written:
        """The state of every planned tensor; ``verified(file)``: that file's digest passed on this rank."""
        whole = tuple(n for n, need in self.need.items() if n in self.done and self.done[n] >= need)
        partly = tuple(n for n, need in self.need.items() if n in self.done and self.done[n] < need)
        untouched = tuple(n for n in self.need if n not in self.done)
        unverified = tuple(n for n in self.need if n in self.done
                           and not all(verified(f) for f in self.sources.get(n, ())))
        return Written(whole, partly, untouched, unverified)
