"""Sender/Receiver on 3 gloo ranks: 2 trainer ranks (fully_shard over ranks 0 and 1) and 1 receiver rank (2)
holding a plain Hugging Face model built from a config. After every optimizer step the receiver's weights
equal the trainer's full weights (``iter_full``, cast) bitwise, full sends and deltas alike; a sparse step's
delta is small; every failure raises on every rank, in bounded time, with the receiver unchanged."""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fully_shard import ShardPlacement, fully_shard
from fully_shard.checkpoint import KeyMap, Stack
from fully_shard.weights import Receiver, Sender, WeightSyncError, iter_full, wire
from tests.distributed.harness import distributed
from tests.weights.common import Odd, llama, mixtral, same, shard_hf, train_step, trainer_mesh

TRAINERS, RECEIVER = [0, 1], 2


def _compare(got: dict[str, torch.Tensor] | None, target: nn.Module | None, receiver: int = RECEIVER) -> list[str]:
    """Collective over every rank: trainer rank 0's iter_full values vs the receiver's; the differences."""
    mine: Any = got if dist.get_rank() == 0 else (
        {k: v.detach().clone() for k, v in target.state_dict().items()} if target is not None else None)
    both: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, mine)
    sent, held = both[0], both[receiver]
    return same(sent, {k: held[k] for k in sent if k in held}) + sorted(set(sent) - set(held))


def _sync_loop(build_trainer: Any, build_receiver: Any, *, steps: int, vocab: int, dtype: torch.dtype | None = None,
               key_map: Any = None, train: Any = None, meshes: Any = None) -> list[Any]:
    """Full send, then deltas after each step; every send compared bitwise. Returns the stats.

    ``meshes()`` runs on every rank, the receiver too (a mesh's process groups are made by every rank of the
    world alike: a rank that skips one numbers its later groups differently, and the pool's next world-wide
    ``new_group`` hangs); the trainers build their model from its result."""
    rank = dist.get_rank()
    stats = []
    made = meshes() if meshes is not None else None
    if rank in TRAINERS:
        model = build_trainer(made) if meshes is not None else build_trainer()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sender = Sender(model, group=None, dst=RECEIVER, dtype=dtype, key_map=key_map, delta=True, bucket_bytes=4096)
        for step in range(steps):
            if step:
                (train or train_step)(model, opt, step, vocab)
            stats.append(sender.send())
            got = dict(iter_full(model, dtype=dtype, key_map=key_map, rank=0))
            assert _compare(got if rank == 0 else None, None) == []
    else:
        target = build_receiver()
        receiver = Receiver(target, group=None, src=0)
        for _ in range(steps):
            stats.append(receiver.receive())
            assert _compare(None, target) == []
    return stats


@distributed(world_size=3, timeout=400)
def _llama_sync(tie: bool, dtype: torch.dtype | None) -> list[Any]:
    mesh = trainer_mesh(TRAINERS)
    return _sync_loop(lambda: shard_hf(llama(tie), mesh),
                      lambda: llama(tie, seed=7).to(dtype or torch.float32),  # another init: all must arrive
                      steps=3, vocab=101, dtype=dtype)


@pytest.mark.timeout(900)
def test_llama_tied_and_untied_full_then_deltas_bitwise() -> None:
    for tie, dtype in ((True, None), (False, torch.bfloat16)):
        per_rank = _llama_sync(tie, dtype)
        modes = [s.mode for s in per_rank[RECEIVER]]
        assert modes == ["full", "delta", "delta"], modes
        assert per_rank[0][0].bytes == per_rank[RECEIVER][0].bytes > 0  # the leader sends the full payload
        assert per_rank[1][0].bytes == 0 and per_rank[1][1].bytes > 0  # every rank sends its own delta


@distributed(world_size=3, timeout=400)
def _mixtral_sync() -> list[Any]:
    mesh = trainer_mesh(TRAINERS)
    return _sync_loop(lambda: shard_hf(mixtral(), mesh), lambda: mixtral(seed=3), steps=3, vocab=61)


@pytest.mark.timeout(900)
def test_plain_moe_full_then_deltas_bitwise() -> None:
    per_rank = _mixtral_sync()
    assert [s.mode for s in per_rank[RECEIVER]] == ["full", "delta", "delta"]


def _odd_trainer(mesh: DeviceMesh) -> nn.Module:
    """Uneven rows (7 over 2 ranks), a Shard(1) weight (a delta's box is a block of columns: strided in the
    receiver's tensor), a 0-dim scale, an ignored parameter and a buffer (plain tensors: the leader's)."""
    torch.manual_seed(0)
    model = Odd()
    fully_shard(model.b, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
    fully_shard(model, mesh=mesh, ignored_params={model.pos})
    return model


def _odd_train(model: nn.Module, opt: torch.optim.Optimizer, step: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(3, 5, generator=g)).sum().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model.stat.add_(1.0)  # (a buffer that changes: sent by the leader)


def _odd_receiver() -> nn.Module:
    torch.manual_seed(4)
    return Odd()


@distributed(world_size=3, timeout=400)
def _odd_sync() -> list[Any]:
    return _sync_loop(_odd_trainer, _odd_receiver, steps=3, vocab=0, train=_odd_train,
                      meshes=lambda: trainer_mesh(TRAINERS))


@pytest.mark.timeout(900)
def test_shard1_uneven_zero_dim_ignored_full_then_deltas_bitwise() -> None:
    per_rank = _odd_sync()
    assert [s.mode for s in per_rank[RECEIVER]] == ["full", "delta", "delta"]
    assert per_rank[1][1].bytes > 0  # rank 1 sent its own columns' changes


@distributed(world_size=5, timeout=600)
def _tp_sync() -> list[Any]:
    """TP 2-D: trainer ranks 0-3 on (dp=2, tp=2), a plain model on rank 4. Every trainer rank sends the
    changes of its own block of each DTensor (a tp-column block of a colwise weight, rows of a rowwise one;
    a norm's copy on the first tp column only), plus a Replicate() 0-dim gate."""
    from tests.parallel import tp_common as tp

    rank, receiver_rank = dist.get_rank(), 4
    mesh = DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]]), mesh_dim_names=("dp", "tp"))  # (collective: all 5)
    stats = []
    if rank < 4:
        torch.manual_seed(0)
        model = tp.shard_2d(tp.tensor_parallel(tp.TPModel(gated=True), mesh["tp"]), fully_shard, mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sender = Sender(model, group=None, dst=receiver_rank, delta=True, bucket_bytes=4096)
        for step, (x, y) in enumerate(tp.data(3)):
            if step:
                tp.loss_fn(model(tp.dp_slice(x, mesh)), tp.dp_slice(y, mesh)).backward()
                opt.step()
                opt.zero_grad()
            stats.append(sender.send())
            got = dict(iter_full(model, rank=0))
            assert _compare(got if rank == 0 else None, None, receiver_rank) == []
    else:
        torch.manual_seed(3)
        target = tp.TPModel(gated=True)
        receiver = Receiver(target, group=None, src=0)
        for _ in range(3):
            stats.append(receiver.receive())
            assert _compare(None, target, receiver_rank) == []
    return stats


@pytest.mark.timeout(900)
def test_tp_2d_full_then_deltas_bitwise() -> None:
    per_rank = _tp_sync()
    assert [s.mode for s in per_rank[4]] == ["full", "delta", "delta"]
    assert all(per_rank[r][1].bytes > 0 for r in range(4))  # every trainer rank sent its own block's changes


class _PerExpert(nn.Module):
    """The receiver's plain MoE: one module per expert (``layers.i.experts.e.w1``), as HF files keep them."""

    def __init__(self) -> None:
        super().__init__()
        from tests.parallel import moe_common as moe

        self.w1 = nn.Parameter(torch.zeros(moe.DIM, moe.HIDDEN))
        self.w2 = nn.Parameter(torch.zeros(moe.HIDDEN, moe.DIM))


def _plain_per_expert() -> nn.Module:
    from tests.parallel import moe_common as moe

    torch.manual_seed(11)
    model = moe.MoEModel()
    for layer in model.layers:
        layer.experts = nn.ModuleList(_PerExpert() for _ in range(4))  # type: ignore[assignment]
    return model


EP_MAP = KeyMap(transforms=[Stack("layers.*.experts.w1", "layers.*.experts.#.w1"),
                            Stack("layers.*.experts.w2", "layers.*.experts.#.w2")])


def _ep_meshes() -> tuple[DeviceMesh, DeviceMesh]:
    """dp = {0, 1} and (efsdp=1, ep=2) over the trainers (made on every rank: mesh creation is collective)."""
    return trainer_mesh(TRAINERS), DeviceMesh("cpu", torch.tensor([TRAINERS]), mesh_dim_names=("efsdp", "ep"))


def _ep_trainer(meshes: tuple[DeviceMesh, DeviceMesh]) -> nn.Module:
    """Experts EP-sharded over ep = ranks {0, 1} ((_StridedShard(0, sf=2), Shard(0)) on (efsdp=1, ep=2)), the
    rest FSDP over dp = {0, 1}."""
    from tests.parallel import moe_common as moe

    dense, sparse = meshes
    torch.manual_seed(0)
    model = moe.expert_parallel(moe.MoEModel(), sparse["ep"])
    for layer in model.layers:
        fully_shard(layer, mesh=dense, shard_placement_fn=lambda p: (
            ShardPlacement(torch.distributed.tensor.Shard(0), mesh=sparse["efsdp"]) if moe.is_expert(p) else None))
    fully_shard(model, mesh=dense)
    return model


def _ep_train(model: nn.Module, opt: torch.optim.Optimizer, step: int, vocab: int) -> None:
    from tests.parallel import moe_common as moe

    x, y = moe.batch(step, 2)
    loss = ((model(moe.local(x)) - moe.local(y)) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


@distributed(world_size=3, timeout=400)
def _ep_sync() -> list[Any]:
    meshes = _ep_meshes()
    if dist.get_rank() in TRAINERS:
        w1 = _ep_trainer(meshes).layers[0].experts.w1
        assert isinstance(w1, DTensor) and w1.device_mesh.mesh_dim_names == ("efsdp", "ep"), w1
    return _sync_loop(_ep_trainer, _plain_per_expert, steps=3, vocab=0, key_map=EP_MAP, train=_ep_train,
                      meshes=lambda: meshes)


@pytest.mark.timeout(900)
def test_expert_parallel_unstacked_per_expert_full_then_deltas() -> None:
    per_rank = _ep_sync()
    assert [s.mode for s in per_rank[RECEIVER]] == ["full", "delta", "delta"]


@distributed(world_size=3, timeout=400)
def _sparse_step() -> list[Any]:
    """After a step that changes 1% of the elements, the delta moves at most 0.2x the full send's bytes."""
    rank = dist.get_rank()
    mesh = trainer_mesh(TRAINERS)
    if rank in TRAINERS:
        model = shard_hf(llama(False, hidden_size=64, intermediate_size=128, vocab_size=512), mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sender = Sender(model, group=None, dst=RECEIVER, delta=True)
        full = sender.send()
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 512, (2, 7), generator=g)
        model(ids, labels=ids).loss.backward()
        for p in model.parameters():  # keep 1% of each gradient: SGD changes only those elements
            local = p.grad.to_local()
            local.mul_((torch.rand(local.shape, generator=g) < 0.01).to(local.dtype))
        opt.step()
        small = sender.send()
        got = dict(iter_full(model, rank=0))  # (collective: both trainer ranks)
        assert _compare(got if rank == 0 else None, None) == []
        return [full, small]
    target = llama(False, seed=9, hidden_size=64, intermediate_size=128, vocab_size=512)
    receiver = Receiver(target, group=None)
    out = [receiver.receive(), receiver.receive()]
    assert _compare(None, target) == []
    return out


@pytest.mark.timeout(900)
def test_delta_after_a_sparse_step_is_small() -> None:
    per_rank = _sparse_step()
    full, small = per_rank[RECEIVER]
    assert (full.mode, small.mode) == ("full", "delta")
    assert 0 < small.bytes <= 0.2 * full.bytes, (small.bytes, full.bytes)
    assert sum(r[1].bytes for r in per_rank[:2]) == small.bytes  # each trainer rank sent its own part


def _flip_first_write(rank_to_corrupt: int, skip: int) -> Any:
    """Patch BucketWriter.write on one rank: the ``skip``-th write goes out with one byte flipped."""
    original = wire.BucketWriter.write
    calls = {"n": 0}

    def write(self: wire.BucketWriter, data: torch.Tensor) -> None:
        if dist.get_rank() == rank_to_corrupt and calls["n"] == skip:
            data = data.clone()
            data[-1] ^= 0x10
        calls["n"] += 1
        original(self, data)

    return mock.patch.object(wire.BucketWriter, "write", write)


@distributed(world_size=3, timeout=400)
def _errors() -> dict[str, Any]:
    """Each bad case: every rank raises WeightSyncError naming the tensor, fast; the receiver is unchanged; the
    next good send works."""
    rank = dist.get_rank()
    mesh = trainer_mesh(TRAINERS)
    found: dict[str, Any] = {}
    # a fresh pair per receiver kind; the trainer is the same Llama
    cases = [("unknown name", {"num_hidden_layers": 1}), ("shape", {"intermediate_size": 48}),
             ("dtype", {}), ("checksum full", {}), ("protocol", {}), ("checksum delta", {})]
    model = shard_hf(llama(False), mesh) if rank in TRAINERS else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if model is not None else None
    for step, (case, overrides) in enumerate(cases):
        if rank in TRAINERS:
            sender = Sender(model, group=None, dst=RECEIVER, delta=True, bucket_bytes=1024)  # type: ignore[arg-type]
            if case == "checksum delta":
                sender.send()  # the full send this delta builds on
                train_step(model, opt, step, 101)  # type: ignore[arg-type]
            patch: Any = mock.patch.object(wire, "VERSION", 99) if case == "protocol" else (
                _flip_first_write(0, 2) if case == "checksum full" else (
                    _flip_first_write(1, 0) if case == "checksum delta" else contextlib.nullcontext()))
            t0 = time.monotonic()
            try:
                with patch:
                    sender.send()
                found[case] = "no error"
            except WeightSyncError as e:
                found[case] = (str(e), time.monotonic() - t0)
            sender.send()  # a good send after the failure (the failed one changed nothing anywhere)
            got = dict(iter_full(model, rank=0))  # type: ignore[arg-type]
            assert _compare(got if rank == 0 else None, None) == []
        else:
            target = llama(False, seed=5, **overrides)
            if case == "dtype":
                target.model.norm.weight = nn.Parameter(torch.zeros(24, dtype=torch.complex64))
            receiver = Receiver(target, group=None)
            if case == "checksum delta":
                receiver.receive()
            before = {k: v.clone() for k, v in target.state_dict().items()}
            t0 = time.monotonic()
            try:
                receiver.receive()
                found[case] = "no error"
            except WeightSyncError as e:
                found[case] = (str(e), time.monotonic() - t0)
            after = target.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before), case  # unchanged
            if case in ("unknown name", "shape", "dtype"):  # a receiver whose model fits
                receiver = Receiver(llama(False, seed=5), group=None)
            mode = receiver.receive().mode
            assert mode == ("delta" if case == "checksum delta" else "full"), (case, mode)
            assert _compare(None, receiver.target) == []
    return found


@pytest.mark.timeout(900)
def test_every_error_on_every_rank_receiver_unchanged() -> None:
    per_rank = _errors()
    expect = {"unknown name": ("model.layers.1", "does not have"), "shape": ("mlp", "shape [40, 24] sent"),
              "dtype": ("model.norm.weight", "cannot take"), "checksum full": ("checksum mismatch",),
              "protocol": ("protocol mismatch", "version 99"), "checksum delta": ("checksum mismatch",)}
    for rank, found in enumerate(per_rank):
        for case, fragments in expect.items():
            assert found[case] != "no error", (rank, case)
            text, seconds = found[case]
            for f in fragments:
                assert f in text, (rank, case, f, text)
            assert "fix" in text, (rank, case, text)
            assert seconds < 60, (rank, case, seconds)  # no timeout was waited out
    # the checksum errors name the tensor whose bytes were flipped, the same on every rank
    names = {re.search(r"(\S+\.weight): checksum mismatch", found["checksum full"][0]).group(1)  # type: ignore[union-attr]
             for found in per_rank}
    assert len(names) == 1, names


@distributed(world_size=3, timeout=400)
def _load_weights_callable() -> dict[str, Any]:
    """A load_weights(iterable) callable on the receiver (an engine's), fed the changed tensors of each delta;
    a new Receiver (a restarted engine) makes the next send a full one."""
    rank = dist.get_rank()
    mesh = trainer_mesh(TRAINERS)
    if rank in TRAINERS:
        model = shard_hf(llama(True), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sender = Sender(model, group=None, dst=RECEIVER, delta=True)
        modes = []
        for step in range(4):
            if step:
                train_step(model, opt, step, 101)
            modes.append(sender.send().mode)
            got = dict(iter_full(model, rank=0))
            _gather_weights(got if rank == 0 else None)
        return {"modes": modes}
    engine: dict[str, torch.Tensor] = {}
    calls: list[int] = []

    def load_weights(weights: Any) -> None:
        n = 0
        for name, tensor in weights:
            engine[name] = tensor.clone()
            n += 1
        calls.append(n)

    receiver = Receiver(load_weights, group=None)
    for step in range(4):
        if step == 3:
            receiver = Receiver(load_weights, group=None)  # restarted: holds nothing the delta builds on
        receiver.receive()
        sent = _gather_weights(None)
        assert same(sent, engine) == [], same(sent, engine)
    return {"calls": calls}


def _gather_weights(mine: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    both: list[Any] = [None] * 3
    dist.all_gather_object(both, mine)
    return both[0]


@pytest.mark.timeout(900)
def test_load_weights_callable_and_a_restarted_receiver() -> None:
    per_rank = _load_weights_callable()
    assert per_rank[0]["modes"] == ["full", "delta", "delta", "full"]
    assert per_rank[RECEIVER]["calls"][0] == 20 and per_rank[RECEIVER]["calls"][-1] == 20
