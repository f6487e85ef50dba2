"""What spans a root's units and several roots: ``reset_iter_state`` after a failed step, ``share_comm_ctx``.

See design/hooks.md ("Recovering from an exception") and design/streams.md ("Several roots").
"""

from __future__ import annotations

from ..comm.streams import CommContext
from . import finalize
from .state import FSDPState, TrainingState, states_under


def reset_iter_state(state: FSDPState) -> None:
    """After an exception aborted a forward or backward: wait for the collectives in flight (every
    rank issued them), drop the failed step's in-flight reductions, HSDP partial sums and no-sync
    accumulators, reshard every unit and clear the per-iteration trackers, so the next step runs as if
    the failed one never started. Sharded ``.grad`` already assigned before the failure are kept (as in
    torch): call ``optimizer.zero_grad()`` before the next step."""
    root = state.root
    if root is None:  # never ran: nothing to reset
        return
    if not state.is_root:
        raise RuntimeError(f"reset_iter_state must be called on the root FSDP module; "
                           f"{state.fqn or type(state.modules[0]).__name__!r} is not a root. "
                           "Fix: call it on the module the outermost fully_shard was applied to.")
    finalize.reset(root)  # (raises, changing nothing, for a reduction another root owns)
    for st in root.states:
        for group in st.groups:
            group.reset()
        st.training_state = TrainingState.IDLE
        st._modules_to_run = set()
        st._awaits_post_backward = False
    root.reduces.discard()
    root.ctx.discard_in_flight()
    root.callback_queued = False  # autograd drops a failed backward's queued callbacks
    root.reduce_callback_queued = False
    if not root.order_frozen:  # the first forward failed: record the order again
        root.forward_order.clear()
        root.post_forward_order.clear()


def share_comm_ctx(states: list[FSDPState]) -> None:
    """Let several roots (pipeline-parallel model chunks, each its own fully_shard root) share one
    communication context: the same streams and the same all-gather / reduce-scatter buffer
    bookkeeping, so buffers are not fragmented across per-root streams. Call it on every rank, before
    or after the first forward; each root keeps its own forward order and reduce queue."""
    if not states:
        return
    first = states[0]
    ctx = first.root.ctx if first.root is not None else (first.shared_ctx or CommContext(first.device))
    for st in states:
        if st.device != ctx.device:
            raise ValueError(f"share_comm_ctx: modules on {ctx.device} and {st.device}; one context serves "
                             "one device. Fix: pass modules of one device.")
        _use_ctx(st, ctx)


def _use_ctx(state: FSDPState, ctx: CommContext) -> None:
    for module in state.modules:
        for _, sub in states_under(module):
            sub.shared_ctx = ctx
    if state.root is None:
        return  # lazy init picks it up (RootContext)
    state.root.ctx = ctx
    for st in state.root.states:
        for group in st.groups:
            group.ctx = ctx
