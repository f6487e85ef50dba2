"""The profiler's measurements: one collective, per-kind totals, one unit in one step, one step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Collective:
    """One collective of one step, times in seconds on the host's ``perf_counter`` clock."""

    kind: str  # all_gather | reduce_scatter | all_reduce | optimizer_collective
    unit: str  # the unit's module FQN ("" for the root)
    phase: str  # forward | backward | explicit
    nbytes: int
    group_size: int
    prefetch: bool
    t_issue: float
    t_done: float
    exposed_s: float
    t_wait: float  # when the consumer began waiting (0: not waited inside the step)

    @property
    def time_s(self) -> float:
        return max(0.0, self.t_done - self.t_issue)


@dataclass
class CommStats:
    count: int = 0
    bytes: int = 0
    time_s: float = 0.0
    exposed_s: float = 0.0

    def add(self, c: Collective) -> None:
        self.count += 1
        self.bytes += c.nbytes
        self.time_s += c.time_s
        self.exposed_s += c.exposed_s

    @property
    def overlapped_s(self) -> float:
        return max(0.0, self.time_s - self.exposed_s)

    def merged(self, other: CommStats) -> CommStats:
        return CommStats(self.count + other.count, self.bytes + other.bytes, self.time_s + other.time_s,
                         self.exposed_s + other.exposed_s)


@dataclass
class UnitStats:
    """One unit in one step."""

    unit: str
    gathered_bytes: int = 0
    all_gather_forward: CommStats = field(default_factory=CommStats)
    all_gather_backward: CommStats = field(default_factory=CommStats)
    all_gather_explicit: CommStats = field(default_factory=CommStats)
    reduce_scatter: CommStats = field(default_factory=CommStats)
    all_reduce: CommStats = field(default_factory=CommStats)
    memory_at_unshard: int = 0  # max memory sampled when this unit's params became usable

    @property
    def comm(self) -> CommStats:
        total = CommStats()
        for s in (self.all_gather_forward, self.all_gather_backward, self.all_gather_explicit,
                  self.reduce_scatter, self.all_reduce):
            total = total.merged(s)
        return total


@dataclass
class StepStats:
    index: int
    t_start: float
    t_end: float
    units: dict[str, UnitStats]
    collectives: list[Collective]
    peak_memory: int
    memory_start: int
    mem_kind: str
    peak_is_lifetime: bool

    @property
    def step_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed_s for c in self.collectives)

    @property
    def busy_s(self) -> float:
        """Time with at least one collective in flight (union of issue->done intervals)."""
        spans = sorted((max(c.t_issue, self.t_start), min(c.t_done, self.t_end)) for c in self.collectives)
        total, end = 0.0, float("-inf")
        for s, e in spans:
            if e <= s:
                continue
            if s > end:
                total += e - s
                end = e
            elif e > end:
                total += e - end
                end = e
        return total

    def bytes_of(self, kind: str) -> int:
        return sum(c.nbytes for c in self.collectives if c.kind == kind)
