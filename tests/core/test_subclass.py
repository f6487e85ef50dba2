"""The tensor-subclass all-gather extension (fsdp_pre/post_all_gather) side by side with torch's
fully_shard: an int8 + scale trainable weight and a frozen three-tensor 4-bit weight with LoRA
adapters; the 1- and 5-argument pre-hooks, out= reuse, one all-gather per unit, mixed precision, and
the padded-size rule failing alike on every rank (design/tensor-subclass-extension.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import MixedPrecisionPolicy, fully_shard
from tests.core import subclass_weights as sw
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed

TOL = 1e-6
STEPS = 3


def _batches(dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch, STEPS times (so the loss must fall)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, dim, generator=g), torch.randn(8, dim, generator=g))] * STEPS


def _train(lib: str, make: Callable[[], nn.Module], mp: MixedPrecisionPolicy | None,
           hsdp: tuple[int, int] | None = None, accumulate: bool = False) -> dict[str, Any]:
    """Shard ``make()`` with ``lib``'s fully_shard (per layer + root), train STEPS SGD steps on this
    rank's rows (``accumulate``: after a no-sync micro-batch on the same rows); return the losses, the
    first step's gradients (full), the collective counts of each forward/backward and the hook calls."""
    if lib == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as fs
        kwargs: dict[str, Any] = {} if mp is None else {"mp_policy": TorchMP(param_dtype=mp.param_dtype,
                                                                             reduce_dtype=mp.reduce_dtype)}
    else:
        fs, kwargs = fully_shard, ({} if mp is None else {"mp_policy": mp})
    if hsdp is not None and (lib == "ours" or hsdp[1] > 1):
        # torch 2.13 with a 1-rank shard axis hands the post-hook one output (ValueError in the hook):
        # (2, 1) is compared with torch's 1-D fully_shard, the same data parallelism
        kwargs["mesh"] = init_device_mesh("cpu", hsdp, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = make()
    for layer in model.layers:  # type: ignore[union-attr]
        fs(layer, **kwargs)
    fs(model, **kwargs)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"losses": [], "counts": [], "calls": []}
    sw.CALLS.clear()
    for i, (x, y) in enumerate(_batches(model.head.in_features)):  # type: ignore[union-attr]
        rows = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
        if accumulate:
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            ((model(x[rows]).float() - y[rows]) ** 2).mean().backward()
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
        with CountCollectives() as fwd:
            loss = ((model(x[rows]).float() - y[rows]) ** 2).mean()
        with CountCollectives() as bwd:
            loss.backward()
        if i == 0:
            out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out["losses"].append(t.item() / world)
        out["counts"].append((dict(fwd.counts), dict(bwd.counts)))
    out["calls"] = list(sw.CALLS)
    if lib == "ours":  # resharded: every gathered output and inner tensor freed by storage resize
        exts = [p.extension for layer in model.layers for p in layer._fsdp.group.params  # type: ignore
                if p.extension is not None]
        out["freed"] = len(exts) == 2 and all(
            t.untyped_storage().size() == 0 for e in exts for t in (*e.outputs, *e.inner)) and all(
            e.inner and e.outputs for e in exts)
    out["weights"] = {n: _dequantized(p) for n, p in model.named_parameters() if n.endswith("weight")}
    return out


def _dequantized(p: torch.Tensor) -> torch.Tensor:
    """The whole weight as a plain tensor (the master weight of an Int8Weight, an Int4Weight dequantized)."""
    local = p.to_local()  # type: ignore[attr-defined]
    if isinstance(local, sw.Int4Weight):
        local = local.dequant()
    local = local._data.clone() if isinstance(local, sw.Int8Weight) else local.detach().clone()
    if local.shape == p.shape:  # HSDP (2, 1): one shard holds every row
        return local
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]  # even rows in these tests
    dist.all_gather(rows, local)
    return torch.cat(rows)


@distributed(world_size=2)
def _side_by_side(model: str, mp_dtype: torch.dtype | None, hsdp: tuple[int, int] | None = None,
                  accumulate: bool = False) -> dict[str, Any]:
    make = {"int8": sw.int8_net, "int8_mesh_only": lambda: sw.int8_net(kind=sw.Int8WeightMeshOnly),
            "int4": sw.int4_net}[model]
    mp = None if mp_dtype is None else MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    out: dict[str, Any] = {lib: _train(lib, make, mp, hsdp, accumulate) for lib in ("ours", "torch")}
    with CountCollectives() as probe:  # what one all_gather_object issues on this torch (2.15: all_gather only)
        dist.all_gather_object([None] * dist.get_world_size(), "probe")
    out["object_gather"] = dict(probe.counts)
    return out


def _check_parity(r: dict[str, Any], *, same_calls: bool = True) -> None:
    ours, ref = r["ours"], r["torch"]
    assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])) <= TOL, (ours["losses"], ref["losses"])
    assert ours["grads"].keys() == ref["grads"].keys() and ours["grads"], (ours["grads"].keys(), ref["grads"].keys())
    for name, g in ours["grads"].items():
        torch.testing.assert_close(g, ref["grads"][name], atol=TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    for name, w in ours["weights"].items():  # after the optimizer steps: the master weights too
        torch.testing.assert_close(w, ref["weights"][name], atol=TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    if same_calls:  # same hooks, same arguments
        assert ours["calls"] == ref["calls"], (ours["calls"][:6], ref["calls"][:6])
    else:  # the same calls but for the mesh: (2, 1) against torch's 1-D mesh
        assert [c for c in ours["calls"] if c[0] == "post"] == [c for c in ref["calls"] if c[0] == "post"]


@pytest.mark.parametrize("model", ["int8", "int8_mesh_only", "int4"])
def test_trains_like_torch(model: str) -> None:
    """Losses, first-step gradients and weights after 3 steps within 1e-6 of torch's fully_shard;
    one all-gather per unit in forward (3 units), one reduce-scatter per unit in backward."""
    for r in _side_by_side(model, None):
        _check_parity(r)
        assert r["ours"]["freed"]
        fwd, bwd = r["ours"]["counts"][1]
        assert fwd == {"all_gather": 3}, fwd
        assert bwd.get("reduce_scatter") == 3 and bwd.get("all_gather") == 2, bwd  # layers regathered
        # from step 2 on, exactly torch's collectives; step 1 adds the layout check of the 2 units holding
        # subclass weights (one all_gather_object each: what it issues is torch's, measured beside)
        assert r["ours"]["counts"][1:] == r["torch"]["counts"][1:]
        want = {"all_gather": 3}
        for name, n in r["object_gather"].items():
            want[name] = want.get(name, 0) + 2 * n
        assert r["ours"]["counts"][0][0] == want, (r["ours"]["counts"][0], r["object_gather"])
        assert r["ours"]["losses"][-1] < r["ours"]["losses"][0], r["ours"]["losses"]  # it trains


def test_hook_forms_and_out_reuse() -> None:
    """The 5-argument pre-hook gets the module, the outer size and the policy; the 1-argument one the
    mesh; the post-hook builds the unsharded parameter once, then gets out= on every later unshard."""
    full, mesh_only = _side_by_side("int8", None), _side_by_side("int8_mesh_only", None)
    calls = full[0]["ours"]["calls"]
    assert ("pre5", "FSDPQLinear", "None", "(64, 32)") in calls and ("pre5", "FSDPQLinear", "None", "(32, 64)") in calls
    assert not any(c[0] == "pre1" for c in calls)
    assert {c for c in mesh_only[0]["ours"]["calls"] if c[0].startswith("pre")} == {("pre1", "2")}
    posts = [c[1] for c in calls if c[0] == "post"]
    # two layers, each gathered in forward and backward of 3 steps: first "new" (one per layer), then "out"
    assert posts[:2] == ["new", "new"] and posts[2:] == ["out"] * (len(posts) - 2) and len(posts) == 12, posts


@pytest.mark.parametrize("model", ["int8", "int4"])
def test_mixed_precision_like_torch(model: str) -> None:
    """param_dtype=bf16 reaches the pre-hook's mp_policy and the post-hook's param_dtype, as in torch."""
    for r in _side_by_side(model, torch.bfloat16):
        _check_parity(r)
        assert ("post", "out", "torch.bfloat16") in r["ours"]["calls"]
        assert any(c[0] == "pre5" and c[2] == "torch.bfloat16" for c in r["ours"]["calls"])


@pytest.mark.parametrize("model", ["int8", "int4"])
def test_gradient_accumulation_like_torch(model: str) -> None:
    """A no-sync micro-batch, then a synced one: the gradients of both, as torch's."""
    for r in _side_by_side(model, torch.bfloat16, None, True):
        _check_parity(r)


@pytest.mark.parametrize("model", ["int8_mesh_only", "int4"])
@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_hsdp_like_torch(model: str, shape: tuple[int, int]) -> None:
    """HSDP meshes (replicate, shard): the pre-hook gets the shard axis' 1-D mesh; (2, 1) averages the
    grads over the replicas (the layout check over the replicate group): equal to torch's 1-D run."""
    for r in _side_by_side(model, None, shape):
        _check_parity(r, same_calls=shape[1] > 1)
        if model == "int8_mesh_only":
            assert {c for c in r["ours"]["calls"] if c[0] == "pre1"} == {("pre1", str(shape[1]))}


@distributed(world_size=2, timeout=60)
def _bad(kind: str) -> str:
    """``uneven``: a layer of 33 rows over 2 ranks: rank 1's shard has 16 rows, and Int8Weight returns
    them unpadded (and a (16, 1) scale), so torch's padded-size rule fails on rank 1 only (both pre-hook
    forms). ``raises``: the pre-hook raises on rank 1 only."""
    torch.manual_seed(0)
    cls = {"uneven": sw.Int8Weight, "uneven_mesh_only": sw.Int8WeightMeshOnly,
           "raises": sw.Int8WeightFailsOnRank1}[kind]
    rows = 32 if kind == "raises" else 33
    model = sw.Net([sw.QLinear(32, rows, cls), sw.QLinear(rows, 32, cls)], 32)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        model(torch.randn(4, 32))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("kind", ["uneven", "uneven_mesh_only"])
def test_padded_size_rule_fails_on_every_rank(kind: str) -> None:
    """The same error on both ranks (the bad rank named, the padded shape, the fix), and no hang:
    torch raises on rank 1 only (5-argument form; the 1-argument form it does not check) and leaves
    rank 0 in the all-gather."""
    messages = _bad(kind)
    assert messages[0] == messages[1], messages
    msg = messages[0]
    assert "layers.0.weight" in msg and "on rank 1" in msg and "padded shard shape [17, 32]" in msg, msg
    assert "int8[16, 32]" in msg and "Fix:" in msg, msg


@distributed(world_size=2, timeout=60)
def _bad_signature() -> str:
    try:
        fully_shard(sw.QLinear(32, 32, sw.Int8WeightThreeArgs))
    except TypeError as exc:
        return str(exc)
    return "no error"


def test_bad_pre_hook_signature_is_refused_at_fully_shard() -> None:
    messages = _bad_signature()
    assert messages[0] == messages[1] and "takes 3 arguments; expected 1 (mesh) or 5" in messages[0], messages


def test_pre_hook_error_on_one_rank_raises_on_every_rank() -> None:
    messages = _bad("raises")
    assert messages[0] == messages[1], messages
    assert "raised on rank 1: RuntimeError: no calibration data on this rank" in messages[0], messages[0]
