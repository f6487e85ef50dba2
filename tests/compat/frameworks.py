"""What the framework tests share: accelerate's FSDP path selected on CPU, and a torch-FSDP1-or-ours switch.

accelerate enables FSDP only for accelerator-backed process groups (``AcceleratorState`` sets
``DistributedType.FSDP`` for MULTI_GPU/NPU/XPU/..., never for MULTI_CPU). ``select_fsdp`` does on CPU what
accelerate does on a GPU node at that point (the distributed type and the plugin in its two shared
states); everything after, ``prepare``, ``backward``, ``clip_grad_norm_``, ``save_state``/``load_state``,
is accelerate's own code, unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch

from fully_shard import compat


@contextlib.contextmanager
def fsdp1_class(variant: str, *, cpu_device_id: bool = False) -> Generator[None, None, None]:
    """``variant`` "ours": torch's FSDP1 class is this library's for the duration (``patch_torch(fsdp1=True)``);
    "torch": torch's own. ``cpu_device_id``: torch's class as ``torch.distributed.fsdp.FullyShardedDataParallel``
    takes ``device_id=None`` as the CPU device (torch's FSDP1 refuses ``None`` without a GPU; a framework passes
    a CUDA index there on a GPU node). Ours is left as it is."""
    assert variant in ("ours", "torch") and not compat.is_patched()
    import torch.distributed.fsdp as fsdp

    torch_class = fsdp.FullyShardedDataParallel
    if variant == "ours":
        compat.patch_torch(fsdp1=True)
    elif cpu_device_id:

        class OnCpu(torch_class):  # type: ignore[misc, valid-type]
            def __init__(self, module: torch.nn.Module, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
                super().__init__(module, *args, device_id=torch.device("cpu") if device_id is None else device_id,
                                 **kwargs)

        fsdp.FullyShardedDataParallel = OnCpu  # type: ignore[misc]
    try:
        yield
    finally:
        if variant == "ours":
            compat.unpatch_torch()
        fsdp.FullyShardedDataParallel = torch_class  # type: ignore[misc]


def reset_accelerate() -> None:
    """accelerate's process-wide singletons back to empty (the test ranks are reused across runs)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def select_fsdp(accelerator: Any, plugin: Any, *, variant: str) -> None:
    """accelerate's FSDP path on CPU (see the module docstring). torch's FSDP1 also needs the plain ``cpu``
    device: it refuses accelerate's ``cpu:0`` as ``device_id`` ("Inconsistent compute device"); ours takes
    accelerate's device as it is."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState() copies it back
    state.fsdp_plugin = plugin
    if variant == "torch":
        state.device = torch.device("cpu")
