"""Distributed Muon over fully_shard's ``Shard(0)`` DTensor parameters, equal to torch.optim.Muon on the whole model.

``Muon(params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)`` takes
torch's constructor. Per step and matrix it runs torch 2.13's code: ``buf.lerp_(g, 1 - momentum)``, the
Nesterov blend ``g.lerp(buf, momentum)``, Newton-Schulz in bf16 on the *whole* matrix, ``p *= 1 - lr*wd``,
``p -= adjusted_lr * O`` with the lr adjusted from the global shape. Momentum stays sharded (a DTensor
state with the parameter's placements); only the bf16 Newton-Schulz input and output move:
``comm="owner"`` (default) sends each matrix's rows to one owner rank with an all-to-all per bucket and
back (fully_shard/optim/muon_plan.py assigns owners; fully_shard/comm/exchange.py does every
collective), ``comm="gather"`` gathers every matrix on every rank. Param groups with
``algorithm="adamw"`` step torch's AdamW math on the local shards, so ``muon_param_groups(model)`` gives
one optimizer, one ``step()`` and one state dict for a whole transformer. See design/muon.md.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer
from torch.optim.adam import adam

from ..comm.exchange import ExchangeStats, PendingRows, all_gather_rows, all_to_all_rows, check_same_plan
from .muon_plan import MatrixSpec, OwnerPlan, ns_cost, plan_owners

__all__ = ["Muon", "muon_param_groups"]

# torch.optim._muon's defaults (Keller Jordan's coefficients)
EPS = 1e-7
DEFAULT_A, DEFAULT_B, DEFAULT_C = 3.4445, -4.7750, 2.0315
DEFAULT_NS_STEPS = 5
# torch.optim.AdamW's defaults, for param groups with algorithm="adamw" that do not set a key
ADAMW_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False,
    "foreach": None,
}
Routing = Literal["owner", "gather"]  # the comm= argument


# --- torch 2.13's Muon math, followed exactly ---------------------------------------------------------
def zeropower_via_newtonschulz(grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                               eps: float) -> Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz: bf16 quintic Newton-Schulz on a 2-D matrix."""
    a, b, c = ns_coefficients
    ortho_grad = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim._muon._adjust_lr on the matrix's *global* shape ``(A, B)``."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    else:
        ratio = 1.0
    return lr * ratio


def _scalar_dtype() -> torch.dtype:
    """torch.optim.optimizer._get_scalar_dtype() for a non-fused group: the dtype of Adam's ``step``."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# --- one matrix of a step ---------------------------------------------------------------------------
@dataclass(eq=False)
class _Item:
    """A Muon parameter with a gradient this step: its local rows and their Nesterov/momentum update."""

    param: Tensor
    name: str
    group: dict[str, Any]
    local: Tensor  # the parameter's local rows (a view: updated in place)
    update: Tensor  # the Newton-Schulz input's local rows (momentum or Nesterov blend)
    pg: dist.ProcessGroup | None  # shard group for an exchanged matrix; None: orthogonalized locally
    blocks: int

    def lr_shape(self) -> tuple[int, int]:
        shape = tuple(self.param.shape)
        if len(shape) == 3:
            return shape[1], shape[2]  # per expert
        return shape[0] // self.blocks, shape[1]

    def spec(self) -> MatrixSpec:
        return MatrixSpec(self.name, int(self.param.shape[0]), int(self.param.shape[1]), self.blocks)


def _orthogonalize(x: Tensor, group: dict[str, Any], blocks: int) -> Tensor:
    """Newton-Schulz on a whole matrix (2-D), per row block (``blocks`` > 1) or per matrix of a stack (3-D).

    Stacks and blocks run torch's 2-D function matrix by matrix: a batched ``baddbmm`` version differs from
    it by one bf16 ulp on some inputs (design/muon.md), and equality with torch is the contract."""
    coeffs, steps, eps = tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"]
    if x.ndim == 2 and blocks > 1:
        return _orthogonalize(x.reshape(blocks, x.shape[0] // blocks, x.shape[1]), group, 1).reshape(x.shape)
    if x.ndim == 3:
        if x.shape[0] == 0:
            return x.bfloat16()
        return torch.stack([zeropower_via_newtonschulz(m, coeffs, steps, eps) for m in x])  # type: ignore[arg-type]
    return zeropower_via_newtonschulz(x, coeffs, steps, eps)  # type: ignore[arg-type]


class Muon(Optimizer):
    """Muon for fully_shard's sharded matrices (and AdamW for the groups marked ``algorithm="adamw"``).

    Takes ``torch.optim.Muon``'s arguments (same defaults); keyword-only: ``comm`` (``"owner"``: rows to an
    owner rank by all-to-all, about ``2/W`` of the matrices per rank; ``"gather"``: every rank gathers and
    orthogonalizes every matrix) and ``per_bucket`` (matrices per owner per all-to-all). Muon groups accept
    2-D matrices (``Shard(0)`` DTensors over one mesh dim, HSDP's ``(Replicate(), Shard(0))``, replicated
    DTensors or plain tensors) and 3-D expert stacks ``[E, m, n]`` (sharded over ``E``: each rank
    orthogonalizes its own experts, no traffic); a group key ``ns_blocks=h`` orthogonalizes each of ``h``
    row blocks separately (per-head). ``comm_stats`` counts the last step's collectives and bytes,
    ``ns_work`` the Newton-Schulz cost this rank ran (muon_plan.ns_cost units).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        comm: Routing = "owner",
        per_bucket: int = 1,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError(f"Muon: expected a 1-element tensor lr, found {lr.numel()} elements. Fix: pass a float.")
        if not lr >= 0.0:
            raise ValueError(f"Muon: expected lr >= 0, found lr={lr}. Fix: pass a non-negative learning rate.")
        if not momentum >= 0.0:
            raise ValueError(f"Muon: expected momentum >= 0, found momentum={momentum}.")
        if not weight_decay >= 0.0:
            raise ValueError(f"Muon: expected weight_decay >= 0, found weight_decay={weight_decay}.")
        if ns_steps >= 100:
            raise ValueError(f"Muon: expected ns_steps < 100, found ns_steps={ns_steps} (torch's limit).")
        if len(ns_coefficients) != 3:
            raise ValueError(f"Muon: expected 3 ns_coefficients (a, b, c), found {ns_coefficients!r}.")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Muon: expected adjust_lr_fn None, 'original' or 'match_rms_adamw', found "
                             f"{adjust_lr_fn!r}.")
        if comm not in ("owner", "gather"):
            raise ValueError(f"Muon: expected comm='owner' or comm='gather', found comm={comm!r}.")
        if per_bucket < 1:
            raise ValueError(f"Muon: expected per_bucket >= 1, found per_bucket={per_bucket}.")
        self.comm: Routing = comm
        self.per_bucket = per_bucket
        self.comm_stats = ExchangeStats()
        self.ns_work = 0
        self._plans: dict[tuple[Any, ...], OwnerPlan] = {}
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
            "algorithm": "muon", "ns_blocks": 1,
        }
        super().__init__(params, defaults)

    # --- groups ------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.get("algorithm", "muon")
        if algorithm not in ("muon", "adamw"):
            raise ValueError(f"Muon: expected a param group's algorithm 'muon' or 'adamw', found {algorithm!r}. "
                             "Fix: build the groups with fully_shard.optim.muon_param_groups(model).")
        if algorithm == "adamw":
            for key, value in ADAMW_DEFAULTS.items():
                param_group.setdefault(key, value)
            param_group.setdefault("decoupled_weight_decay", True)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if algorithm == "muon":
            for i, p in enumerate(group["params"]):
                self._kind(p, self._name(group, i), group)  # refuses what Muon cannot step, naming it

    def _kind(self, p: Tensor, name: str, group: dict[str, Any]) -> dist.ProcessGroup | None:
        """The shard group whose ranks exchange ``p``'s rows, or None when it is orthogonalized locally."""
        blocks = group.get("ns_blocks", 1)
        if p.ndim not in (2, 3):
            raise ValueError(
                f"Muon: parameter {name!r} has shape {tuple(p.shape)}; expected a 2-D matrix or a 3-D stack of "
                "experts [E, m, n]. Fix: optimize it with AdamW: Muon(muon_param_groups(model)) routes 0/1-D "
                "parameters, embeddings and the output head there (or put it in a group with algorithm='adamw').")
        if torch.is_complex(p):
            raise ValueError(f"Muon: parameter {name!r} is complex ({p.dtype}); expected a real matrix.")
        if p.ndim == 2 and (blocks < 1 or p.shape[0] % blocks):
            raise ValueError(f"Muon: parameter {name!r} has {p.shape[0]} rows, not divisible by ns_blocks={blocks}. "
                             "Fix: set ns_blocks to a divisor of the rows (the number of heads).")
        if p.ndim == 3 and blocks != 1:
            raise ValueError(f"Muon: parameter {name!r} is a 3-D stack; expected ns_blocks=1, found {blocks}.")
        if not isinstance(p, DTensor):
            return None  # a plain (replicated) matrix: every rank orthogonalizes it, as torch would
        mesh, placements = p.device_mesh, tuple(p.placements)
        dim_names = tuple(mesh.mesh_dim_names or ())
        sharded = [(d, pl) for d, pl in enumerate(placements) if not isinstance(pl, Replicate)]
        if p.ndim == 3 and all(getattr(pl, "dim", None) == 0 for _, pl in sharded):
            return None  # experts split over E only (EP and/or FSDP): each rank holds whole experts
        if "ep" in dim_names:
            raise ValueError(
                f"Muon: expert parameter {name!r} (shape {tuple(p.shape)}) has placements {placements} on "
                f"{dim_names}; expected every sharded mesh dim to split the experts (dim 0), so that each rank "
                "holds whole [m, n] matrices. Fix: shard experts with Shard(0) (efsdp x ep <= E), or route the "
                "parameter to AdamW (algorithm='adamw').")
        if not sharded:
            return None
        if len(sharded) != 1 or type(sharded[0][1]) is not Shard or sharded[0][1].dim != 0:
            raise ValueError(
                f"Muon: parameter {name!r} (shape {tuple(p.shape)}) has placements {placements} on mesh dims "
                f"{dim_names or mesh.shape}; expected Shard(0) over one mesh dim (fully_shard), optionally with "
                "Replicate() dims (HSDP). Tensor-parallel (2-D sharded) matrices are not supported. Fix: shard "
                "the module with fully_shard only, or route the parameter to AdamW (algorithm='adamw').")
        group_pg = mesh.get_group(sharded[0][0])
        if dist.get_world_size(group_pg) == 1:
            return None  # one rank: Newton-Schulz on the local rows
        return group_pg

    # --- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of every group: AdamW groups on their local shards, then the Muon matrices."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.comm_stats.clear()
        self.ns_work = 0
        items: list[_Item] = []
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw(group)
            else:
                items.extend(self._momentum(group))
        by_pg: dict[Any, list[_Item]] = {}
        for item in items:
            if item.pg is None:
                out = _orthogonalize(item.update, item.group, item.blocks)
                self.ns_work += ns_cost(item.spec()) if item.update.ndim == 2 else sum(
                    ns_cost(MatrixSpec(item.name, *m.shape)) for m in item.update)
                self._apply(item, out)
            else:
                by_pg.setdefault(item.pg, []).append(item)
        for pg, members in by_pg.items():
            self._exchange(pg, members)
        return loss

    def _momentum(self, group: dict[str, Any]) -> list[_Item]:
        momentum, nesterov = group["momentum"], group["nesterov"]
        items = []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            name = self._name(group, i)
            grad = p.grad
            if grad.is_sparse:
                raise RuntimeError(f"Muon: parameter {name!r} has a sparse gradient; expected a dense one.")
            if isinstance(p, DTensor) != isinstance(grad, DTensor) or (
                    isinstance(p, DTensor) and tuple(grad.placements) != tuple(p.placements)):
                raise RuntimeError(
                    f"Muon: parameter {name!r} has placements {getattr(p, 'placements', 'none (plain tensor)')} "
                    f"but its gradient {getattr(grad, 'placements', 'none (plain tensor)')}; expected the same. "
                    "Fix: let fully_shard's backward produce the gradients (or redistribute them to the "
                    "parameter's placements).")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = _local(state["momentum_buffer"])
            g = _local(grad)
            buf.lerp_(g, 1 - momentum)
            update = g.lerp(buf, momentum) if nesterov else buf
            items.append(_Item(p, name, group, _local(p), update, self._kind(p, name, group),
                               group.get("ns_blocks", 1)))
        return items

    def _apply(self, item: _Item, ortho: Tensor) -> None:
        lr = float(item.group["lr"])
        item.local.mul_(1 - lr * item.group["weight_decay"])
        item.local.add_(ortho, alpha=-adjust_lr(lr, item.group["adjust_lr_fn"], item.lr_shape()))

    # --- exchanged matrices ------------------------------------------------------------------------
    def _plan(self, pg: dist.ProcessGroup, items: list[_Item]) -> OwnerPlan:
        specs = tuple(item.spec() for item in items)
        world = dist.get_world_size(pg)
        key = (world, specs, self.per_bucket)  # the plan depends on nothing else (no process group: deepcopy)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_owners(specs, world, per_bucket=self.per_bucket)
            check_same_plan(plan.digest, group=pg, stats=self.comm_stats, what="Muon.step()")
            self._plans[key] = plan
        rank = dist.get_rank(pg)
        for i, item in enumerate(items):
            start, end = plan.rows_of(i, rank)
            if item.local.shape[0] != end - start:
                raise RuntimeError(
                    f"Muon: parameter {item.name!r} (shape {tuple(item.param.shape)}) holds {item.local.shape[0]} "
                    f"rows on rank {rank} of {world}; expected {end - start} (torch's Shard(0) chunking). Fix: "
                    "shard it with fully_shard (even-chunk Shard(0)).")
        return plan

    def _exchange(self, pg: dist.ProcessGroup, items: list[_Item]) -> None:
        plan = self._plan(pg, items)
        rows = [item.update.bfloat16() for item in items]  # torch's Newton-Schulz starts with .bfloat16()
        if self.comm == "gather":
            self._gather(pg, plan, items, rows)
        else:
            self._owner(pg, plan, items, rows)

    def _owner(self, pg: dist.ProcessGroup, plan: OwnerPlan, items: list[_Item], rows: list[Tensor]) -> None:
        """Per bucket: all-to-all rows to owners, Newton-Schulz there, all-to-all back. Bucket i+1's
        all-to-all is in flight while bucket i is orthogonalized."""
        world, me = plan.world, dist.get_rank(pg)

        def held(i: int, r: int) -> int:
            start, end = plan.rows_of(i, r)
            return (end - start) * plan.specs[i].cols

        def launch(k: int) -> PendingRows:
            bucket = plan.buckets[k]
            send_splits = [sum(held(i, me) for i, o in zip(bucket.matrices, bucket.owners) if o == d)
                           for d in range(world)]
            recv_splits = [sum(held(i, s) for i, o in zip(bucket.matrices, bucket.owners) if o == me)
                           for s in range(world)]
            parts = [rows[i].reshape(-1) for d in range(world)
                     for i, o in zip(bucket.matrices, bucket.owners) if o == d]
            send = torch.cat(parts) if parts else rows[0].new_empty(0)
            return all_to_all_rows(send, send_splits=send_splits, recv_splits=recv_splits, group=pg,
                                   stats=self.comm_stats)

        returns: list[tuple[int, PendingRows]] = []
        pending = launch(0) if plan.buckets else None
        for k, bucket in enumerate(plan.buckets):
            assert pending is not None
            received = pending.wait()
            pending = launch(k + 1) if k + 1 < len(plan.buckets) else None
            mine = [i for i, o in zip(bucket.matrices, bucket.owners) if o == me]
            recv_splits = [sum(held(i, s) for i in mine) for s in range(world)]
            segments = list(torch.split(received, recv_splits))
            pieces: list[list[Tensor]] = [[] for _ in range(world)]  # per source rank: its rows back, in order
            for i in mine:
                cols = plan.specs[i].cols
                parts = []
                for s in range(world):
                    n = held(i, s)
                    parts.append(segments[s][:n].view(-1, cols))
                    segments[s] = segments[s][n:]
                ortho = _orthogonalize(torch.cat(parts), items[i].group, items[i].blocks)
                self.ns_work += ns_cost(plan.specs[i])
                for s in range(world):
                    start, end = plan.rows_of(i, s)
                    pieces[s].append(ortho[start:end].reshape(-1))
            back = [p for s in range(world) for p in pieces[s]]
            send = torch.cat(back) if back else rows[0].new_empty(0)
            send_splits = [sum(held(i, me) for i, o in zip(bucket.matrices, bucket.owners) if o == d)
                           for d in range(world)]
            returns.append((k, all_to_all_rows(send, send_splits=recv_splits, recv_splits=send_splits, group=pg,
                                               stats=self.comm_stats)))
        for k, work in returns:
            bucket = plan.buckets[k]
            out = work.wait()
            offset = 0
            for d in range(world):
                for i, o in zip(bucket.matrices, bucket.owners):
                    if o == d:
                        n = held(i, me)
                        self._apply(items[i], out[offset:offset + n].view(-1, plan.specs[i].cols))
                        offset += n

    def _gather(self, pg: dist.ProcessGroup, plan: OwnerPlan, items: list[_Item], rows: list[Tensor]) -> None:
        """Per bucket: every rank all-gathers the bucket's rows and orthogonalizes every matrix in it."""
        world, me = plan.world, dist.get_rank(pg)

        def sizes(k: int) -> list[int]:
            return [sum((plan.rows_of(i, r)[1] - plan.rows_of(i, r)[0]) * plan.specs[i].cols
                        for i in plan.buckets[k].matrices) for r in range(world)]

        def launch(k: int) -> PendingRows:
            parts = [rows[i].reshape(-1) for i in plan.buckets[k].matrices]
            local = torch.cat(parts) if parts else rows[0].new_empty(0)
            return all_gather_rows(local, chunk=max(sizes(k)), group=pg, stats=self.comm_stats)

        pending = launch(0) if plan.buckets else None
        for k, bucket in enumerate(plan.buckets):
            assert pending is not None
            gathered = pending.wait()
            pending = launch(k + 1) if k + 1 < len(plan.buckets) else None
            offsets = [0] * world
            for i in bucket.matrices:
                cols = plan.specs[i].cols
                parts = []
                for r in range(world):
                    start, end = plan.rows_of(i, r)
                    n = (end - start) * cols
                    parts.append(gathered[r, offsets[r]:offsets[r] + n].view(-1, cols))
                    offsets[r] += n
                ortho = _orthogonalize(torch.cat(parts), items[i].group, items[i].blocks)
                self.ns_work += ns_cost(plan.specs[i])
                start, end = plan.rows_of(i, me)
                self._apply(items[i], ortho[start:end])

    def _name(self, group: dict[str, Any], i: int) -> str:
        """The parameter's FQN when the group has names (``muon_param_groups``, ``named_parameters()``)."""
        names = group.get("param_names")
        if names:
            return str(names[i])
        index = next((g for g, other in enumerate(self.param_groups) if other is group), len(self.param_groups))
        return f"param_groups[{index}]['params'][{i}] (pass model.named_parameters() to get its name)"

    # --- AdamW groups: torch's functional Adam(decoupled) on the local shards -----------------------
    def _adamw(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        has_complex = False
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"Muon (AdamW group): parameter {self._name(group, i)!r} has a sparse gradient.")
            has_complex |= torch.is_complex(p)
            state = self.state[p]
            if len(state) == 0:  # as torch.optim.Adam._init_group (not fused, not capturable)
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(_local(p))
            grads.append(_local(p.grad))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            if group["amsgrad"]:
                max_sqs.append(_local(state["max_exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, foreach=group["foreach"], capturable=False,
             differentiable=False, fused=None, has_complex=has_complex, decoupled_weight_decay=True,
             amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"])


# --- routing -------------------------------------------------------------------------------------------
_HEAD_NAMES = ("lm_head", "head", "output", "classifier")


def muon_param_groups(
    model: nn.Module,
    *,
    adamw_lr: float = 3e-4,
    adamw_betas: tuple[float, float] = (0.9, 0.999),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 1e-2,
    head: str | Iterable[str] | None = None,
    heads: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for ``Muon``: hidden matrices to Muon, everything else to AdamW (own lr).

    Muon: the 2-D ``weight`` of every ``nn.Linear`` except the output head, and 3-D parameters (stacked
    experts ``[E, m, n]``) of modules that are not convolutions. AdamW: embeddings, the output head
    (``head``: module FQNs; default: ``model.get_output_embeddings()`` if the model has it, else Linear
    modules named lm_head/head/output/classifier or with as many outputs as an embedding has rows), tied
    weights, norms, biases, 0-dim and any other parameter. ``heads`` maps FQN patterns (``fnmatch``) of
    Muon matrices to a number of row blocks orthogonalized separately (per-head Newton-Schulz). Each group
    carries ``param_names``, so errors and state dicts name the parameters.
    """
    heads = dict(heads or {})
    head_modules: set[int] = set()
    if head is not None:
        wanted = {head} if isinstance(head, str) else set(head)
        found = {n for n, _ in model.named_modules()} & wanted
        if found != wanted:
            raise ValueError(f"muon_param_groups: head {sorted(wanted - found)} not found among the model's module "
                             "FQNs. Fix: pass names from model.named_modules() (e.g. 'lm_head').")
        head_modules = {id(m) for n, m in model.named_modules() if n in wanted}
    else:
        get_out = getattr(model, "get_output_embeddings", None)
        out = get_out() if callable(get_out) else None
        if isinstance(out, nn.Module):
            head_modules = {id(out)}
        else:
            vocabs = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
            head_modules = {id(m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and (
                n.rsplit(".", 1)[-1] in _HEAD_NAMES or m.out_features in vocabs)}
    muon_ids: dict[int, int] = {}  # id(param) -> ns_blocks
    for module in model.modules():
        conv = isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        for pname, p in module.named_parameters(recurse=False):
            if (isinstance(module, nn.Linear) and pname == "weight" and p.ndim == 2) or (p.ndim == 3 and not conv):
                muon_ids[id(p)] = 1
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head_ids = {id(p) for m in model.modules() if id(m) in head_modules for p in m.parameters()}
    groups: dict[Any, dict[str, Any]] = {}
    adamw: dict[str, Any] = {"params": [], "param_names": [], "algorithm": "adamw", "lr": adamw_lr,
                             "betas": adamw_betas, "eps": adamw_eps, "weight_decay": adamw_weight_decay}
    for name, p in model.named_parameters():  # tied weights appear once (under their first name)
        if id(p) in muon_ids and id(p) not in embedding_ids and id(p) not in head_ids:
            blocks = next((b for pattern, b in heads.items() if fnmatch.fnmatchcase(name, pattern)), 1)
            group = groups.setdefault(blocks, {"params": [], "param_names": [], "algorithm": "muon",
                                               "ns_blocks": blocks})
        else:
            group = adamw
        group["params"].append(p)
        group["param_names"].append(name)
    out_groups = [groups[b] for b in sorted(groups)]
    return [*out_groups, adamw] if adamw["params"] else out_groups
