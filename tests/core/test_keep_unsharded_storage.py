"""``FSDPModule.set_keep_unsharded_storage`` (torch 2.15's): resharding registers the sharded parameters again
but keeps the unsharded storage, so the gathered parameters' data pointers stay the same from step to step
(CUDA-graph capture); side by side with torch's fully_shard where it has the method: the same storage kept
and freed, the same losses and gradients (equal to the run that frees)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import FSDPModule, fully_shard
from tests.core.test_surface import _build, _close, _torch_fs, _train, _units
from tests.distributed.harness import distributed
from tests.torch_ref import lacks_method

TORCH_NO_KEEP = lacks_method("set_keep_unsharded_storage", since="2.15")


def _allocated(unit: Any) -> list[bool]:
    """Per parameter of ``unit``: is its unsharded storage allocated (ours, or torch's FSDPParam)."""
    if isinstance(unit, FSDPModule):
        return [p.unsharded_allocated() for g in unit._fsdp.groups for p in g.params]
    state = unit._get_fsdp_state()
    return [fp._unsharded_param.untyped_storage().size() > 0 for g in state._fsdp_param_groups for fp in g.fsdp_params]


def _pointers(model: nn.Module, steps: int, keep: bool | None, recurse: bool = True) -> dict[str, Any]:
    """Train ``steps`` steps; the unsharded weights' data pointers each forward saw, what stays allocated."""
    if keep is not None:
        model.set_keep_unsharded_storage(keep, recurse=recurse)
    seen: list[tuple[int, int]] = []
    hook = model.blocks[0].up.register_forward_pre_hook(
        lambda m, a: seen.append((m.weight.data_ptr(), model.head.weight.data_ptr())))
    out = _train(model, None, steps=steps)
    hook.remove()
    units = _units(model)
    out["seen"] = seen
    out["allocated"] = [all(_allocated(u)) for u in units]  # after the last backward (every unit resharded)
    out["registered_sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    out["repr"] = model.fsdp_repr() if isinstance(model, FSDPModule) else ""  # (ours only)
    model.set_keep_unsharded_storage(False)
    out["kept_until_used"] = [all(_allocated(u)) for u in units]  # a reshard of sharded units changes nothing
    for u in units:  # the next unshard/reshard cycle frees
        u.unshard()
        u.reshard()
    out["freed"] = [not any(_allocated(u)) for u in units]
    return out


@distributed(world_size=2)
def _keep() -> dict[str, Any]:
    out: dict[str, Any] = {}
    libs = {"ours": fully_shard} if TORCH_NO_KEEP else {"ours": fully_shard, "torch": _torch_fs()}
    for lib, fs in libs.items():
        out[lib] = {"keep": _pointers(_build(fs), 3, True), "default": _pointers(_build(fs), 2, None),
                    "root_only": _pointers(_build(fs), 1, True, recurse=False)}
    return out


def test_keep_unsharded_storage_keeps_data_pointers_like_torch() -> None:
    for r in _keep():
        ours = r["ours"]
        keep = ours["keep"]
        assert len(set(keep["seen"])) == 1, keep["seen"]  # the same storage every step
        assert all(keep["allocated"]) and keep["registered_sharded"], keep
        assert "UNSHARDED" not in keep["repr"] and keep["repr"].count(" SHARDED") == len(keep["repr"].splitlines()), \
            keep["repr"]  # kept but not in use: SHARDED, as the module's parameters say
        assert all(keep["freed"]) and all(ours["default"]["freed"])  # set back to False: the next reshard frees
        assert not any(ours["default"]["allocated"]), ours["default"]["allocated"]  # the default frees
        root_only = ours["root_only"]["allocated"]  # units in model.modules() order: the root first
        assert root_only[0] and not any(root_only[1:]), root_only
        for a, b in zip(keep["losses"][:2], ours["default"]["losses"]):
            assert abs(a - b) < 1e-6
        _close(keep["grads"], ours["default"]["grads"])
        if "torch" not in r:
            continue
        theirs = r["torch"]
        for case in ("keep", "default", "root_only"):
            assert ours[case]["allocated"] == theirs[case]["allocated"], case
            assert ours[case]["kept_until_used"] == theirs[case]["kept_until_used"], case
            assert ours[case]["freed"] == theirs[case]["freed"], case
            assert ours[case]["losses"] == pytest.approx(theirs[case]["losses"], abs=1e-6), case
            assert ours[case]["counts"] == theirs[case]["counts"], case
            _close(ours[case]["grads"], theirs[case]["grads"])
        assert len(set(theirs["keep"]["seen"])) == 1, theirs["keep"]["seen"]
    if TORCH_NO_KEEP:
        pytest.skip(TORCH_NO_KEEP)
