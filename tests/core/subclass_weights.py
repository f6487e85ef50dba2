"""Two tensor subclasses with FSDP2 all-gather hooks, and tiny models using them (tests only).

- ``Int8Weight``: a trainable fp32 master weight gathered as int8 data + a per-row fp32 scale (2 inputs
  of 2 dtypes); the post-hook dequantizes into a plain ``param_dtype`` tensor, the unsharded parameter
  autograd trains (the way torchao's float8 weights plug in). ``Int8WeightMeshOnly`` is the same with
  the 1-argument pre-hook.
- ``Int4Weight``: a frozen 4-bit weight with three inner tensors (packed uint8 nibbles, fp32 scales,
  uint8 zero points); the post-hook wraps the gathered outputs themselves (no copy) and with ``out=``
  only checks that ``out`` still aliases them (the way torchao's NF4 does). Trained QLoRA-style: a
  frozen base plus LoRA adapters.

Both log their hook calls in ``CALLS`` (the tests read which form ran, ``out=``, the dtypes passed).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

aten = torch.ops.aten
CALLS: list[tuple[str, ...]] = []

# Ops that keep the subclass (sharding, copying, detaching); every other op sees the plain tensors.
_KEEP = {aten.slice, aten.clone, aten._to_copy, aten.detach, aten.alias, aten.view, aten.as_strided, aten.new_zeros,
         aten.empty_like, aten.zeros_like, aten.split, aten.split_with_sizes, aten._pin_memory}


class Int8Weight(torch.Tensor):
    """fp32 master weight; all-gathered as int8 + per-row scale; unsharded as a dequantized tensor."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Int8Weight:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> Int8Weight:
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t._data if isinstance(t, Int8Weight) else t

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable or func.overloadpacket is aten.copy_:
            return args[0]  # in place on the master weight (optimizer steps, copy_)
        if func.overloadpacket in _KEEP:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        return out

    @staticmethod
    def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS.append(("pre5", type(module).__name__, str(mp_policy.param_dtype), str(tuple(outer_size))))
        return self._quantize(self._data), None

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None) -> Any:
        q, scale = outputs
        w = (q.to(torch.float32) * scale).to(param_dtype)
        CALLS.append(("post", "out" if out is not None else "new", str(param_dtype)))
        if out is not None:
            out.data.copy_(w)  # through .data: the version counter autograd saved stays as it was
            return None
        return w, (w,)


class Int8WeightMeshOnly(Int8Weight):
    """``Int8Weight`` with torch's 1-argument (``mesh``) pre-hook."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:  # type: ignore[override]
        CALLS.append(("pre1", str(mesh.size())))
        return self._quantize(self._data), None


class Int8WeightFailsOnRank1(Int8Weight):
    """A bad subclass whose pre-hook raises on rank 1 only."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        if mesh.get_local_rank() == 1:
            raise RuntimeError("no calibration data on this rank")
        return super().fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)


class Int8WeightThreeArgs(Int8Weight):
    """A bad subclass: a pre-hook of neither of torch's two signatures."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, module: Any) -> Any:  # type: ignore[override]
        raise AssertionError("never called")


class Int4Weight(torch.Tensor):
    """Frozen 4-bit weight: packed uint8 nibbles (rows, cols/2), fp32 scales and uint8 zeros (rows, 1)."""

    _INNER = ("packed", "scale", "zero")

    @staticmethod
    def __new__(cls, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, shape: torch.Size,
                dtype: torch.dtype = torch.float32) -> Int4Weight:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=packed.device, requires_grad=False)

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, shape: torch.Size,
                 dtype: torch.dtype = torch.float32) -> None:
        self.packed, self.scale, self.zero = packed, scale, zero

    def __repr__(self) -> str:
        return f"Int4Weight({list(self.shape)}, {self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return list(self._INNER), (self.shape, self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Int4Weight:
        return cls(*(inner[k] for k in cls._INNER), *meta)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int4Weight:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
        q = (torch.round(w / scale) + zero).clamp(0, 15).to(torch.uint8)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        return cls(packed, scale, zero.to(torch.uint8), w.shape, w.dtype)

    def dequant(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        q = torch.stack([self.packed & 0xF, self.packed >> 4], dim=-1).reshape(self.shape).float()
        return ((q - self.zero.float()) * self.scale).to(dtype or self.dtype)

    def _map(self, fn: Any, shape: torch.Size | None = None) -> Int4Weight:
        inner = [fn(getattr(self, k)) for k in self._INNER]
        rows = inner[0].shape[0]
        return Int4Weight(*inner, shape or torch.Size((rows, *self.shape[1:])), self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        w, rest = args[0], args[1:]
        op = func.overloadpacket
        if op in (aten.detach, aten.alias, aten.clone, aten._to_copy, aten._pin_memory):
            return w._map(lambda t: func(t, *rest, **kwargs))
        if op is aten.slice:  # rows: (dim 0, start, end)
            dim = rest[0] if rest else 0
            assert dim == 0, f"Int4Weight slices rows only, got dim {dim}"
            return w._map(lambda t: func(t, *rest, **kwargs))
        if op is aten.split:
            return [w._map(lambda t, i=i: func(t, *rest, **kwargs)[i]) for i in range(len(func(w.zero, *rest)))]
        if op is aten.new_zeros:  # torch's fully_shard pads the shard with new_zeros(padded shape)
            rows = rest[0][0]
            return w._map(lambda t: t.new_zeros((rows, *t.shape[1:])))
        if op is aten.copy_:
            for k in cls._INNER:
                getattr(w, k).copy_(getattr(rest[0], k))
            return w
        if op is aten.as_strided:  # torch's fully_shard views the unsharded form with its own size: an alias
            assert list(rest[0]) == list(w.shape), f"Int4Weight: as_strided to {rest[0]} from {list(w.shape)}"
            return w._map(lambda t: t, w.shape)
        if op is aten.view:  # torch's fully_shard keeps a flat view of the padded shard it never reads here
            return w._map(lambda t: t, torch.Size([math.prod(w.shape)]) if list(rest[0]) == [-1] else rest[0])
        raise NotImplementedError(f"Int4Weight: {func} is not supported (a frozen weight; use dequant())")

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS.append(("pre5", type(module).__name__, str(mp_policy.param_dtype), str(tuple(outer_size))))
        return (self.packed, self.scale, self.zero), tuple(outer_size)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None) -> Any:
        packed, scale, zero = outputs
        CALLS.append(("post", "out" if out is not None else "new", str(param_dtype)))
        if out is not None:  # the gathered outputs are reused in place: ``out`` still wraps them
            assert isinstance(out, Int4Weight) and out.packed.data_ptr() == packed.data_ptr(), "out= lost its outputs"
            return None
        return Int4Weight(packed, scale, zero, torch.Size(metadata), param_dtype), outputs


# --- models -----------------------------------------------------------------------------------------
class QLinear(nn.Module):
    """A linear layer whose weight is an ``Int8Weight`` (trainable) and whose bias is plain."""

    def __init__(self, d_in: int, d_out: int, kind: type[Int8Weight] = Int8Weight) -> None:
        super().__init__()
        self.weight = nn.Parameter(kind(torch.randn(d_out, d_in) / math.sqrt(d_in)))
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LoRALinear(nn.Module):
    """A frozen ``Int4Weight`` base plus trainable LoRA adapters (QLoRA-style)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(Int4Weight.quantize(torch.randn(d_out, d_in) / math.sqrt(d_in)), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / math.sqrt(d_in))
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequant(x.dtype)) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class Net(nn.Module):
    """``layers`` of quantized linears with GELU between them, and a plain head (the root's)."""

    def __init__(self, layers: list[nn.Module], dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def int8_net(dim: int = 32, hidden: int = 64, kind: type[Int8Weight] = Int8Weight) -> Net:
    return Net([QLinear(dim, hidden, kind), QLinear(hidden, dim, kind)], dim)


def int4_net(dim: int = 32, hidden: int = 64) -> Net:
    return Net([LoRALinear(dim, hidden), LoRALinear(hidden, dim)], dim)
