"""``compat.patch_torch(fsdp1=True)``: torch's ``FullyShardedDataParallel`` (where torch defines it and where its
own modules bound it at import) becomes this library's class; ``unpatch_torch()`` puts back the very objects;
``patch_torch()`` without the flag leaves FSDP1 alone. (The note's code run after the patch, and its losses:
tests/wrap/test_fsdp1_parity.py.)"""

from __future__ import annotations

import importlib
import sys

from fully_shard import FullyShardedDataParallel, compat


def _fsdp1_bindings() -> dict[tuple[str, str], object]:
    found = {}
    for modname, names in compat.FSDP1_TARGETS:
        importlib.import_module(modname)
        for name in names:
            found[(modname, name)] = vars(sys.modules[modname])[name]
    return found


def test_fsdp1_flag_rebinds_the_class_and_unpatch_restores_exactly() -> None:
    before = _fsdp1_bindings()
    assert len(before) == 5 and all(obj is not FullyShardedDataParallel for obj in before.values())
    torch_class = before[("torch.distributed.fsdp", "FullyShardedDataParallel")]
    assert all(obj is torch_class for obj in before.values())  # one class, bound in five places
    assert not compat.is_patched()
    try:
        plain = compat.patch_torch()  # FSDP2 names only
        assert _fsdp1_bindings() == before and not any("FullyShardedDataParallel" in n for n in plain)
        names = compat.patch_torch(fsdp1=True)  # adds the FSDP1 class to what is patched
        assert set(plain) < set(names) and len(names) == len(plain) + 5, names
        assert all(obj is FullyShardedDataParallel for obj in _fsdp1_bindings().values())
        assert compat.patch_torch(fsdp1=True) == names  # idempotent
        import torch.distributed.fsdp as tfsdp
        from torch.distributed.fsdp import FullyShardedDataParallel as Imported

        assert Imported is FullyShardedDataParallel and tfsdp.FSDPModule is not None
        import torch.distributed.checkpoint.state_dict as dcp_state_dict

        assert dcp_state_dict.FSDP is FullyShardedDataParallel  # torch's get_state_dict sees our wrappers
    finally:
        compat.unpatch_torch()
    after = _fsdp1_bindings()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert not compat.is_patched() and compat.patched_names() == []
