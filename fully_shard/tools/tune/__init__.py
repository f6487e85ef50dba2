"""Wrap-granularity tuner: sweep blocks-per-unit x reshard_after_forward, measure, recommend.

    python -m fully_shard.tune --model models.gpt:build_model --batch models.gpt:build_batch \\
        --world-size 2 --memory-budget-mb 300 --out runs/tune

It launches ``--world-size`` ranks itself with torch's elastic launcher and, at the fixed batch the
batch factory returns, tries ``k`` = 1, 2, 4, ... and all consecutive blocks per fully_shard unit,
each with ``reshard_after_forward`` True and False. For each configuration it measures the peak memory
per rank (CUDA allocator peak on GPU; peak RSS above the idle process on CPU), the step time (slowest
rank, median) and the share of the step spent waiting for communication (``fully_shard.profile``).
It prints a table, marks the configurations that fit the budget, recommends the fastest one that fits
with the reason, and writes ``tune.json`` and ``tune.png`` (memory vs step time) into ``--out``.

Factories: ``--model pkg.mod:fn`` returns the (unsharded) model; ``--batch pkg.mod:fn`` returns
``(inputs, targets)`` or ``inputs`` and may take the rank as its one argument. The loss is
``--loss pkg.mod:fn(output, targets)`` or, by default, cross-entropy for integer targets, mean squared
error for float targets, and ``output.float().pow(2).mean()`` without targets. The blocks are the
children of the ``nn.ModuleList`` named by ``--blocks`` (default: the largest ModuleList/Sequential of
same-class modules); the units are made by ``wrap.auto_wrap`` with a ``GranularityPolicy``.

A configuration that fails (an exception, an out-of-memory error, a rank that dies or hangs) is
recorded with its error and the sweep goes on: each configuration runs in its own process group, the
ranks agree through the rendezvous store on whether it finished, and if a rank is gone or stuck the
remaining configurations are relaunched in fresh processes.
"""

from __future__ import annotations

from .cli import main, parse_args
from .config import TuneConfig, TuneResult, granularities, sweep_configs
from .factories import default_loss, find_blocks, load_object, shard_by_granularity
from .report import format_table, plot, recommend
from .sweep import run_sweep

__all__ = [
    "TuneConfig",
    "TuneResult",
    "default_loss",
    "find_blocks",
    "format_table",
    "granularities",
    "load_object",
    "main",
    "parse_args",
    "plot",
    "recommend",
    "run_sweep",
    "shard_by_granularity",
    "sweep_configs",
]
