"""HSDP on a 2x2 ("replicate", "shard") mesh of 4 gloo ranks: placements, parity, collective counts,
and set_requires_all_reduce(False) accumulation."""

from __future__ import annotations

import copy

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fully_shard import fully_shard
from fully_shard.comm import trace
from fully_shard.comm.trace import EventKind, Phase
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.policies.common import count, local_slice, max_grad_diff, train_parity


def hsdp_mesh():  # type: ignore[no-untyped-def]
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def shard_hsdp(model: TinyGPT) -> TinyGPT:
    mesh = hsdp_mesh()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@distributed(world_size=4)
def _hsdp_parity() -> dict[str, object]:
    ref = TinyGPT()
    model = shard_hsdp(copy.deepcopy(ref))
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    result: dict[str, object] = train_parity(model, ref, steps=10, batch=8)
    result["placements"] = placements
    result["n_params"] = len(list(model.parameters()))
    return result


def test_hsdp_placements_and_parity() -> None:
    for r in _hsdp_parity():
        placements = r["placements"]
        assert len(placements) == r["n_params"]
        for name, pl in placements.items():
            expected = (Replicate(), Replicate()) if name.endswith("gate") else (Replicate(), Shard(0))
            assert pl == expected, (name, pl)
        assert r["loss_diff"] < 1e-5, r
        assert r["param_diff"] < 1e-5, r


@distributed(world_size=4)
def _hsdp_collectives() -> dict[str, object]:
    ref = TinyGPT()
    model = shard_hsdp(copy.deepcopy(ref))
    x, y = batches(1, batch=8)[0]
    loss = loss_fn(model(local_slice(x)), local_slice(y))
    with trace.record() as events, CountCollectives() as counted:
        loss.backward()
    loss_fn(ref(x), y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    return {"events": [(e.kind, e.fqn, e.phase, e.group_size) for e in events],
            "counted": dict(counted.counts), "grad_diff": max_grad_diff(model, ref_grads)}


def test_hsdp_one_reduce_scatter_and_one_all_reduce_per_group() -> None:
    units = {"", "blocks.0", "blocks.1", "blocks.2"}
    for r in _hsdp_collectives():
        events = r["events"]
        rs = [(fqn, size) for kind, fqn, phase, size in events if kind is EventKind.REDUCE_SCATTER]
        ar = [(fqn, size) for kind, fqn, phase, size in events if kind is EventKind.ALL_REDUCE]
        assert sorted(rs) == sorted((u, 2) for u in units), rs  # within the 2-rank shard group
        assert sorted(ar) == sorted((u, 2) for u in units), ar  # across the 2 replicas
        # backward re-gathers the 3 blocks (the root keeps its params), all inside the shard group
        ag = [(fqn, size) for kind, fqn, phase, size in events if kind is EventKind.ALL_GATHER]
        assert sorted(ag) == [(f"blocks.{i}", 2) for i in range(3)], ag
        # the dispatcher saw the same: nothing issued behind the trace's back
        counted = r["counted"]
        assert counted.get("reduce_scatter") == 4 and counted.get("all_reduce") == 4, counted
        assert counted.get("all_gather") == 3, counted
        assert r["grad_diff"] < 1e-6, r["grad_diff"]


@distributed(world_size=4)
def _skip_all_reduce() -> dict[str, object]:
    ref = TinyGPT()
    model = shard_hsdp(copy.deepcopy(ref))
    micro = batches(2, batch=8, seed=3)
    phases: list[dict[str, object]] = []
    for i, (x, y) in enumerate(micro):
        model.set_requires_all_reduce(i == len(micro) - 1)
        with trace.record() as events:
            loss_fn(model(local_slice(x)), local_slice(y)).backward()
        phases.append({"rs": count(events, EventKind.REDUCE_SCATTER, phase=Phase.BACKWARD),
                       "ar": count(events, EventKind.ALL_REDUCE),
                       "grads": sum(p.grad is not None for p in model.parameters()),
                       "nograd": [n for n, p in model.named_parameters() if p.grad is None]})
        loss_fn(ref(x), y).backward()  # the reference accumulates the two global-batch gradients
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    return {"phases": phases, "grad_diff": max_grad_diff(model, ref_grads)}


def test_set_requires_all_reduce_false_accumulates_then_syncs() -> None:
    for r in _skip_all_reduce():
        first, second = r["phases"]
        assert (first["rs"], first["ar"], first["grads"]) == (4, 0, 0), first  # kept per replica
        assert (second["rs"], second["ar"], second["nograd"]) == (4, 4, []), second
        assert r["grad_diff"] < 1e-6, r["grad_diff"]
