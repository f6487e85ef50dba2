"""GatherPlan: one group's all-gather tensors, fixed at lazy init: copy-in sources, copy-out targets, split sizes.

See design/data-path.md ("Unshard"). A ``ParamGroup`` builds its plan at lazy init and again when what it was
built from changes: the sharded parameters or their dtype (``adopt_module_params``: ``module.to(dtype)``,
``to_empty``) or the custom all-gather (``set_custom_all_gather``, process-group allocation). The plan holds
references to tensors that exist anyway (each sharded DTensor parameter, whose local shard is read at every
copy-in so a ``swap_tensors`` is seen; the padding zeros, shared by size; each parameter's unsharded storage
and write tensor), no new tensor object per parameter (design/data-path.md). Per unshard it is:

- ``copy_in``: the gathered buffer allocated and this rank's segment written in one fused copy;
- ``copy_out``: the unsharded storages allocated and the gathered rows written into them in one split;
- ``kept`` / ``copy_in_kept`` (``reshard_after_forward=k``): the block a rank keeps at reshard, and its
  copy into this rank's k-subgroup segment at the next unshard; ``free``: the storages freed at reshard.

Its variant says what one rank's segment holds:

- plain: each padded shard cast to ``param_dtype``, back to back (``layout.FlatLayout``);
- bytes (``param_dtype_override_fn`` keeping some parameters in another dtype, e.g. fp32 norms in a bf16
  unit): each padded shard cast to its own dtype and written as bytes into a ``uint8`` segment, as torch
  2.15's all-gather does (``layout.ByteLayout``); the copy-out splits the rows into byte views of the
  storages (made once, at build: the storages are resized in place, the views stay valid);
- int8 (``QuantizedAllGather``): the segment quantized into int8 blocks + float32 scales packed as bytes,
  dequantized before the split (quantize.py, design/quantized-all-gather.md);
- tensor subclass: the inputs of each extension parameter's ``fsdp_pre_all_gather`` beside the plain
  parameters' shards, as ``uint8`` where their dtypes differ (extension.py,
  design/tensor-subclass-extension.md); the layout is agreed by every rank at the unit's first unshard.

The k-partial all-gather gathers a plain (or bytes) unit's segments over a k-rank subgroup from the kept block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..comm import collectives
from ..comm.collectives import Alloc, allocate
from ..parallel import local_dtensor
from ..parallel.mesh import MeshInfo, SubgroupInfo
from . import quantize
from .extension import InputSpec
from .layout import ByteLayout, FlatLayout
from .param import ShardedParam
from .policy import MixedPrecisionPolicy
from .quantize import BlockLayout

__all__ = ["GatherPlan", "GatherVariant", "param_dtype_for"]

# private (design/private-torch.md): without it the copy-in is one torch.cat of flattened shards (a view each
# per unshard)
_chunk_cat = getattr(torch, "_chunk_cat", None)
_local = local_dtensor.read_local  # a DTensor's local tensor, read without a Python frame

# Padding zeros, read only: one tensor per (size, dtype, device), shared by every parameter that pads
# its shard by that much (a tensor object per parameter would be host memory kept for the process's life)
_ZEROS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _shared_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (numel, dtype, device)
    zeros = _ZEROS.get(key)
    if zeros is None:
        zeros = _ZEROS[key] = torch.zeros(numel, dtype=dtype, device=device)
    return zeros


def param_dtype_for(param: ShardedParam) -> torch.dtype:
    """The ``param_dtype`` the post-hook gets: the unit policy's for a floating-point parameter
    (``param_dtype_override_fn`` applied), else its own (torch's rule)."""
    orig = param.orig_dtype
    return param.param_dtype if param.param_dtype is not None and orig.is_floating_point else orig


class GatherVariant(enum.Enum):
    PLAIN = "plain"
    BYTES = "bytes"  # param_dtype_override_fn: the parameters gathered at several dtypes, as uint8
    QUANTIZED = "int8"  # QuantizedAllGather
    SUBCLASS = "subclass"  # some parameter gathers through fsdp_pre/post_all_gather


@dataclass(frozen=True, slots=True)
class _Flattened:
    """One parameter's pieces where the copy-in flattens them per unshard (a ``Shard(d > 0)`` or 0-dim
    parameter, an empty shard, a shard to move to the device first, mixed dtypes)."""

    sharded: DTensor
    shard_dim: int
    to_device: bool  # CPU offload (or a shard elsewhere): copied to the device, asynchronously where pinned
    pad: torch.Tensor | None  # the zeros after it (padding to the padded shard)
    block_pad: torch.Tensor | None  # int8: the zeros that fill its last quantization block
    cast: torch.dtype | None  # bytes: the dtype it is gathered at, its bytes written (the pad is uint8)


@dataclass(frozen=True, slots=True)
class _Staged:
    """A parameter whose gathered rows are not its storage: a replicated (0-dim) one (one slot per rank) or
    ``Shard(d > 0)`` (the rows are the shard dim, the parameter contiguous in its own layout, as torch's).
    The split writes its rows into a fresh buffer, copied once more into ``write``."""

    index: int  # its slot in the split's outputs
    size: int  # its elements per rank
    write: torch.Tensor  # ShardedParam.unsharded_write (flat)
    replicated: bool
    numel: int
    shape: tuple[int, ...]  # the unsharded shape with the shard dim first
    unsharded_shape: tuple[int, ...]
    shard_dim: int


@dataclass(frozen=True, slots=True)
class _Agreed:
    """A tensor-subclass unit's segment, fixed at its first unshard by every rank's pre-hook answers."""

    as_bytes: bool
    dtype: torch.dtype
    split: tuple[int, ...]  # elements (bytes where as_bytes) of each piece
    shard_units: int  # elements (bytes) of one rank's segment


class GatherPlan:
    """One group's all-gather: what its copy-in reads, what its copy-out writes, how the buffer splits
    (see the module docstring)."""

    def __init__(self, params: list[ShardedParam], *, fqn: str, flat: FlatLayout, blocks: BlockLayout | None,
                 dtypes: tuple[torch.dtype, ...], device: torch.device, mesh_info: MeshInfo,
                 subgroup: SubgroupInfo | None, mp_policy: MixedPrecisionPolicy, custom: Any = None,
                 agreed: GatherPlan | None = None) -> None:
        self.params = params
        self.fqn = fqn
        self.flat = flat
        self.blocks = blocks
        self.dtypes = dtypes  # each parameter's all-gather dtype (ParamGroup.dtypes)
        self.param_dtype = dtypes[0]  # the all-gather's dtype where it is one (not BYTES)
        self.device = device
        self.mesh_info = mesh_info
        self.world = flat.world
        self.rank = mesh_info.shard_rank
        self.mp_policy = mp_policy
        self.alloc: Alloc | None = custom.allocate if custom is not None else None
        exts = [p.extension for p in params if p.extension is not None]
        self.variant = (GatherVariant.SUBCLASS if exts else GatherVariant.QUANTIZED if blocks is not None else
                        GatherVariant.BYTES if len(set(dtypes)) > 1 else GatherVariant.PLAIN)
        # bytes: each padded shard's bytes at its dtype; one rank's segment in the buffer's elements
        self.bytes = (ByteLayout(flat, tuple(d.itemsize for d in dtypes)) if self.variant is GatherVariant.BYTES
                      else None)
        self.buffer_dtype = torch.uint8 if self.bytes is not None else self.param_dtype
        self.shard_units = self.bytes.shard_numel if self.bytes is not None else flat.shard_numel
        if exts and (blocks is not None or subgroup is not None):
            what = "QuantizedAllGather" if blocks is not None else "reshard_after_forward=k (k-rank subgroups)"
            raise NotImplementedError(
                f"fully_shard unit {fqn or '<root>'!r}: {what} cannot be combined with the tensor-subclass "
                f"all-gather extension of {exts[0].param.fqn} ({exts[0].type_name}); the subclass decides what "
                "is gathered. Fix: shard that parameter in a fully_shard call without it.")
        # the collective over the shard group, and over the k-subgroup from a kept block
        self.over = mesh_info.shard_subgroup
        self.gather = partial(collectives.all_gather, self.over, custom=custom)
        self.kept_over = subgroup
        self.gather_kept = partial(collectives.all_gather, subgroup, custom=custom) if subgroup is not None else None
        # copy-in sources: the sharded parameters (their local shards read per copy-in) and padding zeros
        self.sharded = tuple(p.sharded_param for p in params)
        self.pads: tuple[torch.Tensor | None, ...] | None = None  # fused copy-in: None where nothing pads
        self.fused = self.variant is GatherVariant.PLAIN and self._fusable()
        self.flattened: tuple[_Flattened, ...] = () if self.fused else self._flattened()
        # copy-out targets: each parameter's storage (allocated first), its rows, the split
        self.storages = tuple((p.unsharded_storage, p.unsharded_nbytes) for p in params
                              if p.extension is None and p.unsharded_storage is not None)
        self.extensions = tuple(exts)
        # torch 2.15: each extension's pre-hook gets its parameter's policy, its post-hook its param_dtype
        self.ext_policies = tuple(mp_policy.with_param_dtype(p.param_dtype) for p in params if p.extension is not None)
        self.ext_dtypes = tuple(param_dtype_for(p) for p in params if p.extension is not None)
        sizes = (blocks.pieces if blocks is not None else
                 tuple(s for size in (self.bytes or flat).sizes for s in (size, 0)))
        self.splits: list[int] = []
        self.outs: list[torch.Tensor | None] = []  # None: a fresh buffer per unshard (staged, block padding)
        staged: list[_Staged] = []
        for p, size, block_pad in zip(params, sizes[0::2], sizes[1::2]):
            if p.staged_gather:
                write = p.unsharded_write
                staged.append(_Staged(len(self.outs), size, write, p.layout.replicated, p.layout.numel,
                                      p.layout.shape, p.unsharded_shape, p.shard_dim))
                self.outs.append(None)
            elif p.extension is not None:
                self.outs.append(None)
            else:  # the storage is resized in place: the write tensor (and a byte view of it) stays valid
                self.outs.append(p.unsharded_write if self.bytes is None else p.unsharded_write.view(torch.uint8))
            self.splits.append(size)
            if block_pad:
                self.outs.append(None)
                self.splits.append(block_pad)
        self.staged = tuple(staged)
        # (asked once here: ``None in outs`` would compare every tensor with None, a torch call each)
        self.fresh = any(o is None for o in self.outs)
        self.agreed: _Agreed | None = agreed.agreed if agreed is not None else None
        self._agreed_inputs: dict[int, list[torch.Tensor] | str] | None = None  # the first unshard's (agree)

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered buffer at ``param_dtype`` (padding included; bytes: each parameter at its own
        dtype; a tensor-subclass unit's once agreed)."""
        if self.agreed is not None:
            return self.world * self.agreed.shard_units * self.agreed.dtype.itemsize
        if self.bytes is not None:
            return self.bytes.total_numel
        return self.flat.total_numel * self.param_dtype.itemsize

    # --- building ------------------------------------------------------------------------------------
    def _fusable(self) -> bool:
        """One ``torch._chunk_cat`` writes the segment where every piece is a non-empty ``Shard(0)`` shard on
        the device (or its padding) of one dtype: it flattens each in C++, so no view per parameter is made
        per unshard nor kept between them."""
        if _chunk_cat is None or not self.params:
            return False
        dtypes = set()
        pads: list[torch.Tensor | None] = []
        for p, d in zip(self.params, self.sharded):
            local = _local(d)
            if p.offload or p.shard_dim or p.layout.replicated or not p.local_numel or local.device != self.device:
                return False
            dtypes.add(local.dtype)
            pads.append(_shared_zeros(p.padding_numel, local.dtype, local.device) if p.padding_numel else None)
        if len(dtypes) > 1:
            return False
        self.pads = tuple(pads) if any(z is not None for z in pads) else None
        return True

    def _flattened(self) -> tuple[_Flattened, ...]:
        out = []
        block_pads = self.blocks.pieces[1::2] if self.blocks is not None else (0,) * len(self.params)
        as_bytes = self.bytes is not None
        for p, d, block_pad, gathered in zip(self.params, self.sharded, block_pads, self.dtypes):
            if p.extension is not None:
                continue
            local = _local(d)
            to_device = p.offload or local.device != self.device
            # (the cat casts each piece to the buffer's dtype; bytes: the pieces are cast first, then viewed)
            dtype, pad = (torch.uint8, p.padding_numel * gathered.itemsize) if as_bytes else (local.dtype,
                                                                                             p.padding_numel)
            out.append(_Flattened(d, p.shard_dim, to_device,
                                  _shared_zeros(pad, dtype, self.device) if pad else None,
                                  _shared_zeros(block_pad, dtype, self.device) if block_pad else None,
                                  gathered if as_bytes else None))
        return tuple(out)

    # --- copy-in -------------------------------------------------------------------------------------
    def copy_in(self) -> torch.Tensor:
        """Allocate the gathered buffer and write this rank's segment: one ``_chunk_cat``, else one cat of
        the flattened pieces (cast to ``param_dtype``; bytes: to each one's dtype, as ``uint8``), quantized
        (int8), or the subclass pieces."""
        if self.variant is GatherVariant.SUBCLASS:
            return self._copy_in_subclass()
        if self.variant is GatherVariant.QUANTIZED:
            assert self.blocks is not None
            out = allocate(self.alloc, self.world * self.blocks.packed_nbytes, torch.uint8, self.device)
            if self.flattened:
                segment = out.narrow(0, self.rank * self.blocks.packed_nbytes, self.blocks.packed_nbytes)
                quantize.pack(torch.cat(self._pieces()), self.blocks, segment)
            return out
        units = self.shard_units
        out = allocate(self.alloc, self.world * units, self.buffer_dtype, self.device)
        if not self.params:
            return out
        own = out.narrow(0, self.rank * units, units)
        if self.fused:
            pads = self.pads
            if pads is None:
                sources = list(map(_local, self.sharded))
            else:
                sources = [t for local, zeros in zip(map(_local, self.sharded), pads)
                           for t in ((local,) if zeros is None else (local, zeros))]
            _chunk_cat(sources, 0, 1, out=own.view(1, -1))  # type: ignore[misc]  # (fused: not None)
        else:
            torch.cat(self._pieces(), out=own)
        return out

    def _pieces(self) -> list[torch.Tensor]:
        """The flattened pieces of this rank's segment (their own dtype: the cat casts)."""
        parts = []
        for f in self.flattened:
            local = _local(f.sharded)
            flat = (local.movedim(f.shard_dim, 0) if f.shard_dim else local).reshape(-1)
            if f.to_device:
                flat = flat.to(self.device, non_blocking=True, copy=True)
            if f.cast is not None:  # bytes
                flat = flat.to(f.cast).view(torch.uint8)
            parts.append(flat)
            if f.pad is not None:
                parts.append(f.pad)
            if f.block_pad is not None:
                parts.append(f.block_pad)
        return parts

    def kept(self) -> torch.Tensor:
        """``reshard_after_forward=k``, at reshard: the block of the gathered buffer this rank keeps, segments
        ``[r * W/k, (r + 1) * W/k)`` for its rank ``r`` in the k-subgroup, rebuilt from the unsharded
        parameters (one cat; bytes: each part as ``uint8``)."""
        assert self.kept_over is not None
        world = self.world
        per = world // self.kept_over.world
        rows = slice(self.kept_over.rank * per, (self.kept_over.rank + 1) * per)
        as_bytes = self.bytes is not None
        parts = []
        for p, size in zip(self.params, self.flat.sizes):
            write = p.unsharded_write
            if p.layout.replicated:
                part = write.view(1, 1).expand(per, 1)
            elif not p.shard_dim:
                part = write.view(world, size)[rows]
            else:  # Shard(d > 0): the unsharded value in the communication layout, padded
                flat = write.view(p.unsharded_shape).movedim(p.shard_dim, 0).reshape(-1)
                part = F.pad(flat, (0, world * size - flat.numel())).view(world, size)[rows]
            parts.append(part.contiguous().view(torch.uint8) if as_bytes else part)
        return torch.cat(parts, dim=1).view(-1)

    def copy_in_kept(self, block: torch.Tensor) -> torch.Tensor:
        """Allocate the gathered buffer and write the kept ``block`` into this rank's k-subgroup segment."""
        assert self.kept_over is not None
        total = self.world * self.shard_units
        out = allocate(self.alloc, total, self.buffer_dtype, self.device)
        size = total // self.kept_over.world
        out.narrow(0, self.kept_over.rank * size, size).copy_(block)
        return out

    # --- copy-out ------------------------------------------------------------------------------------
    def copy_out(self, out: torch.Tensor) -> None:
        """Allocate the unsharded storages and write the gathered rows into them: one split (int8:
        dequantized first, into a ``(world, blocked_numel)`` buffer; tensor subclasses: then their
        post-hooks)."""
        for storage, nbytes in self.storages:
            if storage.size() != nbytes:
                storage.resize_(nbytes)
        for ext in self.extensions:
            ext.alloc()
        if self.variant is GatherVariant.SUBCLASS:
            self._copy_out_subclass(out)
            return
        if self.blocks is not None:
            blocks = self.blocks
            packed = out.view(-1, blocks.packed_nbytes)
            rows = quantize.dequantize(quantize.data_view(packed, blocks), quantize.scales_view(packed, blocks),
                                       blocks.block_size, self.param_dtype)
        else:
            rows = out.view(self.world, self.shard_units)
        outs = self.outs
        if self.fresh:  # a fresh buffer where the rows are not a storage (staged, block padding)
            outs = [o if o is not None else rows.new_empty((rows.shape[0], n)) for o, n in zip(outs, self.splits)]
        if outs:
            torch.split_with_sizes_copy(rows, self.splits, dim=1, out=outs)  # type: ignore[arg-type]
        as_bytes = self.bytes is not None
        for s in self.staged:
            staged = outs[s.index]
            assert staged is not None  # (filled above)
            _write_staged(s, staged.view(s.write.dtype) if as_bytes else staged)

    def free(self) -> None:
        """Reshard: free the unsharded storages (resized to 0; the tensors on them stay valid)."""
        for storage, _ in self.storages:
            storage.resize_(0)
        for ext in self.extensions:
            ext.free()

    # --- tensor subclasses ---------------------------------------------------------------------------
    def agree(self) -> bool:
        """A tensor-subclass unit's first unshard only: run the pre-hooks and check every rank's layout (a
        control collective, run on the compute stream, not inside the copy-in stream). True when it ran."""
        if self.agreed is not None:
            return False
        self._agreed_inputs = self._inputs()
        return True

    def _specs(self, p: ShardedParam, dtype: torch.dtype) -> tuple[InputSpec, ...]:
        if p.extension is not None:
            assert p.extension.specs is not None
            return p.extension.specs
        return (InputSpec((p.layout.padded_shard_numel,), dtype),)

    def _agree(self, inputs: dict[int, list[torch.Tensor] | str]) -> None:
        """First unshard: every rank checks every rank's pre-hook answers (the same verdict everywhere,
        raised on every rank), then fixes the layout and creates the gathered outputs."""
        exts = self.extensions
        mine = [e.answer(inputs[id(e)]) for e in exts]
        info = self.mesh_info
        every = collectives.all_gather_object(mine, info.shard_group) if info.shard_world > 1 else [mine]
        errors = [e.layout_error([answers[i] for answers in every]) for i, e in enumerate(exts)]
        verdict = next((err for err in errors if err), None)
        if info.replicate_group is not None and info.replicate_world > 1:  # HSDP: every replica decides alike
            verdict = next((v for v in collectives.all_gather_object(verdict, info.replicate_group) if v), None)
        if verdict is not None:
            raise ValueError(f"fully_shard unit {self.fqn or '<root>'!r}: {verdict}")
        for e, (_, _, specs) in zip(exts, mine):
            e.specs = specs
            e.init_outputs(self.device)
            e.free()
        specs = [s for p, dtype in zip(self.params, self.dtypes) for s in self._specs(p, dtype)]
        as_bytes = len({s.dtype for s in specs}) > 1
        split = tuple(s.nbytes if as_bytes else s.numel for s in specs)
        self.agreed = _Agreed(as_bytes, torch.uint8 if as_bytes else specs[0].dtype, split, sum(split))

    def _inputs(self) -> dict[int, list[torch.Tensor] | str]:
        first = self.agreed is None
        inputs: dict[int, list[torch.Tensor] | str] = {}
        for e, policy in zip(self.extensions, self.ext_policies):
            try:
                inputs[id(e)] = e.pre_all_gather(policy, self.device)
            except Exception as exc:
                if not first:
                    raise
                inputs[id(e)] = f"{type(exc).__name__}: {exc}"  # raised on every rank by _agree
        if first:
            self._agree(inputs)
        return inputs

    def _copy_in_subclass(self) -> torch.Tensor:
        """Plain shards cast to their ``param_dtype``, extension inputs from their pre-hooks (the first unshard's
        came from ``agree``), in one cat (as bytes where the dtypes differ)."""
        inputs, self._agreed_inputs = self._agreed_inputs or self._inputs(), None
        agreed = self.agreed
        assert agreed is not None
        out = allocate(self.alloc, self.world * agreed.shard_units, agreed.dtype, self.device)
        plain = iter(self.flattened)
        parts: list[torch.Tensor] = []
        for p, dtype in zip(self.params, self.dtypes):
            if p.extension is not None:
                ext_inputs = inputs[id(p.extension)]
                assert not isinstance(ext_inputs, str)
                p.extension.check_inputs(ext_inputs)
                pieces = [t.reshape(-1) for t in ext_inputs]
            else:
                f = next(plain)
                local = _local(f.sharded)
                flat = (local.movedim(f.shard_dim, 0) if f.shard_dim else local).reshape(-1)
                if f.to_device:
                    flat = flat.to(self.device, non_blocking=True, copy=True)
                pieces = [flat.to(dtype)] + ([f.pad.to(dtype)] if f.pad is not None else [])
            parts += [t.view(torch.uint8) for t in pieces] if agreed.as_bytes else pieces
        torch.cat(parts, out=out.narrow(0, self.rank * agreed.shard_units, agreed.shard_units))
        return out

    def _copy_out_subclass(self, out: torch.Tensor) -> None:
        """Split the gathered rows into the plain parameters' storages and the extension parameters'
        outputs (one split), then run the post-hooks."""
        agreed = self.agreed
        assert agreed is not None
        staged = {s.index: s for s in self.staged}  # (one slot per parameter: no block padding here)
        outs: list[torch.Tensor] = []
        fresh: list[tuple[_Staged, torch.Tensor]] = []
        for i, (p, target, dtype) in enumerate(zip(self.params, self.outs, self.dtypes)):
            if p.extension is not None:
                outs += p.extension.output_rows(agreed.as_bytes)
                continue
            if target is None:  # staged: a fresh buffer at its param_dtype, copied below
                s = staged[i]
                target = torch.empty(self.world, s.size, dtype=dtype, device=self.device)
                fresh.append((s, target))
            outs.append(target.view(torch.uint8) if agreed.as_bytes else target)
        torch.split_with_sizes_copy(out.view(self.world, agreed.shard_units), agreed.split, dim=1, out=outs)
        for s, rows in fresh:
            _write_staged(s, rows)
        for e, dtype in zip(self.extensions, self.ext_dtypes):
            e.post_all_gather(dtype)


def _write_staged(s: _Staged, rows: torch.Tensor) -> None:
    """Copy a staged parameter's gathered ``(world, size)`` rows into its storage."""
    if s.replicated:  # every rank's slot holds the same value: take rank 0's
        s.write.copy_(rows[0])
        return
    gathered = rows.reshape(-1)[:s.numel].view(s.shape)
    s.write.view(s.unsharded_shape).copy_(gathered.movedim(0, s.shard_dim) if s.shard_dim else gathered)
