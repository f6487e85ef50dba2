"""fully_shard.ft on 2 gloo ranks with a stand-in manager (tests/ft/common.py): the checks of
``fault_tolerant()``, the optimizer state made without a step, the recovery state captured and applied
on the training thread (all or nothing, read by torchft's thread without touching FSDP), and the
optimizer wrapper's phases and votes. The real torchft runs in test_cluster.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn as nn

from fully_shard.ft import (
    FaultTolerantOptimizer,
    Phase,
    RecoveryState,
    ReplicaAllReduce,
    ShardLayoutError,
    create_optimizer_state,
    fault_tolerant,
)
from tests.distributed.harness import distributed
from tests.ft.common import FakeManager, build, local_state, same, train_step


def _raises(fn: Any, kind: type[BaseException]) -> str:
    with pytest.raises(kind) as info:
        fn()
    return str(info.value)


# --- fault_tolerant(): what it refuses, what it sets up --------------------------------------------------
@distributed(world_size=2)
def test_refuses_init_sync_with_the_async_quorum_and_changes_nothing() -> None:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    msg = _raises(lambda: fault_tolerant(model, opt, manager=FakeManager(init_sync=True)), ValueError)
    assert "init_sync=True" in msg and "step 0" in msg and "init_sync=False" in msg and "use_async_quorum=False" in msg
    assert not opt.state  # nothing created, no hook set
    assert all(g.reducer.settings.all_reduce_hook is None for m in model.modules() if hasattr(m, "_groups")
               for g in m._groups())
    # the synchronous quorum heals before the forward: init_sync=True is right there
    assert isinstance(fault_tolerant(model, opt, manager=FakeManager(async_quorum=False, init_sync=True)),
                      FaultTolerantOptimizer)


@distributed(world_size=2)
def test_refuses_what_recovery_cannot_keep_consistent() -> None:
    model = build()
    opt = torch.optim.AdamW(model.parameters())
    msg = _raises(lambda: fault_tolerant(model, opt, manager=object()), TypeError)
    assert "torchft.Manager" in msg and "allreduce" in msg
    wrapped = fault_tolerant(model, opt, manager=FakeManager())
    assert "already wrapped" in _raises(lambda: fault_tolerant(build(), wrapped, manager=FakeManager()), TypeError)
    # a trainable parameter outside every unit: its gradient would never be averaged across replicas
    loose = build()
    loose.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    msg = _raises(lambda: fault_tolerant(loose, torch.optim.SGD(loose.parameters(), lr=0.1), manager=FakeManager()),
                  ValueError)
    assert "'extra'" in msg and "not sharded" in msg
    # an optimizer over parameters that are not the model's
    other = build()
    msg = _raises(lambda: fault_tolerant(other, torch.optim.SGD(build().parameters(), lr=0.1), manager=FakeManager()),
                  ValueError)
    assert "param group 0" in msg and "not the model's" in msg
    # a foreign all-reduce hook would be silently replaced
    hooked = build()
    hooked[0].set_all_reduce_hook(lambda t: None)
    msg = _raises(lambda: fault_tolerant(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), manager=FakeManager()),
                  ValueError)
    assert "unit '0'" in msg and "already has an all-reduce hook" in msg
    # a manager built with its own state callbacks: read on torchft's thread, loaded before the vote
    own = FakeManager()
    own.register_state_dict_fn("default", lambda _: None, lambda: {})
    plain = build()
    plain_opt = torch.optim.AdamW(plain.parameters())
    msg = _raises(lambda: fault_tolerant(plain, plain_opt, manager=own), ValueError)
    assert "['default']" in msg and "load_state_dict=None, state_dict=None" in msg and "stateful=" in msg
    assert not plain_opt.state and list(own.loads) == ["default"]  # nothing created, nothing registered
    # the state key is registered once per manager
    manager = FakeManager()
    first = build()
    fault_tolerant(first, torch.optim.SGD(first.parameters(), lr=0.1), manager=manager)
    second = build()
    msg = _raises(lambda: fault_tolerant(second, torch.optim.SGD(second.parameters(), lr=0.1), manager=manager),
                  ValueError)
    assert "already holds a state" in msg


@distributed(world_size=2)
def test_every_unit_gets_the_replica_all_reduce() -> None:
    model = build()
    manager = FakeManager()
    opt = fault_tolerant(model, torch.optim.AdamW(model.parameters()), manager=manager)
    hooks = {id(g.reducer.settings.all_reduce_hook) for m in model.modules() if hasattr(m, "_groups")
             for g in m._groups()}
    assert len(hooks) == 1 and isinstance(model[0]._groups().__next__().reducer.settings.all_reduce_hook,
                                          ReplicaAllReduce)
    train_step(model, opt, 0)
    from fully_shard.core.state import states_under

    groups = sum(len(state.groups) for _, state in states_under(model))
    assert groups == 2 and manager.allreduced == groups  # one per unit with parameters, per backward


# --- optimizer state without a step -----------------------------------------------------------------------
@distributed(world_size=2)
def test_optimizer_state_created_without_shifting_the_step_count() -> None:
    for make in (lambda ps: torch.optim.AdamW(ps, lr=0.05), lambda ps: torch.optim.Adam(ps, lr=0.05, amsgrad=True),
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
        eager, lazy = build(), build()
        eager_opt, lazy_opt = make(eager.parameters()), make(lazy.parameters())
        assert create_optimizer_state(eager_opt) == 4
        steps = [float(s["step"]) for s in eager_opt.state.values() if "step" in s]
        assert steps in ([0.0] * 4, [])
        assert not lazy_opt.state
        for i in range(3):
            train_step(eager, eager_opt, i)
            train_step(lazy, lazy_opt, i)
        assert same(local_state(eager, eager_opt), local_state(lazy, lazy_opt)), type(eager_opt).__name__
        if steps:
            assert {float(s["step"]) for s in eager_opt.state.values()} == {3.0}
    # a dampened momentum buffer is made from the first gradient: not pre-created (recovery creates it)
    damp = torch.optim.SGD(build().parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    assert create_optimizer_state(damp) == 0


# --- RecoveryState: capture, serve, check, apply --------------------------------------------------------------
def _recovery(model: nn.Module, opt: torch.optim.Optimizer, errors: list[Exception] | None = None) -> RecoveryState:
    import torch.distributed as dist

    return RecoveryState(model, opt, group_rank=dist.get_rank(), group_world_size=dist.get_world_size(),
                         report_error=None if errors is None else errors.append)


def _transport(served: dict[str, Any]) -> dict[str, Any]:
    manager = FakeManager()
    manager.register_state_dict_fn("x", lambda _: None, lambda: served)
    return manager.serve()["user"]["x"]


@distributed(world_size=2)
def test_apply_restores_the_captured_step_exactly() -> None:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    create_optimizer_state(opt)
    for i in range(2):
        train_step(model, opt, i)
    recovery = _recovery(model, opt)
    recovery.capture()
    sent = _transport(recovery.state_dict())  # a copy, as a peer receives it
    at_capture = local_state(model, opt)
    opt.param_groups[0]["lr"] = 0.5  # a scheduler moved it since
    train_step(model, opt, 2)
    assert not same(local_state(model, opt), at_capture)
    recovery.load_state_dict(sent)
    assert recovery.has_pending and recovery.error is None
    assert not same(local_state(model, opt), at_capture)  # checked and kept: nothing written yet
    assert recovery.apply_pending()
    assert same(local_state(model, opt), at_capture)
    assert opt.param_groups[0]["lr"] == 0.05
    # a joiner whose optimizer has no state yet gets the entries created like its first step would
    fresh = build(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    joiner = _recovery(fresh, fresh_opt)
    joiner.load_state_dict(_transport(sent))
    assert joiner.apply_pending()
    assert same(local_state(fresh, fresh_opt), at_capture)
    for i in range(3, 5):  # and trains on exactly as the source does
        train_step(model, opt, i)
        train_step(fresh, fresh_opt, i)
    assert same(local_state(fresh, fresh_opt), local_state(model, opt))


@distributed(world_size=2)
def test_a_state_that_does_not_fit_is_refused_whole() -> None:
    source = build()
    source_opt = torch.optim.AdamW(source.parameters())
    create_optimizer_state(source_opt)
    train_step(source, source_opt, 0)
    served = _recovery(source, source_opt)
    served.capture()
    good = served.state_dict()
    target = build(seed=3)
    target_opt = torch.optim.AdamW(target.parameters())
    create_optimizer_state(target_opt)
    before = local_state(target, target_opt)

    def refused(received: Any, *expected: str) -> None:
        errors: list[Exception] = []
        recovery = _recovery(target, target_opt, errors)
        recovery.load_state_dict(received)
        assert not recovery.has_pending and isinstance(recovery.error, ShardLayoutError)
        assert errors == [recovery.error]  # reported to the manager: the group's vote fails
        msg = str(recovery.error)
        for text in expected:
            assert text in msg, msg
        assert "Nothing was written" in msg
        assert not recovery.apply_pending()
        assert same(local_state(target, target_opt), before)

    cols = build(cols=True)  # the same model sharded along dim 1
    cols_opt = torch.optim.AdamW(cols.parameters())
    create_optimizer_state(cols_opt)
    other = _recovery(cols, cols_opt)
    other.capture()
    refused(_transport(other.state_dict()), "laid out differently", "param:0.weight", "Shard(dim=1)", "Shard(dim=0)")
    wide = build(hidden=14)  # another model
    wide_opt = torch.optim.AdamW(wide.parameters())
    wide_served = _recovery(wide, wide_opt)
    wide_served.capture()
    refused(_transport(wide_served.state_dict()), "param:0.weight", "[12, 6]", "[14, 6]")
    refused({"format": "something else"}, "not a 'fully_shard.ft/1' recovery state")
    broken = _transport(good)
    broken["tensors"][1] = torch.zeros(2, 2)
    refused(broken, "param:0.bias", "received float32[2, 2]")
    broken = _transport(good)
    broken["optimizer"]["param_index"] = [[0, 1], [2, 3]]
    refused(broken, "other param groups")
    broken = _transport(good)
    broken["optimizer"]["entries"][2]["sharded"]["exp_avg"] = torch.zeros(1)
    refused(broken, "param:2.weight", "optimizer state 'exp_avg'")
    sgd_source = torch.optim.SGD(source.parameters(), lr=0.1)
    sgd_served = _recovery(source, sgd_source)
    sgd_served.capture()
    refused(_transport(sgd_served.state_dict()), "param group 0", "another optimizer class")
    # and the good one is taken
    recovery = _recovery(target, target_opt)
    recovery.load_state_dict(_transport(good))
    assert recovery.apply_pending()
    assert same(local_state(target, target_opt), local_state(source, source_opt))


@distributed(world_size=2)
def test_torchft_thread_reads_the_capture_without_touching_fsdp() -> None:
    """The quorum thread asks for the state in the middle of a forward (units unsharded): it gets the
    step-boundary references, no unit is resharded, no collective runs; a load on that thread is refused."""
    from fully_shard.tools.watch import CollectiveWatch

    class Count(CollectiveWatch):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def on_collective(self, op: str, args: tuple) -> None:
            self.ops.append(op)

    model = build()
    opt = torch.optim.AdamW(model.parameters())
    create_optimizer_state(opt)
    train_step(model, opt, 0)
    recovery = _recovery(model, opt)
    recovery.capture()
    expected = local_state(model, opt)
    seen: dict[str, Any] = {}

    def from_quorum_thread(module: nn.Module, args: Any) -> None:
        def read() -> None:
            with Count() as watch:
                seen["state"] = recovery.state_dict()
            seen["collectives"] = watch.ops
            seen["torch_style"] = model.state_dict()  # what torchtitan's callback reads there (not used by us)
            try:
                recovery.load_state_dict(seen["state"])
            except RuntimeError as e:
                seen["load_error"] = str(e)
        seen["before"] = (model[0].fsdp_state_name, model[2].fsdp_state_name)
        thread = threading.Thread(target=read, name="torchft_quorum")
        thread.start()
        thread.join(30)
        seen["after"] = (model[0].fsdp_state_name, model[2].fsdp_state_name)

    handle = model[2].register_forward_pre_hook(from_quorum_thread)
    nn.functional.mse_loss(model(torch.randn(3, 6)), torch.randn(3, 5)).backward()
    handle.remove()
    assert seen["before"] == seen["after"] == ("SHARDED", "UNSHARDED"), (seen["before"], seen["after"])
    assert seen["collectives"] == []
    served = seen["state"]["tensors"][:4]
    assert same([t.clone() for t in served], expected[:4])
    assert "torchft_quorum" in seen["load_error"] and "training thread" in seen["load_error"]
    # the hazard avoided: mid-forward, model.state_dict() holds the gathered weight of the running unit
    from torch.distributed.tensor import DTensor

    assert isinstance(seen["torch_style"]["0.weight"], DTensor)
    assert not isinstance(seen["torch_style"]["2.weight"], DTensor) and seen["torch_style"]["2.weight"].shape == (5, 12)


@distributed(world_size=2)
def test_buffers_a_forward_writes_are_served_as_they_were_at_the_capture() -> None:
    """BatchNorm's running statistics change in the forward, while torchft's thread may be serving the
    capture: the served buffers are the step boundary's."""
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recovery = _recovery(model, opt)
    recovery.capture()
    at_capture = [b.clone() for b in model.buffers()]
    served = recovery.state_dict()["tensors"][-3:]  # running_mean, running_var, num_batches_tracked
    model(torch.randn(4, 6))
    assert not torch.equal(model[1].running_mean, at_capture[0])  # the forward wrote them
    assert all(torch.equal(s, b) for s, b in zip(served, at_capture))


# --- the optimizer wrapper: phases, votes, heals --------------------------------------------------------------
def _peer_state(seed: int, steps: int, *, cols: bool = False) -> tuple[dict[str, Any], list[torch.Tensor]]:
    peer = build(seed, cols=cols)
    manager = FakeManager()
    opt = fault_tolerant(peer, torch.optim.AdamW(peer.parameters(), lr=0.05), manager=manager)
    for i in range(steps):
        train_step(peer, opt, i)
    return manager.serve(), local_state(peer, opt.optim)


def _heal_step(opt: FaultTolerantOptimizer, model: nn.Module) -> None:
    """A step of a healing replica: its gradients are dropped (torchft zeroes them) before the step."""
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(2, 6)), torch.randn(2, 5)).backward()
    for p in model.parameters():
        p.grad = None
    opt.step()


@distributed(world_size=2)
def test_heal_is_written_only_when_the_group_commits() -> None:
    sent, peer_state = _peer_state(seed=0, steps=3)
    for async_quorum in (True, False):
        model = build(seed=5)
        manager = FakeManager(async_quorum=async_quorum)
        opt = fault_tolerant(model, torch.optim.AdamW(model.parameters(), lr=0.05), manager=manager)
        train_step(model, opt, 0)
        own = local_state(model, opt.optim)
        if async_quorum:  # the vote fails (a peer died): nothing written, the step count put back
            manager.incoming, manager.vote = sent, False
            _heal_step(opt, model)
            assert opt.committed is False and opt.healed == 0
            assert same(local_state(model, opt.optim), own) and manager.step == 1
            manager.vote = True
        manager.incoming = sent
        _heal_step(opt, model)
        assert opt.healed == 1 and manager.step == 4
        assert same(local_state(model, opt.optim), peer_state)
        assert opt.phase is Phase.IDLE


@distributed(world_size=2)
def test_a_joiner_with_another_layout_fails_after_the_vote_unchanged() -> None:
    sent, _ = _peer_state(seed=0, steps=2, cols=True)
    model = build(seed=5)
    manager = FakeManager()
    opt = fault_tolerant(model, torch.optim.AdamW(model.parameters(), lr=0.05), manager=manager)
    train_step(model, opt, 0)
    own = local_state(model, opt.optim)
    manager.incoming = sent
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(2, 6)), torch.randn(2, 5)).backward()
    msg = _raises(opt.step, ShardLayoutError)
    assert "laid out differently" in msg and "param:0.weight" in msg
    assert manager.calls[-1] == "should_commit" and len(manager.errors) == 1  # the group voted no first
    assert opt.committed is False and manager.step == 1  # put back: this replica is still at its own step
    assert same(local_state(model, opt.optim), own)
    assert opt.phase is Phase.FAILED
    assert "must be restarted" in _raises(opt.zero_grad, ShardLayoutError)


@distributed(world_size=2)
def test_phases_are_guarded() -> None:
    model = build()
    opt = fault_tolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), manager=FakeManager())
    msg = _raises(opt.step, RuntimeError)
    assert "expected phase STEP, found IDLE" in msg and "zero_grad()" in msg
    opt.zero_grad()
    assert "expected phase IDLE, found STEP" in _raises(opt.zero_grad, RuntimeError)
    assert "closures" in _raises(lambda: opt.step(lambda: 0.0), TypeError)
    assert "add_param_group" in _raises(lambda: opt.add_param_group({"params": []}), RuntimeError)
