"""auto_wrap and plan_wrap: units picked by a policy, shared parameters tied into one unit, the plan reported.

``auto_wrap`` puts modules that share a parameter into one unit, applies ``fully_shard`` bottom-up and
then to the root, and returns a ``WrapPlan`` listing each unit's size and what one all-gather of it
materializes. ``plan_wrap`` computes the same plan without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.api import fully_shard
from ..core.layout import DimZeroLayout
from ..core.policy import MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy
from ..core.state import get_state
from ..core.tree import join_fqn
from .policies import WrapPolicy, as_policy
from .strategy import strategy_kwargs

__all__ = ["ROOT", "UnitReport", "WrapPlan", "auto_wrap", "plan_wrap"]

ROOT = "<root>"


@dataclass(frozen=True)
class UnitReport:
    """One ``fully_shard`` unit: its modules and sizes (bytes at the original dtype unless noted)."""

    fqn: str  # "blocks.0", "blocks.0+blocks.1" for a multi-module unit, "<root>"
    modules: tuple[str, ...]
    num_params: int  # elements of the parameters this unit manages
    nbytes: int  # their unsharded bytes
    shard_nbytes: int  # what each rank keeps between uses (padded shard)
    gathered_nbytes: int  # one all-gather's output at param_dtype (padding included)
    reshard_after_forward: bool | int | None


@dataclass
class WrapPlan:
    """What ``auto_wrap``/``plan_wrap`` produced: the units, bottom-up then the root."""

    strategy: ShardingStrategy
    shard_world: int
    param_dtype: torch.dtype | None
    units: list[UnitReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # tie merges and other decisions

    @property
    def peak_gathered_nbytes(self) -> int:
        """The largest single unit's gathered buffer: with the next unit prefetched, about twice this
        (plus the root's) is held unsharded at once."""
        return max((u.gathered_nbytes for u in self.units), default=0)

    @property
    def all_gather_bytes_per_step(self) -> int:
        """All-gather output bytes of one forward+backward: twice for units resharded after forward
        (re-gathered in backward, within the k-rank subgroup for an int), once otherwise."""
        total = 0
        for u in self.units:
            raf = u.reshard_after_forward
            again = raf is True or (type(raf) is int and raf > 1)
            total += u.gathered_nbytes * (2 if again else 1)
        return total

    def table(self) -> str:
        head = (f"{'unit':<32} {'params':>12} {'bytes':>12} {'shard/rank':>12} {'gathered':>12}  "
                f"reshard_after_forward")
        lines = [f"WrapPlan: {self.strategy.name}, shard group of {self.shard_world}, "
                 f"param_dtype={self.param_dtype}", head, "-" * len(head)]
        for u in self.units:
            lines.append(f"{u.fqn[:32]:<32} {u.num_params:>12,} {u.nbytes:>12,} {u.shard_nbytes:>12,} "
                         f"{u.gathered_nbytes:>12,}  {u.reshard_after_forward}")
        lines.append(f"{len(self.units)} units; largest gathered {self.peak_gathered_nbytes:,} B; "
                     f"all-gather output per step {self.all_gather_bytes_per_step:,} B")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass
class _Unit:
    fqns: list[str]


def _select_units(model: nn.Module, policy: WrapPolicy, notes: list[str]) -> list[_Unit]:
    units: list[_Unit] = []
    seen: set[str] = set()
    for picked in policy.select(model):
        fqns = [f for f, _ in picked if f and f not in seen]
        seen.update(fqns)
        if fqns:
            units.append(_Unit(fqns))
    for unit in units:
        for f in unit.fqns:
            if get_state(model.get_submodule(f)) is not None:
                raise ValueError(f"auto_wrap: {f!r} was already passed to fully_shard. Fix: call auto_wrap on a "
                                 "model nobody sharded yet, or shard it by hand.")
    _resolve_ties(model, units, notes)
    return units


def _within(fqn: str, ancestor: str) -> bool:
    return ancestor == "" or fqn == ancestor or fqn.startswith(ancestor + ".")


def _unit_of(fqn: str, units: list[_Unit]) -> int | None:
    """The innermost unit whose modules contain ``fqn`` (None: only the root)."""
    best, depth = None, -1
    for i, unit in enumerate(units):
        for m in unit.fqns:
            if _within(fqn, m) and len(m) > depth:
                best, depth = i, len(m)
    return best


def _resolve_ties(model: nn.Module, units: list[_Unit], notes: list[str]) -> None:
    """Make every parameter held by modules of different units (tied weights) belong to one unit:
    merge the units (one ``fully_shard([a, b])`` call), dissolve an inner unit into the outer one, or
    pull a root-level holder (e.g. the embedding tied to a wrapped lm_head) into the unit."""
    holders: dict[int, tuple[str, list[str]]] = {}
    for mod_name, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is not None:
                fqn = join_fqn(mod_name, pname)
                holders.setdefault(id(p), (fqn, []))[1].append(mod_name)
    for _ in range(len(units) + len(holders) + 1):
        conflict = None
        for pfqn, mods in holders.values():
            owners = {_unit_of(m, units) for m in mods}
            if len(owners) > 1:
                conflict = (pfqn, mods, owners)
                break
        if conflict is None:
            return
        pfqn, mods, owners = conflict
        idxs = sorted(o for o in owners if o is not None)
        names = " & ".join("+".join(units[i].fqns) for i in idxs)
        if None in owners:
            loose = [m for m in mods if _unit_of(m, units) is None]
            target = units[idxs[0]]
            pullable = all(m != "" and not any(_within(f, m) for u in units for f in u.fqns) for m in loose)
            if pullable and len(idxs) == 1:
                target.fqns.extend(x for x in loose if x not in target.fqns)
                notes.append(f"tied parameter {pfqn!r}: moved {', '.join(loose)} into unit {names}")
            else:
                for i in sorted(idxs, reverse=True):
                    del units[i]
                notes.append(f"tied parameter {pfqn!r}: unit(s) {names} left to the root (a holder cannot "
                             "move into them)")
            continue
        a, b = idxs[0], idxs[1]
        nested_ab = any(_within(fb, fa) for fa in units[a].fqns for fb in units[b].fqns)
        nested_ba = any(_within(fa, fb) for fa in units[a].fqns for fb in units[b].fqns)
        if nested_ab or nested_ba:
            inner = b if nested_ab else a
            notes.append(f"tied parameter {pfqn!r}: unit {'+'.join(units[inner].fqns)} merged into the unit "
                         "around it")
            del units[inner]
        else:
            units[a].fqns.extend(units[b].fqns)
            del units[b]
            notes.append(f"tied parameter {pfqn!r}: units {names} merged into one")
    raise RuntimeError("auto_wrap: could not resolve tied parameters")  # unreachable: each step removes one


def _unit_params(model: nn.Module, units: list[_Unit], index: int | None,
                 ignored: set[int]) -> list[nn.Parameter]:
    """The parameters unit ``index`` (None: the root) will manage, each once."""
    roots = [model.get_submodule(f) for f in units[index].fqns] if index is not None else [model]
    root_fqns = units[index].fqns if index is not None else [""]
    out: dict[int, nn.Parameter] = {}
    for base, module in zip(root_fqns, roots):
        for name, sub in module.named_modules():
            full = f"{base}.{name}" if base and name else (base or name)
            if _unit_of(full, units) != index:  # inside a nested unit
                continue
            for p in sub._parameters.values():
                if p is not None and id(p) not in ignored:
                    out.setdefault(id(p), p)
    return list(out.values())


def _depth_order(units: list[_Unit]) -> list[int]:
    """Indices of units, deepest first (fully_shard children before parents)."""
    return sorted(range(len(units)), key=lambda i: -max(f.count(".") + 1 for f in units[i].fqns))


def _report(fqn: str, modules: tuple[str, ...], shapes_dtypes: list[tuple[tuple[int, ...], torch.dtype]],
            world: int, param_dtype: torch.dtype | None, raf: bool | int | None,
            gathered: int | None = None) -> UnitReport:
    layouts = [(DimZeroLayout(s, world), d) for s, d in shapes_dtypes]
    num = sum(lay.numel for lay, _ in layouts)
    nbytes = sum(lay.numel * d.itemsize for lay, d in layouts)
    shard = sum(lay.padded_shard_numel * d.itemsize for lay, d in layouts)
    if gathered is None:  # world segments of padded shards; a 0-dim param takes one slot per rank
        dtype = param_dtype or (shapes_dtypes[0][1] if shapes_dtypes else torch.float32)
        gathered = world * sum(lay.padded_shard_numel for lay, _ in layouts) * dtype.itemsize
    return UnitReport(fqn, modules, num, nbytes, shard, gathered, raf)


def _world_of(kwargs: dict[str, Any]) -> int:
    mesh: DeviceMesh = kwargs["mesh"]
    return mesh.size(mesh.ndim - 1)


# --- entry points ------------------------------------------------------------------------------------
def plan_wrap(model: nn.Module, policy: Any, *, shard_world: int,
              strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
              mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
              reshard_after_forward: bool | int | None = None,
              ignored_params: set[nn.Parameter] | None = None) -> WrapPlan:
    """The plan ``auto_wrap`` would apply, without sharding anything (no process group needed):
    compare granularities before choosing one. ``shard_world`` is the shard-group size (1 for
    NO_SHARD, the ranks per replica for HYBRID_SHARD)."""
    notes: list[str] = []
    units = _select_units(model, as_policy(policy), notes)
    ignored = {id(p) for p in ignored_params or ()}
    world = 1 if strategy is ShardingStrategy.NO_SHARD else shard_world
    unit_raf = reshard_after_forward if reshard_after_forward is not None else (
        strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD))
    plan = WrapPlan(strategy, world, mp_policy.param_dtype, notes=notes)
    for i in _depth_order(units):
        params = _unit_params(model, units, i, ignored)
        plan.units.append(_report("+".join(units[i].fqns), tuple(units[i].fqns),
                                  [(tuple(p.shape), p.dtype) for p in params], world, mp_policy.param_dtype,
                                  unit_raf))
    root_params = _unit_params(model, units, None, ignored)
    plan.units.append(_report(ROOT, ("",), [(tuple(p.shape), p.dtype) for p in root_params], world,
                              mp_policy.param_dtype, None))
    return plan


def auto_wrap(model: nn.Module, policy: Any, *, strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
              mesh: DeviceMesh | None = None, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
              offload_policy: OffloadPolicy = OffloadPolicy(),
              reshard_after_forward: bool | int | None = None,
              ignored_params: set[nn.Parameter] | None = None) -> WrapPlan:
    """Apply ``fully_shard`` to the units ``policy`` picks (bottom-up), then to ``model`` itself.

    ``policy``: a ``ModuleClassPolicy`` / ``ParamCountPolicy`` / ``PredicatePolicy`` /
    ``GranularityPolicy``, or for short a set of module classes or a predicate ``fn(fqn, module)``.
    ``strategy`` maps to ``mesh``/``reshard_after_forward`` as in ``strategy_kwargs``;
    ``reshard_after_forward`` (e.g. an int k for partial reshard) overrides the strategy's for the
    non-root units. Returns the applied ``WrapPlan`` (``print(plan)`` shows the table).
    """
    notes: list[str] = []
    units = _select_units(model, as_policy(policy), notes)
    kwargs = strategy_kwargs(strategy, mesh=mesh)
    unit_raf = reshard_after_forward if reshard_after_forward is not None else kwargs["reshard_after_forward"]
    common = {"mesh": kwargs["mesh"], "mp_policy": mp_policy, "offload_policy": offload_policy,
              "ignored_params": ignored_params}
    plan = WrapPlan(strategy, _world_of(kwargs), mp_policy.param_dtype, notes=notes)
    for i in _depth_order(units):
        modules = [model.get_submodule(f) for f in units[i].fqns]
        if len(modules) > 1:
            fully_shard(modules, reshard_after_forward=unit_raf, **common)
        else:
            fully_shard(modules[0], reshard_after_forward=unit_raf, **common)
        plan.units.append(_applied_report("+".join(units[i].fqns), tuple(units[i].fqns), modules[0], unit_raf))
    fully_shard(model, reshard_after_forward=None, **common)
    plan.units.append(_applied_report(ROOT, ("",), model, None))
    return plan


def _applied_report(fqn: str, modules: tuple[str, ...], module: nn.Module, raf: bool | int | None) -> UnitReport:
    state = get_state(module)
    assert state is not None
    if not state.groups:
        return UnitReport(fqn, modules, 0, 0, 0, 0, raf)
    group = state.groups[0]  # auto_wrap's units are on one mesh: one group
    shapes = [(p.unsharded_shape, p.orig_dtype) for p in group.params]  # what is gathered (TP: local)
    return _report(fqn, modules, shapes, group.mesh_info.shard_world, group.mp_policy.param_dtype, raf,
                   gathered=group.unsharded_nbytes)
