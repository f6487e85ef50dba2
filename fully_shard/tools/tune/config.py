"""What the tuner sweeps and records: one configuration, its result, and the spec the ranks receive."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

RECORDS = "records.rank{rank}.jsonl"  # one JSON line per event, per rank, in the work directory


@dataclass(frozen=True)
class TuneConfig:
    id: int
    blocks_per_unit: int
    reshard_after_forward: bool

    @property
    def label(self) -> str:
        return f"k={self.blocks_per_unit} {'reshard' if self.reshard_after_forward else 'keep'}"


@dataclass
class TuneResult:
    config: TuneConfig
    units: int = 0
    step_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None  # max over ranks
    peak_bytes_per_rank: list[int] = field(default_factory=list)
    comm_share: float | None = None  # exposed communication / step time, mean over ranks
    comm_busy_share: float | None = None
    bytes_over_model: float | None = None
    error: str | None = None
    fits: bool | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.step_s is not None


class SweepSpec(TypedDict):
    """The command line as the ranks need it (factories as ``module:function`` strings)."""

    model: str
    batch: str
    loss: str | None
    blocks: str | None
    steps: int
    warmup: int
    bf16: bool
    device: str  # auto | cpu
    threads: int
    timeout_s: float
    agree_timeout_s: float
    sys_path: list[str]


class LaunchSpec(SweepSpec):
    """One launch of the ranks: the configurations still pending, and where to record them."""

    configs: list[dict[str, Any]]  # asdict(TuneConfig)
    attempt: int
    work_dir: str


def granularities(n_blocks: int) -> list[int]:
    """1, 2, 4, ... below ``n_blocks``, then ``n_blocks`` (the whole stack as one unit)."""
    ks, k = [], 1
    while k < n_blocks:
        ks.append(k)
        k *= 2
    return [*ks, n_blocks]


def sweep_configs(n_blocks: int, ks: Sequence[int] | None = None,
                  reshard: Sequence[bool] = (True, False)) -> list[TuneConfig]:
    ks = list(ks) if ks else granularities(n_blocks)
    return [TuneConfig(i, k, raf) for i, (k, raf) in enumerate((k, raf) for k in ks for raf in reshard)]
