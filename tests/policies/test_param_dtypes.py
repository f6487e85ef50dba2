"""Per-parameter dtypes (torch 2.15's ``MixedPrecisionPolicy(param_dtype_override_fn=...)``) and what
``reduce_dtype=None`` means on the torch this runs on, side by side with torch's fully_shard where it has
the same behaviour, else against an unsharded emulation: LayerNorm weights kept in fp32 in bf16 units (one
group then gathers two dtypes), torch's errors for a bad override, the function called once per parameter
at ``fully_shard()``, a rank-dependent answer refused on every rank, torch's fully_shard given this
library's policy object."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fully_shard import FSDPModule, MixedPrecisionPolicy, fully_shard
from fully_shard.comm import trace
from fully_shard.comm.trace import EventKind
from fully_shard.core.policy import REDUCE_IN_ORIG_DTYPE
from tests.core.common import local_slice
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.policies.common import unit_padded_numel
from tests.torch_ref import lacks_field

TORCH_NO_OVERRIDE = lacks_field("torch.distributed.fsdp", "MixedPrecisionPolicy", "param_dtype_override_fn")
TOL = 1e-6
BF16 = torch.bfloat16


def _torch_fs() -> Any:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    return torch_fully_shard


def _torch_policy(policy: MixedPrecisionPolicy) -> Any:
    """The same policy as torch's own object (fields by name; the override only where torch has it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    kw: dict[str, Any] = {"param_dtype": policy.param_dtype, "reduce_dtype": policy.reduce_dtype,
                          "output_dtype": policy.output_dtype, "cast_forward_inputs": policy.cast_forward_inputs}
    if policy.param_dtype_override_fn is not None:
        kw["param_dtype_override_fn"] = policy.param_dtype_override_fn
    return TorchMP(**kw)


def _norms_in_fp32(model: nn.Module) -> Callable[[nn.Parameter], torch.dtype | None]:
    """torchtitan-style: LayerNorm weights and biases keep their fp32, everything else follows param_dtype."""
    keep = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    return lambda p: torch.float32 if id(p) in keep else None


def _build(shard: Any, policy_of: Callable[[nn.Module], Any]) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2, zero_dim=False)  # torch's fully_shard refuses 0-dim parameters
    policy = policy_of(model)
    for blk in model.blocks:
        shard(blk, mp_policy=policy)
    shard(model, mp_policy=policy)
    return model


def _train(model: nn.Module, steps: int = 3) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "counts": [], "grads": [], "seen": {}}
    blk = model.blocks[0]
    hook = blk.norm1.register_forward_hook(lambda m, a, o: out["seen"].update(norm=m.weight.dtype))
    hook2 = blk.up.register_forward_hook(lambda m, a, o: out["seen"].update(up=m.weight.dtype))
    for step, (x, y) in enumerate(batches(steps, batch=4)):
        with CountCollectives() as counted, trace.record() as events:
            loss = loss_fn(model(local_slice(x)).float(), local_slice(y))
            loss.backward()
        if step == 0:
            out["events"] = [(e.kind.name, e.fqn, e.nbytes) for e in events
                             if e.kind in (EventKind.ALL_GATHER, EventKind.REDUCE_SCATTER)]
        out["losses"].append(loss.item())
        out["counts"].append(dict(counted.counts))
        out["grads"].append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["weights"] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    hook.remove()
    hook2.remove()
    return out


def _emulate(policy_of: Callable[[nn.Module], MixedPrecisionPolicy], steps: int = 3) -> dict[str, Any]:
    """The unsharded reference: fp32 masters, a compute copy per step with each parameter at its dtype,
    inputs of every unit cast to param_dtype, each rank's slice run on its own, the gradients cast to the
    reduce dtype (the group's promoted dtype) and averaged, SGD on the masters."""
    torch.manual_seed(0)
    master = TinyGPT(n_blocks=2, zero_dim=False)
    policy = policy_of(master)
    dtype_of = {n: policy.param_dtype_of(p) or p.dtype for n, p in master.named_parameters()}
    world = dist.get_world_size()
    out: dict[str, Any] = {"grads": []}
    for x, y in batches(steps, batch=4):
        compute = copy.deepcopy(master)
        for n, p in compute.named_parameters():
            p.data = p.data.to(dtype_of[n])
        for unit in [compute, *compute.blocks]:
            unit.register_forward_pre_hook(lambda _m, a: tuple(t.to(BF16) if t.is_floating_point() else t for t in a))
        total: dict[str, torch.Tensor] = {}
        per = x.shape[0] // world
        for r in range(world):
            compute.zero_grad(set_to_none=True)
            loss_fn(compute(x[r * per:(r + 1) * per]).float(), y[r * per:(r + 1) * per]).backward()
            for n, p in compute.named_parameters():
                g = p.grad.float()
                total[n] = g if n not in total else total[n] + g
        grads = {n: g / world for n, g in total.items()}
        out["grads"].append(grads)
        with torch.no_grad():
            for n, p in master.named_parameters():
                p -= 0.1 * grads[n]
    out["weights"] = {n: p.detach().clone() for n, p in master.named_parameters()}
    return out


def _policy(model: nn.Module) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=BF16, param_dtype_override_fn=_norms_in_fp32(model))


@distributed(world_size=2)
def _override_side_by_side() -> dict[str, Any]:
    out = {"ours": _train(_build(fully_shard, _policy)), "ref": _emulate(_policy)}
    if not TORCH_NO_OVERRIDE:
        out["torch"] = _train(_build(_torch_fs(), lambda m: _torch_policy(_policy(m))))
    return out


def test_override_keeps_norms_in_fp32_like_torch() -> None:
    """Each unit gathers its bf16 weights and fp32 norms in one all-gather (of bytes, as torch); forward sees
    the norms in fp32 and the rest in bf16; losses, gradients and weights after 3 steps equal torch 2.15's
    (same collectives), and the unsharded emulation's."""
    for r in _override_side_by_side():
        ours = r["ours"]
        assert ours["seen"] == {"norm": torch.float32, "up": BF16}, ours["seen"]
        for name, kind in (("blocks.0", "ALL_GATHER"), ("", "ALL_GATHER")):
            assert sum(1 for k, f, _ in ours["events"] if (k, f) == (kind, name)) >= 1, ours["events"]
        for step, grads in enumerate(ours["grads"]):
            for n, g in grads.items():
                torch.testing.assert_close(g, r["ref"]["grads"][step][n], atol=2e-5, rtol=0, msg=n)
        if "torch" not in r:
            continue
        theirs = r["torch"]
        assert ours["seen"] == theirs["seen"]
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=TOL)
        assert ours["counts"] == theirs["counts"], (ours["counts"], theirs["counts"])
        for mine, want in zip(ours["grads"], theirs["grads"]):
            for n, g in mine.items():
                torch.testing.assert_close(g, want[n], atol=TOL, rtol=0, msg=n)
        for n, w in ours["weights"].items():
            torch.testing.assert_close(w, theirs["weights"][n], atol=TOL, rtol=0, msg=n)
    if TORCH_NO_OVERRIDE:
        pytest.skip(TORCH_NO_OVERRIDE)


@distributed(world_size=2)
def _gathered_bytes() -> dict[str, Any]:
    """One unit's all-gather with the override: its parameters' padded shards at their own dtypes."""
    model = _build(fully_shard, _policy)
    policy = _policy(TinyGPT(n_blocks=2, zero_dim=False))
    blk = model.blocks[0]
    with trace.record() as events:
        blk.unshard()
    blk.reshard()
    gathered = [e.nbytes for e in events if e.kind is EventKind.ALL_GATHER]
    world = dist.get_world_size()
    norms = [p for m in blk.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    rest = [p for p in blk.parameters() if all(p is not q for q in norms)]
    want = unit_padded_numel(norms, world) * 4 + unit_padded_numel(rest, world) * 2
    return {"gathered": gathered, "want": want, "policy_fn": policy.param_dtype_override_fn is not None}


def test_one_all_gather_moves_each_parameter_at_its_dtype() -> None:
    for r in _gathered_bytes():
        assert r["gathered"] == [r["want"]], r


# --- reduce_dtype=None: the running torch's meaning ---------------------------------------------------------
@distributed(world_size=2)
def _unset_reduce_dtype() -> dict[str, Any]:
    policy = MixedPrecisionPolicy(param_dtype=BF16)  # reduce_dtype=None
    return {"ours": _train(_build(fully_shard, lambda m: policy), steps=2),
            "torch": _train(_build(_torch_fs(), lambda m: _torch_policy(policy)), steps=2)}


def test_unset_reduce_dtype_follows_the_running_torch() -> None:
    """torch 2.15 reduces in the parameters' original dtype (fp32) where ``reduce_dtype`` is unset, older
    torch in ``param_dtype`` (bf16): ours does what the torch it runs on does (docs/torch.md, "Differences"),
    with its gradients and losses."""
    width = 4 if REDUCE_IN_ORIG_DTYPE else 2
    for r in _unset_reduce_dtype():
        ours, theirs = r["ours"], r["torch"]
        reduced = [(f, n) for k, f, n in ours["events"] if k == "REDUCE_SCATTER"]
        assert reduced, ours["events"]
        for fqn, nbytes in reduced:
            unit_bytes = next(n for k, f, n in ours["events"] if k == "ALL_GATHER" and f == fqn)  # bf16, padded
            assert nbytes == unit_bytes // 2 * width, (fqn, nbytes, unit_bytes, width)
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=TOL)
        for mine, want in zip(ours["grads"], theirs["grads"]):
            for n, g in mine.items():
                torch.testing.assert_close(g, want[n], atol=TOL, rtol=0, msg=n)


# --- the function: once per parameter, checked; rank-dependent answers ------------------------------------
def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@distributed(world_size=2)
def _override_errors() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lib, shard, mp in (("ours", fully_shard, MixedPrecisionPolicy),
                           ("torch", None if TORCH_NO_OVERRIDE else _torch_fs(), None)):
        if shard is None:
            continue
        if mp is None:
            from torch.distributed.fsdp import MixedPrecisionPolicy as mp
        found = {}
        for case, fn in (("type", lambda p: "bf16"), ("dtype", lambda p: torch.float16)):
            model = nn.Sequential(nn.Linear(4, 4))
            policy = mp(param_dtype=BF16, param_dtype_override_fn=fn)
            found[case] = _error(lambda s=shard, m=model, p=policy: s(m, mp_policy=p))
            found[case + "_unchanged"] = not isinstance(model, FSDPModule) and type(model[0].weight) is nn.Parameter
        out[lib] = found
    calls: list[tuple[str, torch.dtype, bool]] = []

    def record(p: nn.Parameter) -> torch.dtype | None:
        calls.append((tuple(p.shape), p.dtype, type(p).__name__))
        return torch.float32 if p.dim() == 1 else None

    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.LayerNorm(6))  # (a bf16 linear takes no fp32 bias)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, param_dtype_override_fn=record))
    after_call = len(calls)
    model(torch.randn(2, 4)).float().sum().backward()
    out["calls"] = (calls, after_call, len(calls))
    out["dtypes"] = {n: p.param_dtype for n, p in ((p.fqn, p) for p in model._fsdp.group.params)}
    return out


def test_override_errors_and_calls() -> None:
    for r in _override_errors():
        ours = r["ours"]
        assert ours["type"] == "ValueError: param_dtype_override_fn must return a torch.dtype or None but got " \
                               "<class 'str'>", ours
        assert ours["dtype"].startswith("ValueError: param_dtype_override_fn must return None, param_dtype, or the "
                                        "parameter's original dtype but got torch.float16"), ours
        assert ours["type_unchanged"] and ours["dtype_unchanged"]  # the module as it was
        if "torch" in r:
            assert {k: v for k, v in ours.items() if not k.endswith("unchanged")} == \
                {k: v for k, v in r["torch"].items() if not k.endswith("unchanged")}
        calls, at_fully_shard, after_step = r["calls"]
        assert at_fully_shard == after_step == 3, calls  # once per parameter, at fully_shard() only
        assert all(kind == "Parameter" and dtype == torch.float32 for _, dtype, kind in calls), calls  # the originals
        assert r["dtypes"] == {"0.weight": BF16, "1.weight": torch.float32, "1.bias": torch.float32}, r["dtypes"]
    if TORCH_NO_OVERRIDE:
        pytest.skip(TORCH_NO_OVERRIDE)


@distributed(world_size=2)
def _rank_dependent() -> str:
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    policy = MixedPrecisionPolicy(param_dtype=BF16,
                                  param_dtype_override_fn=lambda p: torch.float32 if p.dim() == 1 and rank else None)
    return _error(lambda: fully_shard(model, mp_policy=policy))


def test_rank_dependent_override_is_refused_on_every_rank() -> None:
    """torch 2.15 warns that a rank-dependent answer may build mismatched collectives and hang; here every
    rank raises at fully_shard(), the diff naming the parameter and both dtypes."""
    for msg in _rank_dependent():
        assert msg.startswith("RuntimeError: fully_shard was called differently across ranks"), msg
        assert "param_dtype=torch.bfloat16" in msg and "param_dtype=torch.float32" in msg and "1.weight" in msg, msg


@distributed(world_size=2)
def _torch_takes_our_policy() -> dict[str, Any]:
    # (a torch without the override field ignores it on our object: compared with the plain policy there)
    ours = _policy if not TORCH_NO_OVERRIDE else lambda m: MixedPrecisionPolicy(param_dtype=BF16)
    return {"our_object": _train(_build(_torch_fs(), ours), steps=2),
            "torch_object": _train(_build(_torch_fs(), lambda m: _torch_policy(ours(m))), steps=2)}


def test_torch_fully_shard_takes_this_librarys_policy() -> None:
    """torch's fully_shard given this library's MixedPrecisionPolicy (a framework importing ours, or code
    mixing both): on torch 2.15 it calls ``_resolve_for_param`` and ``dataclasses.replace(policy,
    param_dtype_override_fn=None)`` on it; the same run as with torch's own policy object."""
    for r in _torch_takes_our_policy():
        a, b = r["our_object"], r["torch_object"]
        assert a["seen"] == b["seen"] and a["counts"] == b["counts"]
        assert a["losses"] == b["losses"]
        for mine, want in zip(a["grads"], b["grads"]):
            for n, g in mine.items():
                assert torch.equal(g, want[n]), n


@distributed(world_size=4)
def _partial_reshard() -> dict[str, Any]:
    """reshard_after_forward=2 on 4 ranks: the kept block and its 2-rank re-gather in bytes as well."""
    def build(shard: Any, policy_of: Callable[[nn.Module], Any]) -> TinyGPT:
        torch.manual_seed(0)
        model = TinyGPT(n_blocks=2, zero_dim=False)
        policy = policy_of(model)
        for blk in model.blocks:
            shard(blk, mp_policy=policy, reshard_after_forward=2)
        shard(model, mp_policy=policy)
        return model

    out = {"ours": _train(build(fully_shard, _policy)), "full": _train(_build(fully_shard, _policy))}
    if not TORCH_NO_OVERRIDE:
        out["torch"] = _train(build(_torch_fs(), lambda m: _torch_policy(_policy(m))))
    return out


def test_override_with_partial_reshard() -> None:
    for r in _partial_reshard():
        ours = r["ours"]
        assert ours["seen"] == {"norm": torch.float32, "up": BF16}
        partial = [n for k, f, n in ours["events"] if k == "ALL_GATHER" and f == "blocks.0"]
        assert len(partial) == 2, ours["events"]  # forward, and backward's re-gather within 2 ranks
        for ref in ("full", "torch"):
            if ref not in r:
                continue
            if ref == "torch":
                assert ours["counts"] == r[ref]["counts"], (ours["counts"], r[ref]["counts"])
            assert ours["losses"] == pytest.approx(r[ref]["losses"], abs=TOL), ref
            for mine, want in zip(ours["grads"], r[ref]["grads"]):
                for n, g in mine.items():
                    torch.testing.assert_close(g, want[n], atol=TOL, rtol=0, msg=n)
    if TORCH_NO_OVERRIDE:
        pytest.skip(TORCH_NO_OVERRIDE)


@distributed(world_size=2)
def _quantized() -> str:
    from fully_shard import QuantizedAllGather

    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4))
    policy = MixedPrecisionPolicy(param_dtype=BF16, param_dtype_override_fn=_norms_in_fp32(model))
    return _error(lambda: fully_shard(model, mp_policy=policy, all_gather_policy=QuantizedAllGather()))


def test_override_with_quantized_all_gather_is_refused() -> None:
    for msg in _quantized():
        assert msg.startswith("NotImplementedError: fully_shard(<root>) with QuantizedAllGather and "
                              "param_dtype_override_fn"), msg
