"""Fault-tolerant HSDP on CPU: two replica groups of two ranks train; one is killed, restarted, and heals.

    python examples/fault_tolerant.py                 # 4 CPU processes, gloo, a torchft lighthouse in-process
    python examples/fault_tolerant.py --kill 0:1:backward --kill 1:0:allreduce   # REPLICA:RANK:PHASE, in order
    python examples/fault_tolerant.py --torchrun --kill 1:0:forward   # group 1 under torchrun --max-restarts

Each replica group is its own fully_shard job over its own ranks (a 1-D mesh of 2 gloo ranks); torchft's
``Manager`` joins the groups: ``fully_shard.ft.fault_tolerant(model, optimizer, manager=...)`` averages every
unit's gradient across the groups that contribute to the step, commits a step only with a healthy quorum,
and lets a restarted group heal from a live peer (docs/ft.md). This script is the launcher too: it starts
the lighthouse, the four ranks (a forkserver with torch preloaded, so a restart takes a fork, not an
import), SIGKILLs one rank in the chosen phase (``--kill REPLICA:RANK:PHASE``, phases forward, backward,
allreduce, optimizer, heal, source), kills the rest of that group (what torchrun's agent does) and
restarts it; with ``--torchrun`` group 1 runs under ``torchrun --max-restarts``, which restarts it.
It prints the kill, every quorum change seen by the survivors, the heal, and at the end compares the
replicas' parameters and optimizer state bit for bit.

The same launcher (``Cluster``, ``worker``) drives tests/ft/ and benchmarks/ft.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("forward", "backward", "allreduce", "optimizer", "heal", "source")
LAUNCHERS = ("fork", "torchrun")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training setup, the same in every replica group."""

    groups: int = 2  # replica groups
    ranks: int = 2  # ranks per group (its fully_shard mesh)
    steps: int = 10  # stop after this committed step with a full quorum (the launcher may move it: its stop file)
    hold: bool = False  # ignore ``steps``: run until the launcher's stop file names the last step
    max_steps: int = 3000  # fail past this step (a group that never rejoined)
    full_quorum: int = 0  # groups that must contribute to the last step (0: ``groups``)
    d_in: int = 8
    hidden: int = 16
    depth: int = 2  # hidden layers
    d_out: int = 4
    samples: int = 512
    batch: int = 4  # per rank
    lr: float = 1e-2
    optimizer: str = "adamw"  # adamw | sgd (momentum 0.9: an average divided wrongly shows, Adam hides a scale)
    seed: int = 0
    init_seeds: tuple[int, ...] = ()  # per replica group: another initialization (init_sync tests); default seed
    variants: tuple[str, ...] = ()  # per replica group: ours | compat (torch's names after compat.patch_torch())
    #                                 | torch (torch's fully_shard, torchtitan's recipe); default all "ours"
    layouts: tuple[str, ...] = ()  # per replica group: rows (Shard(0), default) | cols (Shard(1) for 2-D params)
    mesh: tuple[int, ...] = ()  # a replica group's mesh: (ranks,) by default; (2, 2): HSDP (replicate, shard) inside it
    launchers: tuple[str, ...] = ()  # per replica group: fork (default: this launcher forks and restarts its ranks)
    #                                  | torchrun (one ``torchrun --max-restarts`` per group restarts them)
    torchrun_restarts: int = 3  # torchrun's --max-restarts
    async_quorum: bool = True
    init_sync: bool = False
    min_replicas: int = 1  # the lighthouse's
    record: bool = False  # keep every committed step's local shards (parity tests)
    step_sleep: float = 0.0  # seconds per step (keeps step counts small while a group restarts)
    timeout_s: float = 15.0  # torchft's timeouts (collectives, commit vote, checkpoint transfer)
    worker_timeout_s: float = 300.0  # a rank exits by itself after this long

    def variant(self, replica: int) -> str:
        return self.variants[replica] if self.variants else "ours"

    def layout(self, replica: int) -> str:
        return self.layouts[replica] if self.layouts else "rows"

    def launcher(self, replica: int) -> str:
        return self.launchers[replica] if self.launchers else "fork"

    def mesh_shape(self) -> tuple[int, ...]:
        shape = self.mesh or (self.ranks,)
        if len(shape) > 2 or torch.Size(shape).numel() != self.ranks:
            raise ValueError(f"Recipe(mesh={self.mesh}): a 1-D or 2-D mesh of ranks={self.ranks} ranks expected")
        return shape

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        fields = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL rank ``rank`` of replica group ``replica`` in ``phase`` at manager step ``step``. ``heal``: when
    its heal has arrived, before it is applied (the group must be restarting: in ``Cluster.run``'s plan the
    group is first killed in its forward, then again while the restart heals). ``source``: when it starts
    sending its state to a healing peer (in ``Cluster.run``'s plan: group ``replica`` is killed in its
    forward, then rank ``rank`` of every other group is armed and the first of them to send, torchft's
    source, dies as the heal starts; the others disarm)."""

    replica: int
    rank: int
    phase: str
    step: int = 0


# --- the model, the data, one rank's training loop ---------------------------------------------------------
def build_model(recipe: Recipe, replica: int = 0) -> nn.Sequential:
    torch.manual_seed(recipe.init_seeds[replica] if recipe.init_seeds else recipe.seed)
    dims = [recipe.d_in] + [recipe.hidden] * recipe.depth + [recipe.d_out]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=recipe.lr)


def dataset(recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + recipe.seed)
    x = torch.randn(recipe.samples, recipe.d_in, generator=g)
    w = torch.randn(recipe.d_in, recipe.d_out, generator=g)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(recipe.samples, recipe.d_out, generator=g)


def shard(model: nn.Sequential, recipe: Recipe, replica: int) -> None:
    """fully_shard every Linear and the root over this group's ranks (torch's or this library's names)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    shape = recipe.mesh_shape()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)
    variant = recipe.variant(replica)
    if variant == "ours":
        from fully_shard import fully_shard
    else:
        if variant == "compat":
            from fully_shard import compat

            compat.patch_torch()
        from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
    kwargs: dict[str, Any] = {"mesh": mesh}
    if recipe.layout(replica) == "cols":
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else Shard(0)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


class _Log:
    """One JSON line per event, flushed at once (the launcher reads it while the rank runs)."""

    def __init__(self, path: Path, replica: int, rank: int, incarnation: int | None) -> None:
        self._f = path.open("a")
        self.base: dict[str, Any] = {"replica": replica, "rank": rank, "pid": os.getpid()}
        if incarnation is not None:  # (torchrun's restart count; the launcher counts its own restarts)
            self.base["incarnation"] = incarnation

    def __call__(self, ev: str, **fields: Any) -> None:
        self._f.write(json.dumps({"ev": ev, "t": time.time(), **self.base, **fields}) + "\n")
        self._f.flush()


def _die(log: _Log, phase: str, step: int) -> None:
    log("kill", phase=phase, step=step)
    os.kill(os.getpid(), signal.SIGKILL)


def _watchdog(seconds: float, launcher: int, parent: int | None) -> None:
    """Bounded time for every rank: exit if the launcher process is gone, if ``parent`` (torchrun's agent)
    is no longer this process's parent, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            os._exit(125)
        if parent is not None and os.getppid() != parent:
            os._exit(125)
        time.sleep(0.5)
    os._exit(124)


def worker(recipe: Recipe, replica: int, rank: int, store_port: int | None, lighthouse: str, out: str,
           kill: Kill | None, launcher: int) -> None:
    """One rank of one replica group: train, then save this rank's local state to ``out``. Events go to
    ``out + ".jsonl"``; ``out + ".arm"`` (written by the launcher, removed when read) arms a ``Kill``;
    ``<dir>/go`` starts the first groups together; ``<dir>/stop`` names the step to stop after.
    ``store_port=None``: started by torchrun (its rank, store and restart count come from its environment)."""
    started = time.time()
    under_torchrun = store_port is None
    incarnation = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) if under_torchrun else None
    threading.Thread(target=_watchdog, args=(recipe.worker_timeout_s, launcher,
                                             os.getppid() if under_torchrun else None), daemon=True).start()
    os.dup2(os.open(out + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)  # torchft's logs, tracebacks
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    torch.set_num_threads(1)
    log = _Log(Path(out + ".jsonl"), replica, rank, incarnation)
    workdir = Path(out).parent
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing import HTTPTransport

    if under_torchrun:  # env://: MASTER_ADDR/MASTER_PORT, a store rank 0 hosts, new at every restart
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    else:
        store = dist.TCPStore("127.0.0.1", store_port, recipe.ranks, is_master=rank == 0,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=recipe.ranks,
                                timeout=timedelta(seconds=60))
    model = build_model(recipe, replica)
    shard(model, recipe, replica)
    inner = make_optimizer(model, recipe)
    timings: dict[str, float] = {}

    class Transport(HTTPTransport):  # type: ignore[misc]  # times the transfer; the "heal" kill point
        def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            got = super().recv_checkpoint(*args, **kwargs)
            timings["recv_s"] = time.perf_counter() - begin
            log("recv", seconds=timings["recv_s"])  # (torchft's quorum thread: a state arrived, not yet applied)
            if kill is not None and kill.phase == "heal":
                _die(log, "heal", -1)
            return got

        def send_checkpoint(self, *args: Any, **kwargs: Any) -> Any:  # the "source" kill point
            nonlocal kill
            if kill is not None and kill.phase == "source":
                if _claim_source(workdir, kill):  # the first armed rank that sends dies as it sends
                    _die(log, "source", -1)
                kill = None  # another group's rank was the source: disarmed
                log("disarmed", phase="source")
            return super().send_checkpoint(*args, **kwargs)

    timeout = timedelta(seconds=recipe.timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=1, use_async_quorum=recipe.async_quorum, init_sync=recipe.init_sync,
                      timeout=timeout, quorum_timeout=timeout * 2, connect_timeout=timeout, rank=rank,
                      world_size=recipe.ranks, store_addr=os.environ["MASTER_ADDR"] if under_torchrun else "127.0.0.1",
                      store_port=int(os.environ["MASTER_PORT"]) if store_port is None else store_port,
                      lighthouse_addr=lighthouse, replica_id=f"replica_{replica}", hostname="127.0.0.1",
                      checkpoint_transport=Transport(timeout=timeout, num_chunks=0))
    torch_recipe = recipe.variant(replica) == "torch"
    if torch_recipe:
        optimizer = _torch_recipe(model, inner, manager)
        heals = lambda: 0  # noqa: E731  (torchft's own callbacks: a heal shows as a jump of the step)
    else:
        from fully_shard.ft import fault_tolerant

        optimizer = fault_tolerant(model, inner, manager=manager)
        heals = lambda: optimizer.healed  # noqa: E731
    from fully_shard.ft import StepSampler

    sampler = StepSampler(recipe.samples, batch_size=recipe.batch, replica_id=replica, num_replica_groups=recipe.groups,
                          group_rank=rank, group_world_size=recipe.ranks, manager=manager, seed=recipe.seed)
    x_all, y_all = dataset(recipe)
    _arm(model, manager, inner, kill, log)
    log("up", started=started)
    while not (workdir / "go").exists():  # the first groups start together; a restart finds it there
        time.sleep(0.02)
    arm = Path(out + ".arm")
    records: list[dict[str, Any]] = []
    seen_heals, participants = 0, -1
    full = recipe.full_quorum or recipe.groups
    try:
        while True:
            if kill is not None and kill.phase == "source" and _source_claimed(workdir, kill):
                kill = None  # another group's rank was the source: disarmed, free to be armed again
                log("disarmed", phase="source")
            if kill is None and arm.exists():
                kill = Kill(**json.loads(arm.read_text()))
                arm.unlink()  # (a torchrun restart keeps this rank's file names)
                _arm(model, manager, inner, kill, log)
                log("armed", phase=kill.phase, step=kill.step)
            before = manager.current_step()
            optimizer.zero_grad()
            step = manager.current_step()  # a synchronous quorum may have healed this replica
            idx = sampler.indices(step)
            loss = nn.functional.mse_loss(model(x_all[idx]), y_all[idx])
            loss.backward()
            manager.wait_quorum()  # (the all-reduces waited for it already)
            # whether this replica's gradient is in the step's sum, in which quorum (torchft's private id)
            log("attempt", step=step, quorum=manager._quorum_id, participating=manager.is_participating())
            optimizer.step()
            after = manager.current_step()
            n = manager.num_participants()
            contributed = manager.is_participating()
            if heals() > seen_heals or (torch_recipe and after > before + 1):
                seen_heals = heals()
                log("heal", step=after, recv_s=timings.get("recv_s"))
            if n != participants:
                participants = n
                log("quorum", step=after, participants=n)
            committed = after > before
            log("step", step=after, committed=committed, participants=n, contributed=contributed,
                quorum=manager._quorum_id, loss=float(loss.detach()))
            if committed and recipe.record:
                records.append({"step": after, "contributed": contributed,
                                "params": _local_state(model, inner)[0]})
            stop = (workdir / "stop").read_text() if (workdir / "stop").exists() else None
            last = int(stop) if stop else (recipe.max_steps + 1 if recipe.hold else recipe.steps)
            if committed and after >= last and n >= full:
                break
            if after >= recipe.max_steps:
                raise RuntimeError(f"replica {replica} reached step {after} without a full quorum")
            if recipe.step_sleep:
                time.sleep(recipe.step_sleep)
        params, optim = _local_state(model, inner)
        torch.save({"params": params, "optim": optim, "records": records, "step": manager.current_step()}, out)
        log("done", step=manager.current_step())
    except Exception as e:  # reported to the launcher (the traceback goes to the rank's .stderr file)
        log("error", msg=f"{type(e).__name__}: {e}")
        traceback.print_exc()
        sys.exit(3)
    finally:
        with contextlib.suppress(Exception):
            manager.shutdown(wait=False)


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's local shards of the parameters and of every optimizer state tensor, in model order."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    params = [local(p) for p in model.parameters()]
    optim = [local(v) for p in model.parameters() for _, v in sorted(optimizer.state.get(p, {}).items())
             if isinstance(v, torch.Tensor)]
    return params, optim


def _source_token(workdir: Path, kill: Kill) -> Path:
    return workdir / f"source-{kill.step}"  # (a source kill's ``step`` numbers it: one token per planned kill)


def _claim_source(workdir: Path, kill: Kill) -> bool:
    """Whether this rank is the first of the ranks armed with this source kill to send (it then dies)."""
    try:
        os.close(os.open(_source_token(workdir, kill), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _source_claimed(workdir: Path, kill: Kill) -> bool:
    return _source_token(workdir, kill).exists()


def _arm(model: nn.Sequential, manager: Any, optimizer: torch.optim.Optimizer, kill: Kill | None, log: _Log) -> None:
    """Install the kill point (``Kill``) in this rank: a hook that SIGKILLs the process when reached."""
    if kill is None or kill.phase in ("heal", "source"):  # (the transport's kill points)
        return
    at = kill.step

    def now() -> bool:  # (armed while running: the first chance from step ``at`` on)
        return manager.current_step() >= at

    middle = model[len(model) // 2]
    if kill.phase == "forward":
        middle.register_forward_pre_hook(lambda *_: _die(log, "forward", at) if now() else None)
    elif kill.phase == "backward":
        def on_output(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
            if now() and out.requires_grad:
                out.register_hook(lambda g: _die(log, "backward", at))
        middle.register_forward_hook(on_output)
    elif kill.phase == "allreduce":
        issued = manager.allreduce
        count = [0]

        def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = issued(tensor, *args, **kwargs)
            count[0] += 1
            if now() and count[0] >= 2:  # the second unit's all-reduce is in flight on every group
                _die(log, "allreduce", at)
            return work
        manager.allreduce = allreduce
    elif kill.phase == "optimizer":
        optimizer.register_step_pre_hook(lambda *_: _die(log, "optimizer", at) if manager.current_step() > at
                                          else None)  # (the vote already counted this step)
    else:
        raise ValueError(f"unknown kill phase {kill.phase!r}; expected one of {PHASES}")


def _torch_recipe(model: nn.Module, optimizer: torch.optim.Optimizer, manager: Any) -> Any:
    """torch's fully_shard under torchft as torchtitan's experiments/torchft does it: the all-reduce hook
    through the manager, optimizer state made by a zero-gradient lr-0 step, state dicts cached on the
    training thread and handed to torchft's thread as they are."""
    from torchft.optim import OptimizerWrapper

    for m in model.modules():
        if hasattr(m, "set_all_reduce_hook"):
            m.set_all_reduce_hook(lambda out: manager.allreduce(out).wait())
    for p in model.parameters():  # torchtitan's init_optim_state
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad()
    cache: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        return cache

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        cache.update(model=model.state_dict(), optim=optimizer.state_dict())

    cache.update(model=model.state_dict(), optim=optimizer.state_dict())
    manager.register_state_dict_fn("torchtitan", load_state_dict, state_dict)
    return OptimizerWrapper(manager, optimizer)


# --- the launcher --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_CONTEXT: Any = None


def _context() -> Any:
    """A forkserver with torch, torchft and fully_shard imported once: a rank starts in a fork."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        # torch._dynamo: DTensor.from_local imports it on first use (seconds of CPU in every fresh rank)
        _CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
                                         "torchft", "torchft.checkpointing", "fully_shard", "fully_shard.ft",
                                         "examples.fault_tolerant"])
    return _CONTEXT


class _Torchrun:
    """One replica group's ``torchrun`` (in a session of its own), standing for each of its ranks' process:
    torchrun, not the launcher, restarts them."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill(self) -> None:
        """SIGTERM: torchrun stops its workers (each also exits when torchrun is gone); SIGKILL after 10 s."""
        if self.popen.poll() is None:
            self.popen.terminate()
            self.join(10)
        if self.popen.poll() is None:
            self.popen.kill()
            self.join(10)


@dataclasses.dataclass
class Rank:
    replica: int
    rank: int
    incarnation: int
    proc: Any
    out: Path
    read: int = 0  # bytes of its log already read
    done: bool = False


@dataclasses.dataclass
class Report:
    events: list[dict[str, Any]]
    kills: list[dict[str, Any]]  # kill events (the rank's own line) with the launcher's notice time
    restarts: list[dict[str, Any]]
    finals: dict[tuple[int, int], dict[str, Any]]  # (replica, rank) -> saved state of its last incarnation
    errors: list[str]  # errors of the ranks' last incarnations (a killed group's other ranks fail: not counted)
    all_errors: list[dict[str, Any]]
    hung: bool
    wall_s: float

    def commits(self, replica: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == "step" and e["committed"] and (replica is None or
                                                                                   e["replica"] == replica)]


class Cluster:
    """The lighthouse (in this process, on 127.0.0.1) and the replica groups' ranks (forked processes)."""

    def __init__(self, recipe: Recipe, workdir: Path, *, echo: Callable[[str], None] | None = None) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info level
        from torchft._torchft import LighthouseServer

        self.recipe = recipe
        self.workdir = workdir
        self.echo = echo or (lambda _line: None)
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=recipe.min_replicas,
                                           join_timeout_ms=1000, quorum_tick_ms=20, heartbeat_timeout_ms=1000)
        self.address = "http://127.0.0.1:" + self.lighthouse.address().rsplit(":", 1)[1]
        self.ranks: dict[tuple[int, int], Rank] = {}
        self.incarnations: dict[int, int] = {}
        self.events: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []  # "error" events of every incarnation

    def start_group(self, replica: int, kill: Kill | None = None) -> None:
        if self.recipe.launcher(replica) == "torchrun":
            if kill is not None or replica in self.incarnations:
                raise ValueError(f"replica {replica} runs under torchrun, which restarts it (with no kill planned "
                                 "for the restart): the launcher starts it once")
            self._start_torchrun(replica)
            return
        ctx = _context()
        incarnation = self.incarnations[replica] = self.incarnations.get(replica, -1) + 1
        port = _free_port()
        for rank in range(self.recipe.ranks):
            out = self.workdir / f"r{replica}_g{rank}_i{incarnation}.pt"
            plan = kill if kill is not None and kill.rank == rank else None
            proc = ctx.Process(target=worker, daemon=True, args=(self.recipe, replica, rank, port, self.address,
                                                                 str(out), plan, os.getpid()))
            proc.start()
            self.ranks[(replica, rank)] = Rank(replica, rank, incarnation, proc, out)

    def _start_torchrun(self, replica: int) -> None:
        """``torchrun --standalone --max-restarts`` running this script's ``--worker`` on every rank of the
        group; its output goes to ``torchrun_r<replica>.log``."""
        self.incarnations[replica] = 0
        config = self.workdir / f"torchrun_r{replica}.json"
        config.write_text(json.dumps({"recipe": self.recipe.to_json(), "replica": replica, "lighthouse": self.address,
                                      "workdir": str(self.workdir), "launcher": os.getpid()}))
        root = str(Path(__file__).resolve().parent.parent)
        # torchrun's shared rendezvous store outlives a restart and keeps the dead ranks' keys (gloo's addresses,
        # torchft's manager address): a restarted rank reads them and fails to connect (pytorch#135712). Not
        # shared, rank 0 hosts a new store at every restart (docs/ft.md).
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "OMP_NUM_THREADS": "1", "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
               "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.recipe.ranks}",
               f"--max-restarts={self.recipe.torchrun_restarts}", "--monitor-interval=0.1",
               str(Path(__file__).resolve()), "--worker", str(config)]
        with (self.workdir / f"torchrun_r{replica}.log").open("ab") as out:
            proc = _Torchrun(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        for rank in range(self.recipe.ranks):
            self.ranks[(replica, rank)] = Rank(replica, rank, 0, proc, self.workdir / f"r{replica}_g{rank}.pt")

    def kill_group(self, replica: int) -> None:
        for rank in range(self.recipe.ranks):
            r = self.ranks.get((replica, rank))
            if r is not None and r.proc.is_alive():
                r.proc.kill()
        for rank in range(self.recipe.ranks):
            r = self.ranks.get((replica, rank))
            if r is not None:
                r.proc.join(10)

    def poll(self) -> list[tuple[int, int]]:
        """Read new log lines; return the ranks that died (any exit without a ``done`` line)."""
        dead = []
        for key, r in self.ranks.items():
            exited = r.proc.exitcode is not None  # (before its last lines are read: a "done" is not missed)
            log = Path(str(r.out) + ".jsonl")
            if log.exists():
                with log.open() as f:
                    f.seek(r.read)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                r.read += len(complete)
                for line in complete.splitlines():
                    ev = json.loads(line)
                    incarnation = ev.setdefault("incarnation", r.incarnation)  # (torchrun's ranks log theirs)
                    if incarnation > self.incarnations[r.replica]:  # torchrun restarted the group
                        self.incarnations[r.replica] = incarnation
                        self.restarts.append({"replica": r.replica, "t": ev.get("started", ev["t"]),
                                              "incarnation": incarnation})
                        self.echo(f"[{ev['t']:.2f}] torchrun restarted replica {r.replica}")
                    r.incarnation = max(r.incarnation, incarnation)
                    self.events.append(ev)
                    self._echo(ev)
                    if ev["ev"] == "done":
                        r.done = True
                    elif ev["ev"] == "kill":
                        self.kills.append(ev)
                    elif ev["ev"] == "error":
                        self.errors.append(ev)
            if not r.done and exited:
                dead.append(key)
        return dead

    def _echo(self, ev: dict[str, Any]) -> None:
        who = f"replica {ev['replica']} rank {ev['rank']}"
        if ev["ev"] == "kill":
            self.echo(f"[{ev['t']:.2f}] KILL {who} during {ev['phase']} (step {ev['step']})")
        elif ev["ev"] == "quorum" and ev["rank"] == 0:
            self.echo(f"[{ev['t']:.2f}] quorum seen by replica {ev['replica']}: {ev['participants']} replica "
                      f"group(s) contribute (step {ev['step']})")
        elif ev["ev"] == "heal":
            recv = f", state received in {ev['recv_s']:.3f} s" if ev.get("recv_s") is not None else ""
            self.echo(f"[{ev['t']:.2f}] HEAL {who}: now at step {ev['step']}{recv}")
        elif ev["ev"] == "up":
            self.echo(f"[{ev['t']:.2f}] up: {who} (pid {ev['pid']}, ready {ev['t'] - ev['started']:.1f} s after its "
                      "start)")
        elif ev["ev"] == "done":
            self.echo(f"[{ev['t']:.2f}] done: {who} at step {ev['step']}")
        elif ev["ev"] == "error":
            self.echo(f"[{ev['t']:.2f}] ERROR {who}: {ev['msg']}")

    def close(self) -> None:
        for r in self.ranks.values():
            if r.proc.is_alive():
                r.proc.kill()
        for r in self.ranks.values():
            r.proc.join(10)
        self.lighthouse.shutdown()

    def arm(self, kill: Kill) -> None:
        """Arm ``kill`` in the running rank (it reads the file at the start of its next step)."""
        r = self.ranks[(kill.replica, kill.rank)]
        tmp = Path(str(r.out) + ".arm.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(kill)))
        tmp.replace(str(r.out) + ".arm")

    def stop_at(self, step: int) -> None:
        """Every rank stops after committing ``step`` (or the first later one with a full quorum)."""
        tmp = self.workdir / "stop.tmp"
        tmp.write_text(str(step))
        tmp.replace(self.workdir / "stop")

    def step_of(self, replica: int) -> int:
        return max((e["step"] for e in self.events if e["ev"] == "step" and e["replica"] == replica
                    and e["incarnation"] == self.incarnations.get(replica)), default=0)

    def healthy_since(self, t0: float, replicas: list[int]) -> bool:
        """Every rank of ``replicas`` is alive and each replica's current incarnation committed a step with
        all of them contributing after ``t0``."""
        if any(r.proc.exitcode is not None for r in self.ranks.values() if r.replica in replicas):
            return False
        return all(any(e["ev"] == "step" and e["replica"] == r and e["incarnation"] == self.incarnations[r]
                       and e["committed"] and e["t"] > t0 and e["participants"] >= len(replicas)
                       for e in self.events) for r in replicas)

    def run(self, *, plan: list[Kill] = (), late: dict[int, int] | None = None,
            expect_failure: frozenset[int] = frozenset(), deadline_s: float = 300.0,
            on_healthy: Callable[[Cluster, int], Kill | None] | None = None, tail_steps: int = 4) -> Report:
        """Start the groups (a replica in ``late`` once another has committed that step), then carry out
        ``plan`` one kill at a time, each when the killed group was restarted and every group has
        contributed to a committed step since (``on_healthy(cluster, i)`` may supply kill ``i`` instead).
        A group whose rank died is killed and restarted, but a replica in ``expect_failure``, which must
        fail. With ``Recipe(hold=True)`` the stop file then ends the run (``tail_steps`` later); else the ranks
        stop at ``recipe.steps``. Past ``deadline_s`` every rank is killed and the report says ``hung``."""
        start = time.time()
        late = dict(late or {})
        plan = list(plan)
        for replica in range(self.recipe.groups):
            if replica not in late:
                self.start_group(replica)
        torchrun_heals = [k for k in plan if k.phase == "heal" and self.recipe.launcher(k.replica) == "torchrun"]
        if torchrun_heals:
            raise ValueError(f"Cluster.run(plan=...): {torchrun_heals[0]}: a kill during the heal of a restart needs "
                             "the launcher to restart the group, not torchrun")
        if any(k.phase == "source" for k in plan) and self.recipe.groups - len(expect_failure) < 3:
            raise ValueError("Cluster.run(plan=...): a 'source' kill needs 3 live replica groups (with 2, the only "
                             "live copy of the state dies with the source)")
        if (plan or on_healthy) and not self.recipe.hold:
            raise ValueError("Cluster.run(plan=...): the recipe must hold (Recipe(hold=True)): the ranks would stop at "
                             "recipe.steps while kills are still planned")
        restart_kills: dict[tuple[int, int], Kill] = {}
        issued, expected_kills, last_change, hung = 0, 0, start, False
        done_planning = not self.recipe.hold  # else the stop file ends the run, after the plan
        go = self.workdir / "go"
        while True:
            dead = self.poll()
            if not go.exists() and sum(e["ev"] == "up" for e in self.events) == len(self.ranks):
                go.touch()
            for replica, at in list(late.items()):
                if any(self.step_of(r) >= at for r in self.incarnations):
                    del late[replica]
                    self.start_group(replica)
            for replica in sorted({key[0] for key in dead}):
                if self.recipe.launcher(replica) == "torchrun":  # torchrun gave up: not restarted here
                    if not any(e["replica"] == replica and e["rank"] == -1 for e in self.errors):
                        code = self.ranks[(replica, 0)].proc.exitcode
                        self.errors.append({"ev": "error", "replica": replica, "rank": -1, "t": time.time(),
                                            "incarnation": self.incarnations[replica],
                                            "msg": f"torchrun exited with {code} before its ranks finished"})
                    continue
                if replica in expect_failure:  # its other ranks fail on their own (the test reads every message)
                    for r in [r for r in self.ranks.values() if r.replica == replica]:
                        r.proc.join(10)
                self.kill_group(replica)
                self.poll()
                if replica in expect_failure:
                    continue
                nxt = self.incarnations[replica] + 1
                self.restarts.append({"replica": replica, "t": time.time(), "incarnation": nxt})
                self.echo(f"[{time.time():.2f}] restart replica {replica} (its group was killed)")
                self.start_group(replica, restart_kills.get((replica, nxt)))
            live = [r for r in range(self.recipe.groups) if r not in expect_failure]
            restarted = not self.kills or self.incarnations[self.kills[-1]["replica"]] > self.kills[-1]["incarnation"]
            failed = all(r.proc.exitcode is not None for r in self.ranks.values() if r.replica in expect_failure) \
                and all(r in self.incarnations for r in expect_failure)
            if not done_planning and len(self.kills) >= expected_kills and not late and restarted and failed:
                if self.kills:
                    last_change = max(last_change, self.kills[-1]["t"])
                if self.healthy_since(last_change, live):
                    kill = plan.pop(0) if plan else (on_healthy(self, issued) if on_healthy else None)
                    issued += 1
                    if kill is None:
                        done_planning = True
                        self.stop_at(max(self.step_of(r) for r in live) + tail_steps)
                    else:
                        at = self.step_of(kill.replica) + 2
                        if kill.phase == "heal":  # killed in its forward, then again while its restart heals
                            self.arm(Kill(kill.replica, kill.rank, "forward", at))
                            restart_kills[(kill.replica, self.incarnations[kill.replica] + 1)] = kill
                            expected_kills += 2
                        elif kill.phase == "source":  # killed in its forward; its rank's source dies as it sends
                            # torchft picks the source among the up-to-date groups (usually the r-th (mod n) by id
                            # for group rank r, but a group that is behind heals too): arm rank r of every other
                            # group; the first to send claims the kill (_claim_source), the others disarm
                            self.arm(Kill(kill.replica, kill.rank, "forward", at))
                            for other in sorted(r for r in live if r != kill.replica):
                                self.arm(Kill(other, kill.rank, "source", issued))
                            expected_kills += 2
                        else:
                            self.arm(dataclasses.replace(kill, step=at))
                            expected_kills += 1
                        last_change = time.time()
            finished = all(r.proc.exitcode is not None and (r.done or r.replica in expect_failure)
                           for r in self.ranks.values())
            if not late and done_planning and finished:
                break
            if time.time() - start > deadline_s:
                hung = True
                self.echo(f"HANG: not done after {deadline_s} s; killing every rank")
                break
            time.sleep(0.05)
        self.poll()
        finals = {key: torch.load(r.out, weights_only=True) for key, r in self.ranks.items() if r.done}
        errors = [f"replica {e['replica']} rank {e['rank']}: {e['msg']}" for e in self.errors
                  if self.incarnations.get(e["replica"]) == e["incarnation"] and e["replica"] not in expect_failure]
        return Report(self.events, self.kills, self.restarts, finals, errors, self.errors, hung, time.time() - start)


def compare_replicas(report: Report, recipe: Recipe) -> list[str]:
    """Bitwise differences between the replicas' final parameters and optimizer state, and NaNs."""
    problems = []
    for rank in range(recipe.ranks):
        base = report.finals.get((0, rank))
        if base is None:
            problems.append(f"replica 0 rank {rank}: no final state")
            continue
        for replica in range(recipe.groups):
            other = report.finals.get((replica, rank))
            if other is None:
                problems.append(f"replica {replica} rank {rank}: no final state")
                continue
            for kind in ("params", "optim"):
                if len(other[kind]) != len(base[kind]):
                    problems.append(f"replica {replica} rank {rank}: {len(other[kind])} {kind} tensors, replica 0 "
                                    f"{len(base[kind])}")
                for i, (a, b) in enumerate(zip(base[kind], other[kind])):
                    if torch.isnan(b).any():
                        problems.append(f"replica {replica} rank {rank}: NaN in {kind}[{i}]")
                    elif not torch.equal(a, b):
                        problems.append(f"replica {replica} rank {rank}: {kind}[{i}] differs from replica 0 by "
                                        f"{(a - b).abs().max().item():.3g}")
            if other["step"] != base["step"]:
                problems.append(f"replica {replica} rank {rank}: ended at step {other['step']}, replica 0 at "
                                f"{base['step']}")
    return problems


def contributions(report: Report) -> dict[int, list[int]]:
    """Committed step ``s`` -> the replica groups whose gradients (of step ``s``'s batches) are in it: the
    groups whose ranks logged a participating ``attempt`` at manager step ``s - 1`` in the quorum the step
    committed in (a group killed in the optimizer step logged it and counts; a healing one does not). Raises
    ``ValueError`` if that differs from the participant count the committing ranks logged."""
    committed: dict[int, set[tuple[int, int]]] = {}
    attempts: dict[tuple[int, int], set[int]] = {}
    for e in report.events:
        if e["ev"] == "step" and e["committed"]:
            committed.setdefault(e["step"], set()).add((e["quorum"], e["participants"]))
        elif e["ev"] == "attempt" and e["participating"]:
            attempts.setdefault((e["step"], e["quorum"]), set()).add(e["replica"])
    out = {}
    for step, seen in sorted(committed.items()):
        if len(seen) != 1:
            raise ValueError(f"step {step} committed in several quorums or with several counts: {sorted(seen)}")
        ((quorum, participants),) = seen
        groups = sorted(attempts.get((step - 1, quorum), set()))
        if len(groups) != participants:
            raise ValueError(f"step {step} (quorum {quorum}): {participants} participants counted, but groups "
                             f"{groups} logged a participating attempt")
        out[step] = groups
    return out


def summarize(report: Report, groups: int) -> list[dict[str, Any]]:
    """Per kill: the victim, the phase, seconds from the kill to the survivors' next committed step without
    the victim (a step the victim had already voted for may still commit with it: a kill in the optimizer
    step), the step attempts that did not commit in between (the most of any surviving rank), and the heal
    (seconds from the restart to the state applied, split at the moment every restarted rank was ready to
    train (process start, model, manager: its startup), seconds of the transfer, the step it healed to)."""
    rows = []
    for kill in report.kills:
        t, victim = kill["t"], kill["replica"]
        survivor = [e for e in report.events if e["ev"] == "step" and e["replica"] != victim and e["t"] > t]
        nxt = next((e for e in survivor if e["committed"] and e["participants"] < groups), None)
        failed: dict[tuple[int, int], int] = {}  # per surviving rank: its step attempts that did not commit
        for e in survivor:
            if not e["committed"] and (nxt is None or e["t"] <= nxt["t"]):
                failed[(e["replica"], e["rank"])] = failed.get((e["replica"], e["rank"]), 0) + 1
        lost = max(failed.values(), default=0)
        restart = next((r for r in report.restarts if r["replica"] == victim and r["t"] >= t), None)
        heal = None if restart is None else next(
            (e for e in report.events if e["ev"] == "heal" and e["replica"] == victim
             and e["incarnation"] == restart["incarnation"]), None)
        ups = [] if restart is None else [e["t"] for e in report.events if e["ev"] == "up" and e["replica"] == victim
                                          and e["incarnation"] == restart["incarnation"]]
        ready = max(ups) if len(ups) == len({e["rank"] for e in report.events if e["ev"] == "up"}) else None
        rows.append({"replica": victim, "rank": kill["rank"], "phase": kill["phase"], "step": kill["step"],
                     "to_next_commit_s": None if nxt is None else nxt["t"] - t,
                     "quorum_after": None if nxt is None else nxt["participants"], "steps_lost": lost,
                     "restart_to_healed_s": None if heal is None else heal["t"] - restart["t"],  # type: ignore[index]
                     "restart_to_ready_s": None if heal is None or ready is None else ready - restart["t"],  # type: ignore[index]
                     "ready_to_healed_s": None if heal is None or ready is None else heal["t"] - ready,
                     "recv_s": None if heal is None else heal.get("recv_s"),
                     "healed_to_step": None if heal is None else heal["step"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kill", action="append", metavar="REPLICA:RANK:PHASE",
                    help=f"a kill, in order (phases: {', '.join(PHASES)}); default 1:0:forward then 0:1:heal")
    ap.add_argument("--steps", type=int, default=6, help="steps to train after the last kill healed")
    ap.add_argument("--torchrun", action="store_true", help="run replica group 1 under torchrun --max-restarts")
    ap.add_argument("--worker", type=Path, metavar="CONFIG", help=argparse.SUPPRESS)  # a rank under torchrun
    args = ap.parse_args(argv)
    if args.worker is not None:
        config = json.loads(args.worker.read_text())
        rank = int(os.environ["RANK"])
        out = Path(config["workdir"]) / f"r{config['replica']}_g{rank}.pt"
        worker(Recipe.from_json(config["recipe"]), config["replica"], rank, None, config["lighthouse"], str(out),
               None, config["launcher"])
        return 0
    plan = []
    for text in args.kill or ["1:0:forward", "0:1:heal"]:
        replica, rank, phase = text.split(":")
        if phase not in PHASES:
            ap.error(f"unknown phase {phase!r} in --kill {text}; expected one of {PHASES}")
        plan.append(Kill(int(replica), int(rank), phase))
    recipe = Recipe(hold=True, step_sleep=0.05, launchers=("fork", "torchrun") if args.torchrun else ())
    workdir = Path(tempfile.mkdtemp(prefix="fully_shard_ft_"))
    print(f"lighthouse on 127.0.0.1 + {recipe.groups} replica groups x {recipe.ranks} CPU ranks (gloo); kills: "
          + ", ".join(f"replica {k.replica} rank {k.rank} during {k.phase}" for k in plan), flush=True)
    cluster = Cluster(recipe, workdir, echo=lambda line: print(line, flush=True))
    try:
        report = cluster.run(plan=plan, deadline_s=400, tail_steps=args.steps)
    finally:
        cluster.close()
    problems = compare_replicas(report, recipe) + report.errors + (["hang"] if report.hung else [])
    for row in summarize(report, recipe.groups):
        nxt = "no commit" if row["to_next_commit_s"] is None else \
            f"{row['to_next_commit_s']:.2f} s (quorum of {row['quorum_after']}, {row['steps_lost']} step(s) lost)"
        heal = "" if row["restart_to_healed_s"] is None else \
            f"; restarted group healed to step {row['healed_to_step']} {row['restart_to_healed_s']:.2f} s after " \
            f"its restart (transfer {row['recv_s']:.3f} s)"
        print(f"kill of replica {row['replica']} during {row['phase']}: survivors' next committed step after {nxt}"
              + heal)
    if problems:
        print("PROBLEMS:\n  " + "\n  ".join(problems))
    else:
        print(f"every replica ended at step {report.finals[(0, 0)]['step']}: parameters and optimizer state bitwise "
              f"equal on all {len(report.finals)} ranks")
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    from examples import fault_tolerant as _module  # the workers unpickle `worker` from the module, not __main__

    raise SystemExit(_module.main())
