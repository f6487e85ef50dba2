"""The runtime's per-parameter host work per step (design/data-path.md, "Host work per step"): counted as
the tensor ops one training step dispatches, on a unit whose shards need padding on rank 1.

No padding is allocated per step (the unshard copy-in reuses zeros tensors shared by padding size, the
reduce copy-in pads inside ``torch._chunk_cat``); no new view of a shard per unshard (the copy-in's
``torch._chunk_cat`` flattens the shards itself, the copy-out writes each parameter's rows tensor);
gradient DTensors are built without ``DTensor.from_local``'s autograd Function (one view per gradient:
its rows of the reduced buffer)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from fully_shard import fully_shard
from fully_shard.core import grad_mode
from tests.distributed.counting import CountOps
from tests.distributed.harness import distributed

# ops that allocate a padding buffer or build a padded copy
_PADDING = {"new_zeros", "zeros", "constant_pad_nd", "pad", "zeros_like", "fill_"}
# ops that only make a new view of an existing tensor
_VIEWS = {"view", "_reshape_alias", "reshape", "view_as", "narrow", "slice", "alias", "as_strided", "expand",
          "_unsafe_view", "t", "transpose", "detach"}




def _model() -> nn.Module:
    torch.manual_seed(0)
    # 3 rows over 2 ranks: rank 0 holds 2 rows, rank 1 one row + one row of padding (weight and bias)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


@distributed(world_size=2)
def _count_step_ops() -> dict[str, Any]:
    model = _model()
    x = torch.randn(2, 4)

    def step() -> None:
        model(x).sum().backward()

    step()  # the first step allocates what later steps reuse
    for p in model.parameters():
        p.grad = None
    with CountOps() as counted:
        step()
    counts = counted.counts
    return {"padding": {k: v for k, v in counts.items() if k in _PADDING},
            "views": sum(v for k, v in counts.items() if k in _VIEWS), "chunk_cat": counts["_chunk_cat"],
            "all": dict(counts)}


def test_one_step_allocates_no_padding_and_makes_few_views() -> None:
    ranks = _count_step_ops()
    for rank, counts in enumerate(ranks):
        # no per-step padding: not for the two units' forward and backward unshards, nor their reduces
        assert counts["padding"] == {}, (rank, counts["all"])
        # one _chunk_cat per unshard (two units, forward and backward: it flattens the shards itself) and
        # one per reduce (the root has no parameters)
        assert counts["chunk_cat"] == 6, (rank, counts["all"])
        # view ops of the step (forward and backward compute included): 41 on this model (one per unshard
        # is the (1, n) view of the own segment _chunk_cat writes; no view per shard), 77 before the
        # caching (each unshard viewed every shard twice and the copy-out rows once per parameter; each
        # gradient took three views, from_local's included); a few more on a rank where gloo's callback
        # ran in the main thread
        assert counts["views"] <= 44, (rank, counts["all"])


@distributed(world_size=2)
def _like_vs_from_local() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fully_shard.parallel import local_dtensor

    mesh = init_device_mesh("cpu", (2,))
    bad = []
    for placements, shape in (((Shard(0),), (5, 3)), ((Replicate(),), ())):
        model = distribute_tensor(torch.randn(shape), mesh, placements)
        local = torch.randn(model.to_local().shape)
        ref = DTensor.from_local(local, mesh, placements, shape=model.shape, stride=model.stride())
        for direct in (None, False):  # the private construction (checked once), and the fallback
            local_dtensor._direct = direct
            got = local_dtensor.like(local, model)
            if (got.placements, got.shape, got.stride(), got.dtype, got.requires_grad) != (
                    ref.placements, ref.shape, ref.stride(), ref.dtype, False) or not torch.equal(
                    local_dtensor.local_of(got), local):
                bad.append(f"{placements} direct={direct}")
        local_dtensor._direct = None
    return bad


def test_gradient_dtensor_is_what_from_local_builds() -> None:
    """``local_dtensor.like`` (the gradients' construction) gives from_local's DTensor, on its direct path
    and on the fallback."""
    for bad in _like_vs_from_local():
        assert bad == []


class _OrderedCollectives(TorchDispatchMode):
    """The c10d ops a block dispatches, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "c10d" in str(func._overloadpacket):
            self.ops.append(str(func._overloadpacket).split(".")[-1])
        return func(*args, **(kwargs or {}))


@distributed(world_size=2)
def _direct_vs_wrapper() -> dict[str, Any]:
    import torch.distributed as dist

    from fully_shard.comm import collectives

    wrapper_calls: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor")
                 if hasattr(dist, name)}

    def counting(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            wrapper_calls[name] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    out: dict[str, Any] = {}
    try:
        for direct in (True, False):
            previous = collectives.direct_calls(direct)
            try:
                model = _model()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                x = torch.randn(2, 4)
                wrapper_calls.clear()
                with _OrderedCollectives() as seen:
                    for _ in range(2):
                        model(x).sum().backward()
                        opt.step()
                        opt.zero_grad()
                out[str(direct)] = {"ops": seen.ops, "wrapper_calls": dict(wrapper_calls),
                                    "params": [p.full_tensor().detach() for p in model.parameters()]}
            finally:
                collectives.direct_calls(previous)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    out["direct_all_gather"] = hasattr(dist.ProcessGroup, "all_gather_single")
    return out


def test_direct_process_group_calls_issue_what_the_wrappers_issue() -> None:
    """The hot path calls the process group's method (``allreduce``; ``all_gather_single`` where torch has
    it) instead of ``torch.distributed``'s function: the same c10d ops in the same order and the same
    bits as through the functions (``direct_calls(False)``, the fallback), and no function call per step."""
    for rank, out in enumerate(_direct_vs_wrapper()):
        direct, wrapped = out["True"], out["False"]
        assert direct["ops"] == wrapped["ops"] and direct["ops"], (rank, direct["ops"], wrapped["ops"])
        for a, b in zip(direct["params"], wrapped["params"]):
            assert torch.equal(a, b), rank
        assert wrapped["wrapper_calls"].get("all_reduce", 0) > 0, (rank, wrapped)
        assert direct["wrapper_calls"].get("all_reduce", 0) == 0, (rank, direct)
        gathers = sum(n for k, n in direct["wrapper_calls"].items() if k.startswith("all_gather"))
        if out["direct_all_gather"]:
            assert gathers == 0, (rank, direct)
        else:  # torch 2.11: no public all-gather method, the function is called
            assert gathers > 0, (rank, direct)


@distributed(world_size=2)
def _no_grad_entries() -> dict[str, int]:
    model = _model()
    x = torch.randn(2, 4)
    entered = Counter[str]()
    contexts = (torch.no_grad, grad_mode.GradOff)
    originals = [c.__enter__ for c in contexts]

    def counting(kind: str, original: Any) -> Any:
        def enter(self: Any) -> None:
            entered[f"{phase} {kind}"] += 1
            original(self)
        return enter

    for c, original in zip(contexts, originals):
        c.__enter__ = counting(c.__name__, original)  # type: ignore[method-assign]
    try:
        for _ in range(2):  # the second step: lazy init done
            entered.clear()
            phase = "forward"
            loss = model(x).sum()
            phase = "backward"
            loss.backward()
    finally:
        for c, original in zip(contexts, originals):
            c.__enter__ = original  # type: ignore[method-assign]
    return dict(entered)


def test_backward_hooks_enter_no_no_grad_context() -> None:
    """The backward's hooks run with grad mode off: their unshards, copy-outs, reduces and gradient
    assignments enter no grad-off context (``core/grad_mode.no_grad``); the forward's unshards turn it
    off with the C switch itself (``GradOff``), not through ``torch.no_grad()``'s Python objects."""
    for rank, entered in enumerate(_no_grad_entries()):
        assert entered.get("backward no_grad", 0) == entered.get("backward GradOff", 0) == 0, (rank, entered)
        assert entered.get("forward no_grad", 0) == 0, (rank, entered)
        assert entered.get("forward GradOff", 0) > 0, (rank, entered)


def test_cpu_stream_context_is_one_shared_object() -> None:
    """On CPU ``CommContext.on`` returns one null context (no generator object per copy-in and reduce)."""
    from fully_shard.comm.streams import CommContext

    ctx = CommContext(torch.device("cpu"))
    assert ctx.on(ctx.stream("all_gather_copy_in")) is ctx.on(None)
    with ctx.on(None), ctx.on(None):  # nested uses of the shared object
        pass
