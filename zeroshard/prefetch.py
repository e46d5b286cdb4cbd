"""Which unit gathers when: the execution order, and prefetching (FSDP's forward and backward prefetch).

ZeRO-3 gathers a unit just before it computes; prefetching issues the next
unit's all-gather early, so it overlaps this unit's compute. The next unit
comes from the order recorded in the first iteration's forward
(``forward_prefetch``) and in this iteration's (backward: the unit that ran
forward just before this one runs backward just after it). ``limit_all_gathers``
caps how many units are gathered at once, as torch FSDP1's rate limiter does.
:class:`RootRuntime` holds that order and the reductions in flight, shared by
all units under one root; ``forward_pass`` and ``backward_pass`` call these at each step.
"""
from __future__ import annotations

import weakref

from . import reduce
from .bucket import Bucketer

MAX_LIVE_PREFETCH_UNITS = 2  # limit_all_gathers: non-root units unsharded at once


class RootRuntime:
    """State shared by all units under one root: execution order and the
    reductions in flight."""

    def __init__(self, states):
        self._states = [weakref.ref(s) for s in states]  # root first; weakly: a cycle would outlive `del model`
        self.handles = [s._handle for s in states if s._handle is not None]
        self.pre_forward_order: list = []  # from the first iteration
        self.post_forward_order: list = []  # this iteration
        self.first_iter = True
        self.parameters_checked = False  # validation.refuse_unmanaged_parameters, at the first forward outside summon
        self.pending: list[reduce.PendingReduction] = []
        self.callback_queued = False
        self.backward_task = -1  # autograd's id of the backward that queued the callback
        self.in_forward = False  # the root's forward is running (a nested autograd.grad may run inside it)
        self.forward_pending = False  # the root's last forward had grad mode and no backward has run since
        self.reentrant_forward = False  # the last root forward: no grad mode, inputs needing grad (post_forward)
        self.recompute_checked = False  # kept.drop_unused_recompute is queued on the running backward
        self.no_sync_forward_steps = None  # that forward ran inside no_sync: the optimizer steps then (kept.drop_stale_kept)
        self.graph_backward = False  # the running backward has create_graph=True
        cap = states[0].bucket_cap_mb  # the root's setting holds for the whole model
        self.bucketer = Bucketer(cap) if cap is not None else None

    states = property(lambda self: [s for s in (r() for r in self._states) if s is not None])


def unshard_for_compute(handle):
    """Gather ``handle`` for its forward or backward (issued earlier if it was prefetched)."""
    if not handle.prefetched:
        handle.unshard()
    handle.wait_unshard()


def prefetch(state, target):
    """Issue ``target``'s all-gather now, unless it is gathered or in flight, or the rate limit holds."""
    if target is None or target.prefetched or target.unsharded:
        return
    if state.limit_all_gathers and live_non_root(state._runtime) >= MAX_LIVE_PREFETCH_UNITS:
        return  # rate limit: the unit will unshard on demand instead
    target.unshard()
    target.prefetched = True


def live_non_root(rt) -> int:
    # Counted per model: another model's gathered units must not throttle this one.
    return sum(h.unsharded and h.sharded and not h.is_root for h in rt.handles)


def backward_target(rt, handle):
    """The unit whose backward comes after ``handle``'s: the one that ran forward just before it."""
    i = handle.post_forward_index
    if i is None or i == 0:
        return None
    target = rt.post_forward_order[i - 1]
    return target if target.needs_pre_backward_unshard else None
