"""Runtime behaviour: collective counts, event order, accumulation, and the forward/backward edge cases."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fully_shard import FSDPModule, fully_shard, register_fsdp_forward_method
from fully_shard.comm import trace
from tests.core.common import local_slice, shard_aux, shard_gpt, step_pair, train_aux
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import AuxGPT, TinyGPT, batches, loss_fn


@distributed(world_size=2)
def _collective_counts() -> dict[str, Any]:
    x, y = batches(1)[0]
    out: dict[str, Any] = {}
    for raf in (True, False):
        torch.manual_seed(0)
        model = shard_gpt(TinyGPT(), reshard_after_forward=raf)
        for step in range(2):  # the second step runs with implicit prefetching
            with CountCollectives() as fwd:
                loss = loss_fn(model(local_slice(x)), local_slice(y))
            with CountCollectives() as bwd:
                loss.backward()
            out[f"raf={raf} step={step}"] = (dict(fwd.counts), dict(bwd.counts))
            groups = 4  # 3 blocks + root; torch's count too (ranks' calls are checked at fully_shard())
            assert fwd.counts == {"all_gather": groups}, fwd.counts
            expected_bwd = {"reduce_scatter": groups}
            if raf:
                expected_bwd["all_gather"] = 3  # blocks re-gather; the root kept its params
            assert bwd.counts == expected_bwd, bwd.counts
    return out


def test_collective_counts_per_forward_and_backward() -> None:
    _collective_counts()


@distributed(world_size=2)
def _accumulation() -> None:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = shard_gpt(copy.deepcopy(ref))
    micro = batches(3, batch=4)
    with CountCollectives() as mode:
        for i, (x, y) in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            loss_fn(model(local_slice(x)), local_slice(y)).backward()
    assert mode.counts["reduce_scatter"] == 4, mode.counts  # once per group, not 3x
    assert mode.counts["all_gather"] == 3 * 4 + 3 * 3, mode.counts  # forwards + backward re-gathers
    for x, y in micro:
        loss_fn(ref(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad,
                                   atol=2e-6, rtol=1e-4)


def test_gradient_accumulation_reduces_once() -> None:
    _accumulation()


@distributed(world_size=2)
def _event_order() -> list[list[str]]:
    torch.manual_seed(0)
    model = shard_gpt(TinyGPT())
    x, y = batches(1, batch=16)[0]  # 8 sequences per rank: the CPU queue's budget lets reduces overlap
    orders = []
    for _ in range(2):
        with trace.record() as events:
            loss = loss_fn(model(local_slice(x)), local_slice(y))
            loss.backward()
        orders.append([e.short() for e in events])
    first, second = orders
    # backward prefetch follows the order units ended forward: the root (ended last) prefetches the
    # last block, whose re-gather then overlaps the head's backward; every block gather is a prefetch
    backward_gathers = [(e.fqn, e.prefetch) for e in events
                        if e.kind is trace.EventKind.ALL_GATHER and e.phase is trace.Phase.BACKWARD]
    assert backward_gathers == [("blocks.2", True), ("blocks.1", True), ("blocks.0", True)], backward_gathers
    assert first == [
        "all_gather <root>", "unshard <root>",
        "all_gather blocks.0", "unshard blocks.0", "reshard blocks.0",
        "all_gather blocks.1", "unshard blocks.1", "reshard blocks.1",
        "all_gather blocks.2", "unshard blocks.2", "reshard blocks.2",
        # backward: the root kept its params (reshard_after_forward=None -> False for the root)
        # (a unit reshards as soon as its grads are taken, then reduce-scatters them: lower peak memory)
        "all_gather blocks.2", "unshard blocks.2", "reshard blocks.2", "reduce_scatter blocks.2",
        # on CPU a reduce's input stays held only once the backward has released its bytes (ReduceQueue):
        # a block's weights kept 128 rows x 337 input features in fp32 (168.5 KiB) and it leaves a 66 KiB
        # shard: 102 KiB released after blocks.2 < its 132 KiB input: the host waits for it at once (its
        # input goes), but it finishes (hooks, grads) where the limit puts every reduce, whatever the shapes:
        # just before the next unit takes its grads and allocates its own buffers (205 KiB after blocks.1:
        # from then on one input stays in flight behind the next unit's backward)
        "all_gather blocks.1", "unshard blocks.1", "reduce_done blocks.2", "reshard blocks.1",
        "reduce_scatter blocks.1",
        "all_gather blocks.0", "unshard blocks.0", "reduce_done blocks.1", "reshard blocks.0",
        "reduce_scatter blocks.0",
        "reduce_done blocks.0", "reshard <root>", "reduce_scatter <root>",
        "reduce_done <root>",  # the end-of-backward callback drains the queue
    ], first
    # from the second step on, the next unit's all-gather is issued before this unit's compute
    assert second[:6] == ["all_gather <root>", "unshard <root>", "all_gather blocks.0",
                          "unshard blocks.0", "all_gather blocks.1", "reshard blocks.0"], second
    assert second.index("all_gather blocks.1", 12) < second.index("reduce_scatter blocks.2"), second
    return orders


def test_event_order_forward_backward_and_prefetch() -> None:
    _event_order()


class TwoHeads(nn.Module):
    """Returns a dict (non-tensor container) with one unused output; one child is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.used = nn.Linear(8, 4)
        self.unused_out = nn.Linear(8, 4)
        self.never_called = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.body(x)
        h = self.body(h)  # the same unit runs twice in one forward
        return {"used": self.used(h), "aux": [self.unused_out(h)], "note": "not a tensor"}


@distributed(world_size=2)
def _edge_cases() -> None:
    torch.manual_seed(0)
    ref = TwoHeads()
    model = copy.deepcopy(ref)
    for name in ("body", "used", "unused_out", "never_called"):
        fully_shard(getattr(model, name))
    fully_shard(model)
    x = torch.randn(4, 8)
    for _ in range(2):
        out = model(local_slice(x))
        assert out["note"] == "not a tensor"
        out["used"].pow(2).mean().backward()
        ref(x)["used"].pow(2).mean().backward()
    for child in ("unused_out", "never_called"):
        assert all(p.grad is None for p in getattr(model, child).parameters()), child
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad)
        assert isinstance(p, DTensor), f"{name} left unsharded after backward"


def test_multi_forward_unused_outputs_and_containers() -> None:
    _edge_cases()


class CheckpointedGPT(TinyGPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            h = checkpoint(blk, h, use_reentrant=False)
        return self.head(self.norm(h))


@distributed(world_size=2)
def _checkpoint_and_no_grad() -> None:
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    model = shard_gpt(CheckpointedGPT())  # same seed, same constructor: same weights as ref
    x, y = batches(1)[0]
    loss_fn(model(local_slice(x)), local_slice(y)).backward()
    loss_fn(ref(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad,
                                   atol=2e-6, rtol=1e-4)
    with torch.no_grad():
        out = model(local_slice(x))
        torch.testing.assert_close(out, ref(local_slice(x)), atol=1e-5, rtol=1e-5)
    assert all(isinstance(p, DTensor) for blk in model.blocks for p in blk.parameters())


def test_activation_checkpointing_and_no_grad_forward() -> None:
    _checkpoint_and_no_grad()


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x))


@distributed(world_size=2)
def _user_methods() -> None:
    torch.manual_seed(0)
    ref = Generator()
    model = fully_shard(copy.deepcopy(ref))
    assert isinstance(model, FSDPModule) and type(model).__name__ == "FSDPGenerator"
    register_fsdp_forward_method(model, "generate")
    x = torch.randn(3, 6)
    torch.testing.assert_close(model.generate(x), ref.generate(x))
    assert not isinstance(model.lin.weight, DTensor)  # the root keeps its params after forward
    model.reshard()
    model.set_reshard_after_forward(True)
    torch.testing.assert_close(model.generate(x), ref.generate(x))
    assert isinstance(model.lin.weight, DTensor)  # now resharded right after generate
    handle = model.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    assert not isinstance(model.lin.weight, DTensor)
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)
    model.reshard()
    assert isinstance(model.lin.weight, DTensor)
    assert "lin.weight f32[6@shard/2, 6] SHARDED" in model.fsdp_repr(), model.fsdp_repr()


def test_register_forward_method_unshard_reshard_repr() -> None:
    _user_methods()


@distributed(world_size=2)
def _explicit_prefetch() -> list[str]:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = shard_gpt(copy.deepcopy(ref))
    blocks = list(model.blocks)
    for i, blk in enumerate(blocks):
        blk.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        blk.set_modules_to_backward_prefetch(blocks[max(i - 2, 0):i][::-1])
    x, y = batches(1)[0]
    with trace.record() as events:
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
    loss_fn(ref(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad,
                                   atol=2e-6, rtol=1e-4)
    order = [e.short() for e in events]
    # block 0 prefetches blocks 1 and 2 before it is resharded
    assert order.index("all_gather blocks.2") < order.index("reshard blocks.0"), order
    return order


def test_explicit_prefetch_keeps_numerics() -> None:
    _explicit_prefetch()


@distributed(world_size=2)
def _tied_params() -> None:
    torch.manual_seed(0)
    ref = TinyGPT(tied=True)
    model = copy.deepcopy(ref)
    assert model.head.weight is model.tok.weight
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard([model.tok, model.head])
    fully_shard(model)
    assert model.head.weight is model.tok.weight
    counts = Counter(type(p).__name__ for p in model.parameters())
    assert counts == {"DTensor": len(list(ref.parameters()))}, counts
    x, y = batches(1)[0]
    loss_fn(model(local_slice(x)), local_slice(y)).backward()
    loss_fn(ref(x), y).backward()
    torch.testing.assert_close(model.tok.weight.grad.full_tensor(), ref.tok.weight.grad, atol=2e-6, rtol=1e-4)


def test_tied_parameters_as_one_unit() -> None:
    _tied_params()


@distributed(world_size=2)
def _reshard_after_backward_and_last_backward() -> None:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = shard_gpt(copy.deepcopy(ref))
    micro = batches(2, batch=4)
    model.set_reshard_after_backward(False)  # with no reshard after forward: gather once for all
    model.set_reshard_after_forward(False)  # micro-batches
    model.set_is_last_backward(False)
    x, y = micro[0]
    loss_fn(model(local_slice(x)), local_slice(y)).backward()
    assert not isinstance(model.blocks[0].up.weight, DTensor)  # kept unsharded for the next micro-batch
    with CountCollectives() as second:
        model.set_is_last_backward(True)
        x, y = micro[1]
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
    assert "all_gather" not in second.counts, second.counts  # nothing re-gathered
    for x, y in micro:
        loss_fn(ref(x), y).backward()
    model.reshard()
    for blk in model.blocks:
        blk.reshard()
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad,
                                   atol=2e-6, rtol=1e-4)
    dist.barrier()


def test_reshard_after_backward_false_and_is_last_backward() -> None:
    _reshard_after_backward_and_last_backward()


@distributed(world_size=2)
def _unused_backward_prefetch() -> dict[str, list[float]]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    base = AuxGPT()
    return {"ours": train_aux(shard_aux(copy.deepcopy(base))),
            "torch": train_aux(shard_aux(copy.deepcopy(base), torch_fully_shard))}


def test_a_backward_prefetch_no_backward_used_is_dropped_with_reshard_after_backward_false() -> None:
    """Block 0's backward prefetches the auxiliary head, which no backward uses on odd steps: the end of
    backward drops that all-gather whatever ``reshard_after_backward`` says, as torch's ``finalize_backward``
    does. It was kept pending: the next forward used the head gathered before the optimizer step
    (ours 7.39680 vs torch 7.39476 on rank 0's third step)."""
    for r in _unused_backward_prefetch():
        assert r["ours"] == r["torch"], r


@distributed(world_size=2)
def _state_dict_after_unsharded_forward() -> None:
    torch.manual_seed(0)
    model = shard_gpt(TinyGPT())
    x, _ = batches(1)[0]
    model(local_slice(x))  # no backward: the root keeps its params gathered (reshard_after_forward=None)
    assert not isinstance(model.tok.weight, DTensor)
    sd = model.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values()), [
        k for k, v in sd.items() if not isinstance(v, DTensor)]
    model.load_state_dict(sd)
    assert isinstance(model.tok.weight, DTensor)


def test_state_dict_reshards_first() -> None:
    _state_dict_after_unsharded_forward()


@distributed(world_size=2)
def _optimizer_after_eval_forward() -> float:
    """An eval forward before the optimizer exists must leave model.parameters() sharded."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = shard_gpt(copy.deepcopy(ref))
    with torch.no_grad():
        model(local_slice(batches(1)[0][0]))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = 0.0
    for x, y in batches(3, batch=12):
        loss, ref_loss = step_pair(model, ref, opt, ref_opt, x, y)
        worst = max(worst, abs(loss - ref_loss))
        with torch.no_grad():
            model(local_slice(x))  # eval between steps
    assert worst < 2e-5, worst
    model.set_reshard_after_forward(False)  # an explicit False keeps gathered params across eval forwards
    with torch.no_grad():
        model(local_slice(x))
    assert not isinstance(model.tok.weight, DTensor) and not isinstance(model.blocks[0].up.weight, DTensor)
    model.reshard()
    for blk in model.blocks:
        blk.reshard()
    return worst


def test_eval_forward_reshards_the_root_by_default() -> None:
    _optimizer_after_eval_forward()
