"""The optimizer step on local shards (fully_shard/optim/step.py) against torch's DTensor path, bitwise.

Every comparison trains two copies of one model in lockstep, one stepping on the default local path and
one with ``set_step_path(StepPath.DTENSOR)``, and checks that the local path was really taken (a
per-optimizer pre-hook sees the stand-in optimizer instead of the real one).
"""

from __future__ import annotations

import copy
import gc
import io
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import checkpoint, clip_grad_norm_
from fully_shard.optim.step import StepPath, get_step_path, set_step_path
from tests.core.common import local_slice, shard_gpt
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn

MakeOpt = Callable[[Iterable[Any]], torch.optim.Optimizer]


def make_optimizer(name: str, flag: str) -> MakeOpt:
    kwargs: dict[str, Any] = {"fused": True} if flag == "fused" else {"foreach": flag == "foreach"}
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, **kwargs)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    return lambda ps: cls(ps, lr=1e-2, weight_decay=0.01, **kwargs)


def twins(make_opt: MakeOpt, shard: Callable[[nn.Module], nn.Module] = shard_gpt,
          make: Callable[[], nn.Module] = lambda: TinyGPT(n_blocks=2)) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """The same sharded model twice (fast path, DTensor path), each with its own optimizer. TinyGPT has
    uneven shards and a 0-dim (Replicate) parameter per block."""
    torch.manual_seed(0)
    base = make()
    out = []
    for _ in range(2):
        model = shard(copy.deepcopy(base))
        out.append((model, make_opt(model.parameters())))
    return out


def record_paths(opt: torch.optim.Optimizer) -> list[str]:
    """Which path each step took: per-optimizer pre-hooks run after fully_shard's global one."""
    seen: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("dtensor" if args[0] is o else "local"))
    return seen


def on_path(path: StepPath, fn: Callable[[], Any]) -> Any:
    previous = set_step_path(path)
    try:
        return fn()
    finally:
        set_step_path(previous)


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss_fn(model(local_slice(x)), local_slice(y)).backward()


def lockstep(pair: list[tuple[nn.Module, torch.optim.Optimizer]], steps: int,
             step: Callable[[nn.Module, torch.optim.Optimizer], None] | None = None) -> tuple[list[str], list[str]]:
    (fast, fast_opt), (slow, slow_opt) = pair
    fast_paths, slow_paths = record_paths(fast_opt), record_paths(slow_opt)
    run = step or (lambda model, opt: (opt.step(), opt.zero_grad()))
    for x, y in batches(steps):
        for model, opt, path in ((fast, fast_opt, StepPath.LOCAL), (slow, slow_opt, StepPath.DTENSOR)):
            backward(model, x, y)
            on_path(path, lambda m=model, o=opt: run(m, o))  # type: ignore[misc]
    assert_bitwise(fast, fast_opt, slow, slow_opt)
    return fast_paths, slow_paths


def assert_same_tensor(a: Any, b: Any, what: str) -> None:
    assert type(a) is type(b), f"{what}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, DTensor):
        assert a.placements == b.placements and a.shape == b.shape, (what, a.placements, b.placements)
        a, b = a.to_local(), b.to_local()
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what} differs: max {(a - b).abs().max()}"
    else:
        assert a == b, (what, a, b)


def assert_bitwise(fast: nn.Module, fast_opt: torch.optim.Optimizer, slow: nn.Module,
                   slow_opt: torch.optim.Optimizer) -> None:
    slow_params = dict(slow.named_parameters())
    names = {id(p): n for n, p in fast.named_parameters()}
    for name, p in fast.named_parameters():
        assert_same_tensor(p.detach(), slow_params[name].detach(), name)
    assert len(fast_opt.state) == len(slow_opt.state)
    for fast_group, slow_group in zip(fast_opt.param_groups, slow_opt.param_groups):
        for p, q in zip(fast_group["params"], slow_group["params"]):
            a, b = fast_opt.state.get(p, {}), slow_opt.state.get(q, {})
            assert a.keys() == b.keys(), (names.get(id(p)), a.keys(), b.keys())
            for k in a:
                assert_same_tensor(a[k], b[k], f"state[{names.get(id(p))}][{k}]")


# --- bitwise against the DTensor path -------------------------------------------------------------
def record_ready(opt: torch.optim.Optimizer) -> list[int]:
    """Per step, how many param groups torch's step() got as ready lists (fully_shard/step_lists.py)."""
    seen: list[int] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(len(getattr(args[0], "_fully_shard_ready", ()))))
    return seen


@distributed(world_size=2)
def _bitwise(name: str, flag: str) -> None:
    pair = twins(make_optimizer(name, flag))
    ready = record_ready(pair[0][1])
    fast_paths, slow_paths = lockstep(pair, steps=4)
    # the first step creates the states on the DTensor path (their types are exactly torch's); the
    # second caches the views (handed over on their .grad); from the third on, ready lists
    assert fast_paths == ["dtensor", "local", "local", "local"], fast_paths
    assert ready == [0, 0, 1, 1], ready
    assert slow_paths == ["dtensor"] * 4, slow_paths


@pytest.mark.parametrize("flag", ["foreach", "for-loop", "fused"])
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_bitwise_same_as_dtensor_path(name: str, flag: str) -> None:
    if (name, flag) == ("sgd", "fused"):
        pytest.skip("torch's DTensor has no sharding strategy for aten._fused_sgd_ (fused SGD fails on "
                    "torch's fully_shard too), and the first step, which creates the momentum buffers, runs on DTensor")
    _bitwise(name, flag)


@distributed(world_size=2)
def _training_features() -> None:
    """zero_grad(set_to_none=False), an LR scheduler, clipping, amsgrad, a tensor lr, a closure."""
    pair = twins(lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2), amsgrad=True, foreach=False))
    scheds = {id(opt): torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for _, opt in pair}

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        clip_grad_norm_(model.parameters(), max_norm=0.05)
        opt.step()
        scheds[id(opt)].step()
        opt.zero_grad(set_to_none=False)

    ready = record_ready(pair[0][1])
    fast_paths, _ = lockstep(pair, steps=4, step=step)
    assert fast_paths == ["dtensor", "local", "local", "local"], fast_paths
    assert ready == [0, 0, 1, 1], ready  # amsgrad's max_exp_avg_sqs and a tensor lr on the ready path
    assert pair[0][1].param_groups[0]["lr"] == 1e-2 * 0.5 ** 4
    (fast, fast_opt), (slow, slow_opt) = pair
    x, y = batches(1)[0]
    for model, opt in pair:  # a closure computes the gradients inside step(): the DTensor path
        opt.step(lambda m=model: backward(m, x, y))  # type: ignore[misc]
    assert_bitwise(fast, fast_opt, slow, slow_opt)


def test_zero_grad_scheduler_clipping_closure() -> None:
    _training_features()


# --- param groups of several kinds -----------------------------------------------------------------
class WithExtras(nn.Module):
    """TinyGPT plus a plain Linear and a Linear sharded by torch's fully_shard."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(n_blocks=2)
        self.plain = nn.Linear(997, 8)
        self.theirs = nn.Linear(8, 997)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        return logits + 0.1 * self.theirs(self.plain(logits))


def shard_with_extras(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch_fully_shard(model.theirs)
    shard_gpt(model.gpt)  # type: ignore[arg-type]
    return model


def mixed_groups(params: Iterable[Any]) -> torch.optim.Optimizer:
    ps = list(params)  # gpt..., plain.weight, plain.bias, theirs.weight, theirs.bias
    gpt, plain, theirs = ps[:-4], ps[-4:-2], ps[-2:]
    return torch.optim.AdamW([{"params": gpt[:4]}, {"params": gpt[4:] + plain, "lr": 5e-3}, {"params": theirs},
                              {"params": []}], lr=1e-2, foreach=False)


@distributed(world_size=2)
def _mixed_groups() -> list[list[str]]:
    pair = twins(mixed_groups, shard=shard_with_extras, make=WithExtras)
    seen: list[list[str]] = []
    pair[0][1].register_step_pre_hook(lambda o, args, kw: seen.append(
        ["as is" if g is real else "local" for g, real in zip(args[0].param_groups, o.param_groups)]))
    lockstep(pair, steps=3)
    return seen


def test_mixed_param_groups_ours_plain_and_torch_fully_shard() -> None:
    seen = _mixed_groups()[0]
    # step 1 creates the states (DTensor path); then the groups holding ours go local (plain params in
    # them step as they are), torch's fully_shard group and the empty group stay as they are
    assert seen == [["as is"] * 4] + [["local", "local", "as is", "as is"]] * 2, seen


@distributed(world_size=2)
def _some_without_grad() -> list[int]:
    pair = twins(make_optimizer("adam", "foreach"))
    ready = record_ready(pair[0][1])

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        next(model.parameters()).grad = None  # as if unused this step: torch's loop skips it
        opt.step()
        opt.zero_grad()

    fast_paths, _ = lockstep(pair, steps=4, step=step)
    assert fast_paths == ["dtensor", "local", "local", "local"], fast_paths
    return ready


@distributed(world_size=2)
def _grads_proven_at_creation() -> None:
    (model, opt), _ = twins(make_optimizer("adam", "foreach"))
    x, y = batches(1)[0]
    backward(model, x, y)
    with torch.no_grad():
        for name, p in model.named_parameters():  # the reduce-scatter's gradients carry the step's proof
            placements, local = p.grad._fully_shard_local_grad  # type: ignore[union-attr]
            assert placements is p.placements, name
            assert local is p.grad.to_local(), name  # type: ignore[union-attr]
    ready = record_ready(opt)
    for _ in range(3):  # new gradients every step (zero_grad sets them to None): still the ready path
        opt.step()
        opt.zero_grad()
        backward(model, x, y)
    assert ready == [0, 0, 1], ready


def test_library_gradients_are_proven_when_created() -> None:
    _grads_proven_at_creation()


def test_parameter_without_gradient_goes_through_torchs_loop() -> None:
    assert _some_without_grad() == [[0, 0, 0, 0]] * 2  # per rank; bitwise (lockstep), on the views' .grad


# --- robustness ------------------------------------------------------------------------------------
class Boom(RuntimeError):
    pass


@distributed(world_size=2)
def _exception_inside_step() -> None:
    pair = twins(make_optimizer("adamw", "foreach"))
    lockstep(pair, steps=2)
    (fast, fast_opt), (slow, slow_opt) = pair
    x, y = batches(1)[0]
    backward(fast, x, y)
    armed = [True]

    def explode(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise Boom("inside step")

    handle = fast_opt.register_step_pre_hook(explode)  # after fully_shard's hook built the stand-in
    with pytest.raises(Boom):
        fast_opt.step()
    handle.remove()
    # the real optimizer was never modified: DTensor params and states, keyed as before
    assert all(isinstance(p, DTensor) for g in fast_opt.param_groups for p in g["params"])
    assert all(isinstance(v, DTensor) for s in fast_opt.state.values() for k, v in s.items() if k != "step")
    local_grad = weakref.ref(next(fast.parameters()).grad.to_local())  # type: ignore[union-attr]
    fast_opt.zero_grad()
    lockstep(pair, steps=2)  # training goes on, still bitwise the same
    gc.collect()
    assert local_grad() is None, "a cached shard view kept a gradient alive after the step"


def test_exception_inside_step_leaves_nothing_swapped() -> None:
    _exception_inside_step()


@distributed(world_size=2)
def _swapped_contents() -> None:
    """swap_tensors (what to_empty and .to() do) on a parameter after the views were cached."""
    pair = twins(make_optimizer("adam", "foreach"))
    lockstep(pair, steps=2)
    for model, _ in pair:
        for p in model.parameters():
            torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone() * 1.5))
    fast_paths, _ = lockstep(pair, steps=2)
    assert fast_paths[-1] == "local", fast_paths


def test_parameter_contents_swapped_after_views_cached() -> None:
    _swapped_contents()


@distributed(world_size=2)
def _replaced_between_steps() -> list[str]:
    """What the per-step checks (done in bulk, by identity) must notice: a state value replaced (as an
    offloader moving states does), one gradient replaced by a new DTensor while the others persist
    (``zero_grad(set_to_none=False)``), a parameter without a gradient for a step."""
    pair = twins(make_optimizer("adamw", "foreach"))
    calls: dict[int, int] = {}

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        n = calls[id(opt)] = calls.get(id(opt), 0) + 1
        params = list(model.parameters())
        if n == 3:  # (step 2 re-checks everything: step 1, on DTensor, created the states)
            opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].clone()
        if n == 4:
            params[1].grad = params[1].grad.clone()  # type: ignore[union-attr]
        if n == 5:
            params[2].grad = None
        opt.step()
        opt.zero_grad(set_to_none=False)

    fast_paths, _ = lockstep(pair, steps=6, step=step)
    # a checked gradient carries its proof; a deep copy's or a pickle's local is another tensor: none
    grad = next(pair[0][0].parameters()).grad
    assert isinstance(getattr(grad, "_fully_shard_local_grad", None), tuple)
    buffer = io.BytesIO()
    torch.save(grad, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(grad), torch.load(buffer, weights_only=False)):
        assert getattr(copied, "_fully_shard_local_grad", None) is None
        assert torch.equal(copied.to_local(), grad.to_local())  # type: ignore[union-attr]
    return fast_paths


def test_state_value_and_gradient_replaced_between_steps() -> None:
    assert _replaced_between_steps()[0] == ["dtensor"] + ["local"] * 5


@distributed(world_size=2)
def _meta_init() -> list[str]:
    def shard_meta(model: nn.Module) -> nn.Module:
        with torch.device("meta"):
            meta = TinyGPT(n_blocks=2)
        shard_gpt(meta)
        meta.to_empty(device="cpu")  # swaps every sharded parameter's contents
        with torch.no_grad():
            for p, src in zip(meta.parameters(), model.parameters()):
                p.to_local().copy_(torch.chunk(src, dist.get_world_size())[dist.get_rank()] if src.dim() else src)
        return meta

    fast_paths, _ = lockstep(twins(make_optimizer("adamw", "foreach"), shard=shard_meta), steps=3)
    return fast_paths


def test_meta_init_to_empty_goes_local() -> None:
    assert _meta_init()[0] == ["dtensor", "local", "local"]


@distributed(world_size=2)
def _built_before_fully_shard() -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2)
    opt = torch.optim.AdamW(model.parameters())
    shard_gpt(model)
    backward(model, *batches(1)[0])
    for path in StepPath:
        with pytest.raises(RuntimeError, match=r"replaced by fully_shard \(.*'tok.weight'.*build the optimizer after "
                                               r"fully_shard"):
            on_path(path, opt.step)
    torch.optim.AdamW(model.parameters()).step()  # built after: fine


def test_optimizer_built_before_fully_shard_raises() -> None:
    _built_before_fully_shard()


@distributed(world_size=2)
def _unrelated_optimizers() -> dict[str, Any]:
    """An optimizer over a teacher that registers one of the student's original Parameters (still used,
    so it has a gradient) and one over an unrelated module: both are torch's own steps, never refused."""
    torch.manual_seed(0)
    student = TinyGPT(n_blocks=2)
    teacher = nn.Module()
    teacher.w = student.blocks[0].up.weight  # the same Parameter object, registered in the teacher too
    other = nn.Linear(4, 4)
    teacher_opt = torch.optim.SGD(teacher.parameters(), lr=0.1)
    shard_gpt(student)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    paths = {"teacher": record_paths(teacher_opt), "other": record_paths(other_opt)}
    before = teacher.w.detach().clone()
    for _ in range(2):
        teacher.w.sum().backward()
        teacher_opt.step()
        other(torch.ones(1, 4)).sum().backward()
        other_opt.step()
    return {"paths": paths, "moved": not torch.equal(before, teacher.w.detach())}


def test_optimizers_over_no_sharded_parameter_are_left_alone() -> None:
    for r in _unrelated_optimizers():
        assert r["moved"], r
        assert r["paths"] == {"teacher": ["dtensor"] * 2, "other": ["dtensor"] * 2}, r["paths"]


def test_set_step_path_validates() -> None:
    with pytest.raises(TypeError, match=r"StepPath.DTENSOR"):
        set_step_path("dtensor")  # type: ignore[arg-type]
    assert get_step_path() is StepPath.LOCAL


# --- state dicts and checkpoints with the fast path on ---------------------------------------------
@distributed(world_size=2)
def _checkpoints(path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    pair = twins(make_optimizer("adamw", "foreach"))
    lockstep(pair, steps=3)
    (fast, fast_opt), _ = pair
    sd = fast_opt.state_dict()
    assert sorted(sd["state"]) == list(range(len(list(fast.parameters()))))
    assert all(isinstance(s["exp_avg"], DTensor) and not isinstance(s["step"], DTensor) for s in sd["state"].values())
    dcp_sd = get_optimizer_state_dict(fast, fast_opt)
    assert all(isinstance(s["exp_avg_sq"], DTensor) for s in dcp_sd["state"].values())
    checkpoint.save(path, fast, fast_opt)
    # each restore into a fresh model from another seed, continued next to one restored by
    # load_state_dict on the DTensor path
    for restore in ("load_state_dict", "dcp", "ours"):
        restored = []
        for how in (restore, "load_state_dict"):
            torch.manual_seed(1)
            model = shard_gpt(TinyGPT(n_blocks=2))
            opt = make_optimizer("adamw", "foreach")(model.parameters())
            if how == "ours":
                checkpoint.load(path, model, opt)
            else:
                model.load_state_dict(fast.state_dict())
                if how == "dcp":
                    set_optimizer_state_dict(model, opt, copy.deepcopy(dcp_sd))
                else:
                    opt.load_state_dict(copy.deepcopy(sd))
            restored.append((model, opt))
        paths, _ = lockstep(restored, steps=2)
        assert paths == ["local", "local"], (restore, paths)
    dist.barrier()


def test_state_dict_dcp_and_checkpoint_round_trip(tmp_path: Any) -> None:
    _checkpoints(str(tmp_path / "ckpt"))


# --- the fast path's guards: an unknown _init_group, GradScaler, torch.compile(optimizer.step) ------
@distributed(world_size=2)
def _unknown_init_group_source() -> None:
    from fully_shard.optim import lists

    saved = dict(lists.KNOWN_SOURCES)
    lists._classes.clear()
    try:
        for cls in list(lists.KNOWN_SOURCES):  # as if torch had changed _init_group's body
            lists.KNOWN_SOURCES[cls] = frozenset({"0" * 16})
        pair = twins(make_optimizer("adamw", "foreach"))
        ready = record_ready(pair[0][1])
        fast_paths, _ = lockstep(pair, steps=3)
    finally:
        lists.KNOWN_SOURCES.update(saved)
        lists._classes.clear()
    assert ready == [0, 0, 0], ready  # never the ready lists: torch's own loop over the views' .grad
    assert fast_paths == ["dtensor", "local", "local"], fast_paths


def test_unknown_init_group_source_falls_back_to_torchs_loop() -> None:
    _unknown_init_group_source()


def test_known_init_group_sources_are_this_torchs() -> None:
    from fully_shard.optim import lists

    for cls in lists.KNOWN_SOURCES:  # a new torch: add its hash after checking the body (lists.py)
        assert lists.source_hash(cls) in lists.KNOWN_SOURCES[cls], (cls.__name__, lists.source_hash(cls))


@distributed(world_size=2)
def _grad_scaler() -> None:
    pair = twins(make_optimizer("adamw", "foreach"))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**4), torch.amp.GradScaler("cpu", init_scale=2.0**4)]
    (fast, fast_opt), (slow, slow_opt) = pair
    fast_paths = record_paths(fast_opt)
    for x, y in batches(3):
        for (model, opt), scaler, path in zip(pair, scalers, (StepPath.LOCAL, StepPath.DTENSOR)):
            scaler.scale(loss_fn(model(local_slice(x)), local_slice(y))).backward()
            on_path(path, lambda s=scaler, o=opt: (s.step(o), s.update(), o.zero_grad()))  # type: ignore[misc]
    assert_bitwise(fast, fast_opt, slow, slow_opt)
    assert fast_paths == ["dtensor", "local", "local"], fast_paths


def test_grad_scaler_steps_the_local_shards_bitwise() -> None:
    _grad_scaler()


@distributed(world_size=2)
def _compiled_step() -> None:
    """torch.compile(optimizer.step) (Dynamo tracing torch's step; the eager backend keeps it quick):
    the hook leaves the step to torch over the DTensors, equal to the same compiled step on that path."""
    pair = twins(make_optimizer("adamw", "foreach"))
    (fast, fast_opt), (slow, slow_opt) = pair
    fast_step = torch.compile(fast_opt.step, backend="eager")
    slow_step = torch.compile(slow_opt.step, backend="eager")
    for x, y in batches(3):
        for model, opt, step, path in ((fast, fast_opt, fast_step, StepPath.LOCAL),
                                       (slow, slow_opt, slow_step, StepPath.DTENSOR)):
            backward(model, x, y)
            on_path(path, step)
            opt.zero_grad()
    assert_bitwise(fast, fast_opt, slow, slow_opt)


def test_compiled_optimizer_step_takes_the_dtensor_path() -> None:
    _compiled_step()
