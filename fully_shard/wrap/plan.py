"""FSDP1-style front end: ShardingStrategy -> fully_shard arguments, and auto_wrap with a wrap plan.

See design/hsdp-and-partial-reshard.md for the strategy mapping. ``auto_wrap`` picks the units with a
policy (module class, parameter count, predicate, or *granularity*: k consecutive blocks per unit),
puts modules that share a parameter into one unit, applies ``fully_shard`` bottom-up and then to the
root, and returns a ``WrapPlan`` listing each unit's size and what one all-gather of it materializes
(the memory/communication knob the founding note describes). ``plan_wrap`` computes the same plan
without touching the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.api import fully_shard
from ..core.layout import DimZeroLayout
from ..core.policy import MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy
from ..core.state import get_state
from ..core.tree import join_fqn
from ..parallel.mesh import default_mesh, replicate_mesh

__all__ = [
    "GranularityPolicy",
    "ModuleClassPolicy",
    "ParamCountPolicy",
    "PredicatePolicy",
    "UnitReport",
    "WrapPlan",
    "WrapPolicy",
    "auto_wrap",
    "plan_wrap",
    "strategy_kwargs",
]

ROOT = "<root>"


# --- strategies ------------------------------------------------------------------------------------
def strategy_kwargs(strategy: ShardingStrategy, *, mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """The ``fully_shard`` keyword arguments (``mesh``, ``reshard_after_forward``) of a non-root unit
    under an FSDP1/DeepSpeed ``ShardingStrategy``:

    ===============  ===============================  =====================  ==========================
    strategy         mesh                             reshard_after_forward  collectives per unit, step
    ===============  ===============================  =====================  ==========================
    FULL_SHARD       1-D (W,)                         True                   AG fwd + AG bwd + RS
    SHARD_GRAD_OP    1-D (W,)                         False                  AG fwd + RS
    NO_SHARD         2-D (W, 1) replicate x shard     False                  AR (AG/RS over 1 rank)
    HYBRID_SHARD     2-D (R, S) replicate x shard     True                   AG, AG (S) + RS (S) + AR (R)
    ===============  ===============================  =====================  ==========================

    The root unit always keeps its parameters from forward to backward (it runs first in backward);
    ``auto_wrap`` passes ``reshard_after_forward=None`` for it. Raises ``ValueError`` when ``mesh``
    does not fit the strategy.
    """
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"strategy must be a ShardingStrategy, got {strategy!r}. Fix: e.g. "
                        "strategy=ShardingStrategy.FULL_SHARD.")
    name = f"ShardingStrategy.{strategy.name}"
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if mesh is None or mesh.ndim != 2:
            found = "no mesh" if mesh is None else f"a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
            raise ValueError(
                f"{name} needs a 2-D mesh ('replicate', 'shard'), got {found}. Fix: mesh=init_device_mesh("
                "device, (num_nodes, gpus_per_node), mesh_dim_names=('replicate', 'shard')).")
        _check_covers_world(mesh, name)
        replicas, shards = mesh.size(0), mesh.size(1)
        if replicas == 1 or shards == 1:
            same = "FULL_SHARD" if replicas == 1 else "NO_SHARD"
            raise ValueError(
                f"{name} on a mesh of shape ({replicas}, {shards}) is really {same}: one of its dimensions "
                f"has size 1. Fix: use ShardingStrategy.{same}, or a mesh with more than one replica and "
                "more than one shard, e.g. (num_nodes, gpus_per_node).")
        return {"mesh": mesh, "reshard_after_forward": True}
    if strategy is ShardingStrategy.NO_SHARD:
        return {"mesh": _replicate_mesh(mesh, name), "reshard_after_forward": False}
    if mesh is None:
        mesh = default_mesh()
    if mesh.ndim != 1:
        raise ValueError(
            f"{name} shards over a 1-D mesh, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Fix: use "
            "ShardingStrategy.HYBRID_SHARD for a ('replicate', 'shard') mesh, or pass a 1-D mesh.")
    _check_covers_world(mesh, name)
    return {"mesh": mesh, "reshard_after_forward": strategy is ShardingStrategy.FULL_SHARD}


def _replicate_mesh(mesh: DeviceMesh | None, name: str) -> DeviceMesh:
    """NO_SHARD: the (W, 1) ('replicate', 'shard') mesh over the ranks of ``mesh`` (default: world).

    A shard group of one rank keeps every parameter whole; the HSDP all-reduce across the W replicas
    is then exactly DDP's gradient all-reduce.
    """
    if mesh is not None and mesh.ndim == 2:
        if mesh.size(1) != 1:
            raise ValueError(
                f"{name} replicates parameters, but the mesh of shape {tuple(mesh.shape)} shards them over "
                f"{mesh.size(1)} ranks. Fix: pass a 1-D mesh (or a (W, 1) mesh), or use "
                "ShardingStrategy.HYBRID_SHARD for this mesh.")
        _check_covers_world(mesh, name)
        return mesh
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(f"{name} expects a 1-D mesh (or a (W, 1) mesh), got shape {tuple(mesh.shape)}.")
    base = mesh if mesh is not None else default_mesh()
    _check_covers_world(base, name)
    return replicate_mesh(base)  # creating a mesh creates process groups: once per rank set


def _check_covers_world(mesh: DeviceMesh, name: str) -> None:
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"{name} runs data parallel over every rank, but the mesh of shape {tuple(mesh.shape)} has "
            f"{mesh.size()} ranks and the world has {world}. Fix: build the mesh over the whole world, "
            f"e.g. init_device_mesh(device, ({world},)), or call fully_shard(mesh=...) directly for a "
            "sub-mesh (e.g. next to tensor parallelism).")


# --- policies ----------------------------------------------------------------------------------
class WrapPolicy(Protocol):
    """Picks the units: lists of (FQN, module), each list becoming one ``fully_shard`` call."""

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]: ...


@dataclass(frozen=True)
class ModuleClassPolicy:
    """Every module that is an instance of one of ``classes`` is its own unit (FSDP1's
    ``transformer_auto_wrap_policy``); e.g. ``ModuleClassPolicy({TransformerBlock})``."""

    classes: frozenset[type]

    def __init__(self, classes: Iterable[type]) -> None:
        classes = frozenset(classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise TypeError(f"ModuleClassPolicy expects nn.Module subclasses, got {sorted(map(repr, classes))}. "
                            "Fix: pass the block class itself, e.g. ModuleClassPolicy({LlamaDecoderLayer}).")
        object.__setattr__(self, "classes", classes)

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        classes = tuple(self.classes)
        found: list[list[tuple[str, nn.Module]]] = [
            [(n, m)] for n, m in model.named_modules() if n and _is_instance(m, classes)]
        _reject_containers(found, "ModuleClassPolicy")
        return found


@dataclass(frozen=True)
class PredicatePolicy:
    """Every module (except the root) for which ``fn(fqn, module)`` is true is its own unit."""

    fn: Callable[[str, nn.Module], bool]

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        found = [[(n, m)] for n, m in model.named_modules() if n and self.fn(n, m)]
        _reject_containers(found, "PredicatePolicy")
        return found


@dataclass(frozen=True)
class ParamCountPolicy:
    """FSDP1's ``size_based_auto_wrap_policy``: bottom-up, a module becomes a unit once the parameters
    under it that no unit below took reach ``min_params`` elements. Containers without a forward
    (ModuleList, ModuleDict) are never units: their parameters count towards the parent."""

    min_params: int

    def __post_init__(self) -> None:
        if not isinstance(self.min_params, int) or self.min_params < 1:
            raise ValueError(f"ParamCountPolicy(min_params=...) must be a positive int, got {self.min_params!r}. "
                             "Fix: e.g. ParamCountPolicy(min_params=100_000_000) for ~100M-element units.")

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        found: list[list[tuple[str, nn.Module]]] = []
        taken: set[int] = set()

        def visit(prefix: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                visit(join_fqn(prefix, name), child)
            if not prefix or not _has_forward(module):
                return
            fresh = [p for p in module.parameters() if id(p) not in taken]
            if sum(p.numel() for p in fresh) >= self.min_params:
                found.append([(prefix, module)])
                taken.update(id(p) for p in fresh)

        visit("", model)
        return found


@dataclass(frozen=True)
class GranularityPolicy:
    """Group ``blocks_per_unit`` consecutive blocks into one unit (``fully_shard([blk_i, ...])``):
    1 = one unit per block (lowest peak memory, most all-gathers), ``"all"`` = one unit for all blocks
    (fewest, largest all-gathers). The blocks are the modules of ``block_classes`` in forward order, or
    by default the children of the largest ``ModuleList``/``Sequential`` of same-class modules."""

    blocks_per_unit: int | Literal["all"] = 1
    block_classes: frozenset[type] | None = None

    def __post_init__(self) -> None:
        k = self.blocks_per_unit
        if k != "all" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"GranularityPolicy(blocks_per_unit=...) must be an int >= 1 or 'all', got {k!r}.")
        if self.block_classes is not None:
            object.__setattr__(self, "block_classes", frozenset(self.block_classes))

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        if self.block_classes is not None:
            classes = tuple(self.block_classes)
            found: list[tuple[str, nn.Module]] = []
            for name, m in model.named_modules():
                if name and _is_instance(m, classes) and not any(name.startswith(f + ".") for f, _ in found):
                    found.append((name, m))
            if not found:
                raise ValueError(f"GranularityPolicy: no module of {sorted(c.__name__ for c in classes)} in "
                                 f"{type(model).__name__}. Fix: pass the block class the model uses.")
            return found
        best: tuple[int, str, nn.Module] | None = None
        for name, m in model.named_modules():
            if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) == 0:
                continue
            kinds = {type(c) for c in m}
            if len(kinds) != 1 or not _has_forward(next(iter(m))):
                continue
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[0]:
                best = (size, name, m)
        if best is None:
            raise ValueError(f"GranularityPolicy: {type(model).__name__} has no ModuleList/Sequential of "
                             "same-class modules to group. Fix: pass block_classes={YourBlock}.")
        _, prefix, container = best
        return [(join_fqn(prefix, str(i)), m) for i, m in enumerate(container.children())]

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        blocks = self.blocks(model)
        k = len(blocks) if self.blocks_per_unit == "all" else int(self.blocks_per_unit)
        return [blocks[i:i + k] for i in range(0, len(blocks), k)]


def _is_instance(module: nn.Module, classes: tuple[type, ...]) -> bool:
    return isinstance(module, classes)


def _has_forward(module: nn.Module) -> bool:
    return getattr(type(module), "forward", None) is not nn.Module.forward


def _reject_containers(units: list[list[tuple[str, nn.Module]]], policy: str) -> None:
    for unit in units:
        for name, m in unit:
            if not _has_forward(m):
                raise ValueError(
                    f"{policy} picked {name!r}, a {type(m).__name__} without forward(): fully_shard's hooks "
                    "run on forward, so its parameters would never be gathered. Fix: pick its children, "
                    "or use GranularityPolicy to group them.")


def _as_policy(policy: Any) -> WrapPolicy:
    if hasattr(policy, "select"):
        return policy  # type: ignore[no-any-return]
    if isinstance(policy, (set, frozenset, list, tuple)) and all(isinstance(c, type) for c in policy):
        return ModuleClassPolicy(policy)
    if callable(policy):
        return PredicatePolicy(policy)
    raise TypeError(f"auto_wrap policy must be a WrapPolicy, a set of module classes or a predicate "
                    f"fn(fqn, module) -> bool, got {policy!r}. Fix: e.g. ModuleClassPolicy({{Block}}).")


# --- plan ----------------------------------------------------------------------------------------
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
    units = _select_units(model, _as_policy(policy), notes)
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
    units = _select_units(model, _as_policy(policy), notes)
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
    group = state.group
    if group is None:
        return UnitReport(fqn, modules, 0, 0, 0, 0, raf)
    shapes = [(p.unsharded_shape, p.orig_dtype) for p in group.params]  # what is gathered (TP: local)
    return _report(fqn, modules, shapes, group.mesh_info.shard_world, group.mp_policy.param_dtype, raf,
                   gathered=group.unsharded_nbytes)

