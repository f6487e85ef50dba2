"""Encode non-tensor training state (extra, optimizer hyperparameters) as strict JSON plus named tensors.

No pickle: values must be JSON scalars, lists, tuples, dicts, tensors or numpy arrays. Tensors (and numpy
arrays) are replaced by ``{"__tensor__": name}`` references and stored in safetensors files; tuples,
non-finite floats, bytes and dicts with non-string keys get small ``{"__marker__": ...}`` wrappers so that
decoding returns the same Python types.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .errors import CheckpointError

Encoded = Any  # an encoded tree: strict-JSON values and marker objects (see the module docstring)

TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
                     ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        TORCH_TO_ST[getattr(torch, _name)] = _code
ST_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_ST.items()}

def st_dtype(dtype: torch.dtype, where: str) -> str:
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise CheckpointError(f"{where}: dtype {dtype} cannot be stored in safetensors; supported: "
                              f"{sorted(str(d) for d in TORCH_TO_ST)}; fix: cast the tensor") from None


class Encoder:
    """Encode trees; collect their tensors under ``prefix + counter`` names."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, DTensor):
            raise CheckpointError(f"{where} is a DTensor; extra state holds plain tensors only; fix: pass "
                                  "value.full_tensor() (or keep it in the model/optimizer)")
        if isinstance(value, torch.Tensor):
            return {"__tensor__": self._add(value, where)}
        if type(value).__module__ == "numpy":
            return self._numpy(value, where)
        if isinstance(value, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{where}[{k!r}]") for k, v in value.items()}
            return {"__items__": [[self.encode(k, f"{where} key {k!r}"), self.encode(v, f"{where}[{k!r}]")]
                                  for k, v in value.items()]}
        raise CheckpointError(
            f"{where} has type {type(value).__module__}.{type(value).__qualname__}, which a checkpoint cannot "
            "store: checkpoints hold JSON values (None, bool, int, float, str, list, tuple, dict), bytes, "
            "tensors and numpy arrays, never pickle; fix: convert it, e.g. pass obj.state_dict()")

    def _add(self, tensor: torch.Tensor, where: str) -> str:
        st_dtype(tensor.dtype, where)
        name = f"{self.prefix}{len(self.tensors)}"
        self.tensors[name] = tensor.detach()
        return name

    def _numpy(self, value: Any, where: str) -> Any:
        import numpy as np

        if isinstance(value, np.ndarray):
            tensor = torch.from_numpy(np.ascontiguousarray(value))
            return {"__ndarray__": self._add(tensor, where)}
        if isinstance(value, np.generic):
            return self.encode(value.item(), where)
        raise CheckpointError(f"{where} has numpy type {type(value).__name__}, which a checkpoint cannot store")


def decode(value: Any, get_tensor: Callable[[str], torch.Tensor]) -> Any:
    """Inverse of Encoder.encode; ``get_tensor(name)`` returns the stored tensor."""
    if isinstance(value, list):
        return [decode(v, get_tensor) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (marker, inner), = value.items()
        if marker == "__tensor__":
            return get_tensor(inner)
        if marker == "__ndarray__":
            return get_tensor(inner).numpy()
        if marker == "__tuple__":
            return tuple(decode(v, get_tensor) for v in inner)
        if marker == "__float__":
            return float(inner)
        if marker == "__bytes__":
            return base64.b64decode(inner)
        if marker == "__items__":
            return {_hashable(decode(k, get_tensor)): decode(v, get_tensor) for k, v in inner}
    return {k: decode(v, get_tensor) for k, v in value.items()}


def tensor_refs(value: Any) -> list[str]:
    """Names of all tensors an encoded tree refers to."""
    if isinstance(value, list):
        return [n for v in value for n in tensor_refs(v)]
    if isinstance(value, dict):
        if len(value) == 1 and next(iter(value)) in ("__tensor__", "__ndarray__"):
            return [next(iter(value.values()))]
        return [n for v in value.values() for n in tensor_refs(v)]
    return []


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
