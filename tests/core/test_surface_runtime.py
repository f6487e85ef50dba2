"""The rest of torch 2.13's FSDPModule surface (see test_surface.py for the reduce side): reset_iter_state
after an exception (vs a never-failed run and torch), share_comm_ctx across two roots, set_post_optim_event,
the calls that cannot act on gloo (a warning once or NotImplementedError naming device and backend), and
every public torch FSDPModule method present."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

from fully_shard import FSDPModule, fully_shard, share_comm_ctx
from tests.core.common import local_slice
from tests.core.test_surface import _AllGather, _build, _close, _double, _torch_fs, _train
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.torch_ref import lacks_method, torch_version

TORCH_NO_RESET = lacks_method("reset_iter_state")


# --- reset_iter_state ------------------------------------------------------------------------------------
class _Boom(Exception):
    pass


def _failing_step(model: TinyGPT, where: str) -> None:
    x, y = batches(1, batch=4, seed=99)[0]
    if where == "forward":
        handle = model.blocks[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(_Boom()))
        with pytest.raises(_Boom):
            model(local_slice(x))
    else:
        def boom(_: torch.Tensor) -> None:
            raise _Boom()
        # backward_mid: fails when the gradient reaches blocks[0]'s output (blocks[1] already reduced)
        def arm(_m: nn.Module, _i: Any, o: torch.Tensor) -> None:
            o.register_hook(boom)

        mid = model.blocks[0].register_forward_hook(arm)
        out = model(local_slice(x))
        if where == "backward_start":
            mid.remove()
        handle = out.register_hook(boom) if where == "backward_start" else mid
        with pytest.raises(_Boom):
            loss_fn(out, local_slice(y)).backward()
    handle.remove()
    model.reset_iter_state()


def _recover(fs: Any, where: str | None) -> dict[str, Any]:
    model = _build(fs)
    result = _train(model, None, steps=1)  # a normal step, then the failure, then two good steps
    if where is not None:
        _failing_step(model, where)
        for p in model.parameters():
            p.grad = None
    names = [m.fsdp_state_name for m in model.modules() if fs is fully_shard and isinstance(m, FSDPModule)]
    after = _train(model, None, steps=2)
    return {"names": names, "before": result["losses"], "after": after["losses"], "grads": after["grads"]}


@distributed(world_size=2)
def _reset() -> dict[str, Any]:
    out = {"clean": _recover(fully_shard, None)}
    for where in ("forward", "backward_start", "backward_mid"):
        out[where] = {"ours": _recover(fully_shard, where)}
        if not TORCH_NO_RESET:
            out[where]["torch"] = _recover(_torch_fs(), where)
    model = _build(fully_shard)
    _train(model, None, steps=1)
    with pytest.raises(RuntimeError, match="root"):
        model.blocks[0].reset_iter_state()
    return out


def test_reset_iter_state_after_an_exception() -> None:
    for r in _reset():
        clean = r["clean"]
        for where in ("forward", "backward_start", "backward_mid"):
            ours, theirs = r[where]["ours"], r[where].get("torch")
            assert set(ours["names"]) == {"SHARDED"}, (where, ours["names"])
            assert ours["after"] == pytest.approx(clean["after"], abs=1e-6), (where, ours["after"], clean)
            _close(ours["grads"], clean["grads"])
            if theirs is None:
                continue
            if where == "backward_mid":
                # torch 2.13 keeps the failed backward's unsharded grads of the units that had run
                # (the root's norm and head): its next step's grads carry them (measured: up to 0.097 off).
                # Ours drops them: equal to the never-failed run above.
                assert ours["after"][0] == pytest.approx(theirs["after"][0], abs=1e-6)
                continue
            assert ours["after"] == pytest.approx(theirs["after"], abs=1e-6), (where, theirs["after"])
            _close(ours["grads"], theirs["grads"])
    if TORCH_NO_RESET:
        pytest.skip(TORCH_NO_RESET)


# --- share_comm_ctx ---------------------------------------------------------------------------------------
class _Chunk(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.inp = nn.Embedding(97, 32) if first else nn.LayerNorm(32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 32 if first else 97)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.inp(x))))


def _chunks(fs: Any, share: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    chunks = [_Chunk(True), _Chunk(False)]
    for c in chunks:
        fs(c.mid)
        fs(c)
    share(chunks)
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for x, y in batches(2, batch=4, vocab=97):
        loss = loss_fn(chunks[1](chunks[0](local_slice(x))), local_slice(y))
        loss.backward()
        grads = {f"{i}.{n}": p.grad.full_tensor() for i, c in enumerate(chunks) for n, p in c.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "chunks": chunks}


@distributed(world_size=2)
def _share() -> dict[str, Any]:
    from torch.distributed.fsdp import share_comm_ctx as torch_share
    ours, theirs = _chunks(fully_shard, share_comm_ctx), _chunks(_torch_fs(), torch_share)
    comms = {id(m._fsdp.group.ctx) for c in ours.pop("chunks") for m in c.modules() if isinstance(m, FSDPModule)}
    theirs.pop("chunks")
    late = _chunks(fully_shard, lambda chunks: None)  # shared after the first steps
    share_comm_ctx(late["chunks"])
    late_comms = {id(m._fsdp.group.ctx) for c in late.pop("chunks") for m in c.modules()
                  if isinstance(m, FSDPModule)}
    return {"ours": ours, "torch": theirs, "comms": len(comms), "late_comms": len(late_comms)}


def test_share_comm_ctx_across_two_roots() -> None:
    for r in _share():
        assert r["comms"] == 1 and r["late_comms"] == 1, r
        for a, b in zip(r["ours"]["losses"], r["torch"]["losses"]):
            assert abs(a - b) < 1e-6, (r["ours"]["losses"], r["torch"]["losses"])
        _close(r["ours"]["grads"], r["torch"]["grads"])


# --- set_post_optim_event, and the calls that cannot act here ------------------------------------------------
class _Event:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


@distributed(world_size=2)
def _host_side() -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _build(fully_shard)
    events = [_Event(), _Event()]
    out["with_event"] = _train(model, lambda m: m.set_post_optim_event(events[0]), steps=1)["losses"]
    model.set_post_optim_event(torch.Event(device="cpu"))  # accepted: the host waits on it
    model.set_post_optim_event(None)  # no event (torch accepts it): replaces the CPU event
    model.set_post_optim_event(events[1])  # replaces the previous one, waited once by the next forward
    out["second"] = _train(model, None, steps=1)["losses"]
    model.set_post_optim_event(events[1])
    model.set_post_optim_event(None)  # forgets events[1]: the next forward waits on nothing
    out["after_none"] = _train(model, None, steps=1)["losses"]
    out["waits"] = [e.waits for e in events]
    plain = _build(fully_shard)
    out["plain"] = [_train(plain, None, steps=1)["losses"][0] for _ in range(2)]
    with pytest.raises(TypeError, match="post_optim_event"):
        model.set_post_optim_event(object())
    with pytest.raises(NotImplementedError, match=r"'cpu'.*'gloo'"):
        model.set_symm_mem_for_comm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pg = _build(fully_shard)
        for m in pg.modules():
            if isinstance(m, FSDPModule):
                m.set_allocate_memory_from_process_group_for_comm(True)
        out["pg_alloc"] = [_train(pg, None, steps=1)["losses"][0] for _ in range(2)]
        pg.set_reduce_scatter_divide_factor(2.0)
    out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    out["alias_factor"] = pg._fsdp.group.reducer.settings.divide_factor
    pg.set_custom_all_gather(_AllGather())
    with pytest.raises(ValueError, match="cannot be combined"):
        pg.set_allocate_memory_from_process_group_for_comm(True)
    with pytest.raises(TypeError, match="allocate"):
        pg.set_custom_reduce_scatter(lambda *a: None)
    with pytest.raises(ValueError, match="no streams"):
        pg.set_all_reduce_hook(_double, stream=object())
    with pytest.raises(ValueError, match="finite number"):
        pg.set_gradient_divide_factor(0.0)
    return out


def test_post_optim_event_and_calls_that_cannot_act_on_gloo() -> None:
    for r in _host_side():
        assert r["waits"] == [1, 1], r["waits"]
        assert [*r["with_event"], *r["second"]] == pytest.approx(r["plain"], abs=1e-6)
        assert r["pg_alloc"] == pytest.approx(r["plain"], abs=1e-6)
        pg = [m for cat, m in r["warnings"] if "process_group" in m]
        assert len(pg) == 1 and "'cpu'" in pg[0] and "'gloo'" in pg[0], r["warnings"]  # once, not per unit
        assert any(cat == "FutureWarning" and "set_gradient_divide_factor" in m for cat, m in r["warnings"])
        assert r["alias_factor"] == 2.0


def test_every_torch_fsdp_module_method_exists() -> None:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    names = {n for n in vars(TorchFSDPModule) if not n.startswith("_") and callable(getattr(TorchFSDPModule, n))}
    assert sorted(n for n in names if not hasattr(FSDPModule, n)) == []
    newer = {(2, 13): {"set_gradient_divide_factor", "reset_iter_state", "set_symm_mem_for_comm"},
             (2, 15): {"finalize_backward", "set_manual_backward_finalization", "set_keep_unsharded_storage"}}
    assert sorted(n for ns in newer.values() for n in ns if not callable(getattr(FSDPModule, n, None))) == []
    # torch from that version on has them (the table is right); ours has them on every torch
    assert sorted(n for v, ns in newer.items() if torch_version >= v for n in ns - names) == []
    if not newer[(2, 13)] <= names:  # an older torch: its surface is covered, torch 2.13's is not listed here
        pytest.skip(f"torch {torch.__version__}'s FSDPModule lacks {sorted(newer[(2, 13)] - names)} (torch 2.13's "
                    "has): ours was compared with this torch's methods only")
