"""One unit's all-gather when it holds tensor-subclass parameters: the segment's pieces, one collective, the checks.

See design/tensor-subclass-extension.md; the per-parameter hooks are extension.py's ``Extension``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import collectives
from .extension import InputSpec
from .param import ShardedParam
from .policy import MixedPrecisionPolicy

__all__ = ["GatherPlan", "param_dtype_for"]


def param_dtype_for(param: ShardedParam) -> torch.dtype:
    """The ``param_dtype`` the post-hook gets: the unit policy's for a floating-point parameter
    (``param_dtype_override_fn`` applied), else its own (torch's rule)."""
    orig = param.orig_dtype
    return param.param_dtype if param.param_dtype is not None and orig.is_floating_point else orig


class GatherPlan:
    """One unit's all-gather when it holds extension parameters: the pieces of one rank's segment in
    order (a plain parameter's padded shard at ``param_dtype``, then each input of an extension
    parameter), gathered in one collective; in ``uint8`` bytes when the pieces' dtypes differ (as torch).

    The layout is fixed at the unit's first unshard, which every rank reaches in the same order: the
    pre-hooks' answers are exchanged there (one control collective) and checked by every rank alike."""

    def __init__(self, group: Any, exchange: Any) -> None:
        self.group = group
        self.params: list[ShardedParam] = group.params
        self.mp_policy: MixedPrecisionPolicy = group.mp_policy
        self.param_dtype: torch.dtype = group.param_dtype
        self._index = {id(p): i for i, p in enumerate(self.params)}  # a plain parameter's dtype: group.dtypes[i]
        self.device: torch.device = group.device
        self.world: int = group.mesh_info.shard_world
        self.exchange = exchange  # exchange(obj, process_group) -> every rank's obj (collectives.all_gather_object)
        self.as_bytes = False
        self.dtype = self.param_dtype
        self.split: list[int] | None = None  # elements (or bytes) of each piece; None until the first unshard
        self._agreed_inputs: dict[int, list[torch.Tensor] | str] | None = None  # the first unshard's, from agree()
        self.shard_units = 0  # elements (or bytes) of one rank's segment

    @classmethod
    def of(cls, group: Any, exchange: Any) -> GatherPlan | None:
        """Lazy init of ``group``: None without extension parameters."""
        exts = [p.extension for p in group.params if p.extension is not None]
        if not exts:
            return None
        if group.blocks is not None or group.subgroup is not None:
            what = "QuantizedAllGather" if group.blocks is not None else "reshard_after_forward=k (k-rank subgroups)"
            raise NotImplementedError(
                f"fully_shard unit {group.fqn or '<root>'!r}: {what} cannot be combined with the tensor-subclass "
                f"all-gather extension of {exts[0].param.fqn} ({exts[0].type_name}); the subclass decides what "
                "is gathered. Fix: shard that parameter in a fully_shard call without it.")
        return cls(group, exchange)

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered buffer (every rank's segment)."""
        return self.world * self.shard_units * self.dtype.itemsize

    def _specs(self, p: ShardedParam) -> tuple[InputSpec, ...]:
        if p.extension is not None:
            assert p.extension.specs is not None
            return p.extension.specs
        return (InputSpec((p.layout.padded_shard_numel,), self._dtype(p)),)

    def _dtype(self, p: ShardedParam) -> torch.dtype:
        """A plain parameter's all-gather dtype (its ``param_dtype``, per parameter with
        ``param_dtype_override_fn``)."""
        return self.group.dtypes[self._index[id(p)]]  # type: ignore[no-any-return]

    def _agree(self, inputs: dict[int, list[torch.Tensor] | str]) -> None:
        """First unshard: every rank checks every rank's pre-hook answers (the same verdict everywhere,
        raised on every rank), then fixes the layout and creates the gathered outputs."""
        exts = [p.extension for p in self.params if p.extension is not None]
        mine = [e.answer(inputs[id(e)]) for e in exts]
        info = self.group.mesh_info
        every = self.exchange(mine, info.shard_group) if info.shard_world > 1 else [mine]
        errors = [e.layout_error([answers[i] for answers in every]) for i, e in enumerate(exts)]
        verdict = next((err for err in errors if err), None)
        if info.replicate_group is not None and info.replicate_world > 1:  # HSDP: every replica decides alike
            verdict = next((v for v in self.exchange(verdict, info.replicate_group) if v), None)
        if verdict is not None:
            raise ValueError(f"fully_shard unit {self.group.fqn or '<root>'!r}: {verdict}")
        for e, (_, _, specs) in zip(exts, mine):
            e.specs = specs
            e.init_outputs(self.device)
            e.free()
        specs = [s for p in self.params for s in self._specs(p)]
        self.as_bytes = len({s.dtype for s in specs}) > 1
        self.dtype = torch.uint8 if self.as_bytes else specs[0].dtype
        self.split = [s.nbytes if self.as_bytes else s.numel for s in specs]
        self.shard_units = sum(self.split)

    def _inputs(self) -> dict[int, list[torch.Tensor] | str]:
        first = self.split is None
        inputs: dict[int, list[torch.Tensor] | str] = {}
        for p in self.params:
            if p.extension is None:
                continue
            try:
                policy = self.mp_policy.with_param_dtype(p.param_dtype)  # torch 2.15: the parameter's own policy
                inputs[id(p.extension)] = p.extension.pre_all_gather(policy, self.device)
            except Exception as exc:
                if not first:
                    raise
                inputs[id(p.extension)] = f"{type(exc).__name__}: {exc}"  # raised on every rank by _agree
        if first:
            self._agree(inputs)
        return inputs

    def agree(self) -> bool:
        """First unshard only: run the pre-hooks and check every rank's layout (a control collective,
        which the caller runs on the compute stream, not inside the copy-in stream). True when it ran."""
        if self.split is not None:
            return False
        self._agreed_inputs = self._inputs()
        return True

    def copy_in(self, rank: int, *, alloc: Any = None) -> torch.Tensor:
        """Allocate the gathered buffer (``alloc``: a custom comm's ``allocate``) and write this rank's
        pieces into its segment: plain shards cast to ``param_dtype``, extension inputs from their
        pre-hooks (the first unshard's came from ``agree``)."""
        inputs, self._agreed_inputs = self._agreed_inputs or self._inputs(), None
        out = collectives.allocate(alloc, self.world * self.shard_units, self.dtype, self.device)
        parts: list[torch.Tensor] = []
        for p in self.params:
            if p.extension is not None:
                ext_inputs = inputs[id(p.extension)]
                assert not isinstance(ext_inputs, str)
                p.extension.check_inputs(ext_inputs)
                pieces = [t.reshape(-1) for t in ext_inputs]
            else:
                pieces = [t.to(self._dtype(p)) for t in p.copy_in_parts(self.device)]
            parts += [t.view(torch.uint8) for t in pieces] if self.as_bytes else pieces
        torch.cat(parts, out=out.narrow(0, rank * self.shard_units, self.shard_units))
        return out

    def copy_out(self, out: torch.Tensor) -> None:
        """Split the gathered rows into the plain parameters' unsharded storages and the extension
        parameters' outputs (one split), then run the post-hooks."""
        outs: list[torch.Tensor] = []
        staged: list[tuple[ShardedParam, torch.Tensor]] = []
        for p in self.params:
            if p.extension is not None:
                outs += p.extension.output_rows(self.as_bytes)
                continue
            size = p.layout.padded_shard_numel
            if p.staged_gather:  # 0-dim: one slot per rank, copied once more (ShardedParam.write_unsharded)
                staged.append((p, torch.empty(self.world, size, dtype=self._dtype(p), device=self.device)))
                dst = staged[-1][1]
            else:
                dst = p.unsharded_write.view(self.world, size)
            outs.append(dst.view(torch.uint8) if self.as_bytes else dst)
        assert self.split is not None
        torch.split_with_sizes_copy(out.view(self.world, self.shard_units), self.split, dim=1, out=outs)
        for p, rows in staged:
            p.write_unsharded(rows)
        for p in self.params:
            if p.extension is not None:
                p.extension.post_all_gather(param_dtype_for(p))
