"""CPUOffloadPolicy: parity, shards/grads/optimizer state on the CPU, and pin_memory=True on a machine
without an accelerator warns once instead of crashing."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fully_shard.core.api as api
from fully_shard import CPUOffloadPolicy, fully_shard
from tests.distributed.harness import distributed
from tests.models import TinyGPT
from tests.policies.common import train_parity


class _CountMoves(TorchDispatchMode):
    """Counts copies between devices (``.to(device)``), which offload makes even when both are the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._to_copy.default and "device" in (kwargs or {}):
            self.count += 1
        return func(*args, **(kwargs or {}))


@distributed(world_size=2)
def _offload(pin_memory: bool) -> dict[str, object]:
    api._PIN_WARNED = False  # the pool's processes are reused: make "once" observable here
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    policy = CPUOffloadPolicy(pin_memory=pin_memory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for blk in model.blocks:
            fully_shard(blk, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
    pin_warnings = [str(w.message) for w in caught if "pin_memory" in str(w.message)]
    result: dict[str, object] = train_parity(model, ref, steps=6, batch=4, optim=torch.optim.AdamW, lr=1e-3)
    result["pin_warnings"] = pin_warnings
    result["param_devices"] = {p.to_local().device.type for p in model.parameters()}
    # one more step to look at grads and optimizer state before they are zeroed
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from tests.models import batches, loss_fn
    from tests.policies.common import local_slice

    x, y = batches(1, batch=4)[0]
    with _CountMoves() as moves:  # the offload data path runs here too: device copies in and out
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
    result["moves"] = moves.count
    result["n_params"] = len(list(model.parameters()))
    result["grad_devices"] = {p.grad.to_local().device.type for p in model.parameters()}
    opt.step()
    result["state_devices"] = {t.device.type for s in opt.state.values() for t in s.values()
                               if isinstance(t, torch.Tensor) and t.dim() > 0}
    return result


def test_cpu_offload_parity_and_pin_memory_fallback() -> None:
    accelerator = torch.accelerator.is_available()
    for r in _offload(True):
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r
        assert r["param_devices"] == r["grad_devices"] == r["state_devices"] == {"cpu"}
        # each parameter copied in for the forward and the backward all-gathers and its grad copied out
        # (the root's parameters stay gathered between forward and backward: at least 2 per parameter)
        assert r["moves"] >= 2 * r["n_params"], r["moves"]
        if not accelerator:
            assert len(r["pin_warnings"]) == 1, r["pin_warnings"]  # once for 4 fully_shard calls


def test_cpu_offload_without_pinning_is_silent() -> None:
    for r in _offload(False):
        assert r["pin_warnings"] == []
        assert r["loss_diff"] < 1e-5, r
