"""Where torch's own fully_shard can serve as the side-by-side reference, and why not where it cannot.

The library targets torch 2.13's FSDP2 surface plus torch 2.15's additions, and must also run on older torch
(2.11 on the GPU machine). There torch's fully_shard lacks some names and fails some runs that this library
handles; a test then still checks this library (against the unsharded model), drops only the torch side and
reports the reason returned here (``pytest.skip`` after its own checks passed)."""

from __future__ import annotations

import importlib

import torch

torch_version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
_SKIPPED = "only the torch-side comparison is skipped"


def lacks_name(module: str, name: str) -> str | None:
    """Why torch's ``module.name`` cannot be the reference (this torch has no such name), else None."""
    if hasattr(importlib.import_module(module), name):
        return None
    return f"torch {torch.__version__} has no {module}.{name} (torch 2.13 has): {_SKIPPED}"


def lacks_method(name: str, since: str = "2.13") -> str | None:
    """Why torch's ``FSDPModule.name`` cannot be the reference (torch ``since`` has it), else None."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, name):
        return None
    return f"torch {torch.__version__}'s FSDPModule has no {name}() (torch {since}'s has): {_SKIPPED}"


def lacks_field(module: str, cls: str, field: str) -> str | None:
    """Why torch's dataclass ``module.cls`` cannot be the reference for ``field`` (this torch's has no such
    field: torch 2.15 added ``MixedPrecisionPolicy.param_dtype_override_fn``), else None."""
    import dataclasses

    if field in {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), cls))}:
        return None
    return f"torch {torch.__version__}'s {cls} has no {field} (torch 2.15's has): {_SKIPPED}"


def fails_before(fixed: tuple[int, int], what: str) -> str | None:
    """Why torch's fully_shard cannot run ``what`` on this torch (each such run was seen failing on
    torch 2.12, and on 2.11 where it has the feature at all, and passing on ``fixed``), else None."""
    if torch_version >= fixed:
        return None
    return f"torch {torch.__version__}'s fully_shard fails {what} (works on torch {fixed[0]}.{fixed[1]}): {_SKIPPED}"
