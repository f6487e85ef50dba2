"""Profiler: per-unit counts and bytes against the known model sizes, timing invariants, exports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import MixedPrecisionPolicy, fully_shard
from fully_shard.comm import trace
from fully_shard.core.state import get_state
from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory
from fully_shard.tools.profile import Profiler, profile
from tests.core.common import local_slice
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


def _shard(model: TinyGPT, raf: bool, **kwargs: Any) -> TinyGPT:
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=raf, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _gathered(model: TinyGPT) -> dict[str, int]:
    """Unit FQN -> bytes of its all-gather buffer, read from the groups (padding included)."""
    out = {}
    for m in model.modules():
        state = get_state(m)
        if state is not None and state.group is not None:
            out[state.group.fqn] = state.group.unsharded_nbytes
    return out


def _train(model: TinyGPT, steps: int, prof: Profiler | None = None, batch: int = 6) -> CountCollectives:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CountCollectives() as counts:
        for x, y in batches(steps, batch=batch):
            loss_fn(model(local_slice(x)), local_slice(y)).backward()
            opt.step()
            opt.zero_grad()
            if prof is not None:
                prof.step()
    return counts


@distributed(world_size=2)
def _counts_and_bytes(raf: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _shard(TinyGPT(n_blocks=3), raf)
    _train(model, 1)  # warm-up: the forward order (and so prefetching) is known from step 2 on
    gathered = _gathered(model)
    steps = 3
    with profile(model) as prof:
        counts = _train(model, steps, prof)
    assert not trace.enabled(), "the profiler's observer must be gone after the block"
    assert len(prof.steps) == steps, [s.index for s in prof.steps]
    blocks = [f"blocks.{i}" for i in range(3)]
    for st in prof.steps:
        assert set(st.units) == {"", *blocks}, st.units.keys()
        for name, u in st.units.items():
            g = gathered[name]
            resharded = raf and name != ""  # the root keeps its params for backward by default
            assert u.gathered_bytes == g
            assert (u.all_gather_forward.count, u.all_gather_forward.bytes) == (1, g), (name, u)
            assert (u.all_gather_backward.count, u.all_gather_backward.bytes) == ((1, g) if resharded else (0, 0)), \
                (name, u)
            assert u.reduce_scatter.count == 1 and u.reduce_scatter.bytes == g, (name, u)  # fp32 grads, same layout
            assert u.all_reduce.count == 0
            total_ag = u.all_gather_forward.bytes + u.all_gather_backward.bytes
            assert total_ag == (2 * g if resharded else g), (name, total_ag, g)
            for c in (u.all_gather_forward, u.all_gather_backward, u.reduce_scatter):
                assert c.time_s >= c.exposed_s >= 0.0, (name, c)
                assert abs(c.overlapped_s + c.exposed_s - c.time_s) < 1e-9
            assert u.memory_at_unshard > 0
        assert st.step_s > 0 and st.peak_memory > 0
        assert 0.0 <= st.busy_s <= st.step_s + 1e-6
        for c in st.collectives:
            assert st.t_start - 1.0 < c.t_issue <= c.t_done, c
    # cross-check against the collectives counted at the dispatcher (independent of trace.py)
    n_units, n_regather = 4, (3 if raf else 0)
    assert counts.counts["all_gather"] == steps * (n_units + n_regather), counts.counts
    assert counts.counts["reduce_scatter"] == steps * n_units, counts.counts
    s = prof.summary()
    model_bytes = sum(p.numel() * p.element_size() for p in TinyGPT(n_blocks=3).parameters())
    assert s["model_bytes"] == model_bytes
    expected_ag = sum(gathered.values()) + (sum(v for k, v in gathered.items() if k) if raf else 0)
    assert s["all_gather_bytes"] == expected_ag
    assert s["reduce_scatter_bytes"] == sum(gathered.values())
    padding = sum(gathered.values()) / model_bytes  # >= 1: padded shards
    assert 1.0 <= padding < 1.01
    ref = TinyGPT(n_blocks=3)
    block_bytes = sum(p.numel() * p.element_size() for p in ref.blocks.parameters())
    # 1x all-gathered in forward + 1x reduce-scattered, + 1x re-gathered for the units resharded after
    # forward (the blocks; never the root)
    assert s["expected_bytes_over_model"] == pytest.approx(2.0 + (block_bytes / model_bytes if raf else 0.0))
    assert abs(s["bytes_over_model"] - s["expected_bytes_over_model"] * padding) < 0.02, s
    assert 0.0 <= s["comm_share"] <= 1.0 and s["comm_busy_s"] >= 0
    return {"table": prof.table(), "json": prof.to_json(), "summary": s}


@pytest.mark.parametrize("raf", [True, False])
def test_counts_and_bytes_per_unit(raf: bool) -> None:
    results = _counts_and_bytes(raf)
    table = results[0]["table"]
    for name in ("<root>", "blocks.0", "blocks.1", "blocks.2", "step", "bytes/step", "peak memory (RSS)"):
        assert name in table, table
    expected = f"expected {results[0]['summary']['expected_bytes_over_model']:.2f}x"
    assert expected in table and ("expected 2.00x" in table) != raf, table
    data = json.loads(results[0]["json"])
    assert {"summary", "units", "unit_table", "steps"} <= data.keys()
    assert len(data["steps"]) == 3 and data["steps"][0]["collectives"]
    assert {u["unit"] for u in data["unit_table"]} == {"<root>", "blocks.0", "blocks.1", "blocks.2"}


@distributed(world_size=2)
def _mixed_precision_and_hsdp() -> dict[str, Any]:
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard(TinyGPT(n_blocks=2, zero_dim=False), True, mp_policy=mp)
    _train(model, 1)
    with profile(model) as prof:
        _train(model, 1)
    u = prof.steps[0].units["blocks.0"]
    numel = u.gathered_bytes // 2
    assert u.all_gather_forward.bytes == numel * 2  # bf16 all-gather
    assert u.reduce_scatter.bytes == numel * 4  # fp32 reduce-scatter
    s = prof.summary()  # bf16 gathers (1x + 1x for the blocks) + fp32 reduce-scatter (2x the bf16 bytes)
    ref = TinyGPT(n_blocks=2, zero_dim=False)
    total = sum(p.numel() for p in ref.parameters())
    blocks = sum(p.numel() for p in ref.blocks.parameters())
    assert s["expected_bytes_over_model"] == pytest.approx((total + blocks + 2 * total) / total)
    assert abs(s["bytes_over_model"] - s["expected_bytes_over_model"]) < 0.03, s
    assert "reduced in float32" in prof.table()
    # HSDP on a (2 replicas x 1 shard) mesh: a reduce-scatter within the shard group plus an all-reduce
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    hsdp = _shard(TinyGPT(n_blocks=2), True, mesh=mesh)
    _train(hsdp, 1)
    with profile(hsdp) as prof2:
        _train(hsdp, 2, prof2)
    for st in prof2.steps:
        for name, unit in st.units.items():
            assert unit.all_reduce.count == 1, (name, unit)
            assert unit.all_reduce.bytes == unit.reduce_scatter.bytes  # shard group of 1: the whole buffer
            assert unit.all_reduce.time_s >= unit.all_reduce.exposed_s >= 0
    return {"hsdp_table": prof2.table()}


def test_mixed_precision_bytes_and_hsdp_all_reduce() -> None:
    results = _mixed_precision_and_hsdp()
    assert "all-reduce" in results[0]["hsdp_table"]


@distributed(world_size=2)
def _chrome_trace(path: str) -> None:
    torch.manual_seed(0)
    model = _shard(TinyGPT(n_blocks=3), True)
    _train(model, 1)
    with profile(model) as prof:
        _train(model, 2, prof)
    rank = torch.distributed.get_rank()
    out = Path(path) / f"trace.{rank}.json"
    prof.export_chrome_trace(out)
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in slices}
    for expected in ("step 0", "step 1", "all_gather blocks.0 fwd", "all_gather blocks.0 bwd",
                     "reduce_scatter blocks.2 bwd", "all_gather <root> fwd"):
        assert expected in names, sorted(names)
    n_collectives = sum(len(s.collectives) for s in prof.steps)
    assert len([e for e in slices if e["tid"] != 0]) == n_collectives
    for e in slices:
        assert e["pid"] == rank and e["ts"] >= 0 and e["dur"] >= 0, e
    # slices of one track never partially overlap (Chrome needs them nested or disjoint)
    by_tid: dict[int, list[dict[str, Any]]] = {}
    for e in slices:
        by_tid.setdefault(e["tid"], []).append(e)
    for tid, track in by_tid.items():
        stack: list[float] = []
        for e in sorted(track, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + 1e-3, (tid, e)
            stack.append(end)
    thread_names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "host / compute" in thread_names and "all_gather #0" in thread_names


def test_chrome_trace_well_formed(tmp_path: Path) -> None:
    _chrome_trace(str(tmp_path))


def test_profile_rejects_unsharded_model() -> None:
    with pytest.raises(ValueError, match="fully_shard units, found none"):
        profile(torch.nn.Linear(2, 2))


def test_memory_helpers_track_allocations() -> None:
    assert current_memory() > 0
    if not reset_peak_memory():
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    before = peak_memory()
    x = torch.ones(32 * 2**20 // 4)  # 32 MiB, touched
    peak = peak_memory()
    del x
    assert peak - before >= 30 * 2**20, (before, peak)
