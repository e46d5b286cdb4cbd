"""Units left gathered past their compute, and a backward that never ended.

ZeRO-3 frees a unit's full parameters as soon as its forward or backward is
done; a few paths leave them gathered for a while (a forward prefetch whose
unit was skipped, a forward with grad mode whose backward never came, a
create_graph backward whose graph is still to be backpropagated: see
backward_pass.post_backward_final). Before the next root forward these must not be
reused if the optimizer changed the shard since. And an exception inside
backward skips the end-of-backward callback, so the runtime is put back in a
state the next step can train from.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from . import comm, reduce, validation
from .handle import HandleState


@torch.no_grad()
def recover_from_interrupted_backward(rt):
    """An exception inside backward (caught by the user, e.g. an OOM on one
    batch) skips the end-of-backward callback. Complete the reductions already
    issued (the other ranks issued them too) and return every unit to its
    sharded, idle state so the next step trains normally instead of silently
    computing no gradients.

    The gradients are dropped, every unit's, including what earlier backwards
    accumulated since the last ``zero_grad``: by then the units that finished
    their part of the failed backward had added it in (a reduced shard, or
    autograd's own accumulation under ``no_sync``) and the others had not, so
    no unit-by-unit rule could keep exactly the completed micro-batches."""
    warnings.warn("zeroshard: the previous backward did not complete (an exception inside it?); every unit's "
                  "gradients, also those accumulated before it since the last zero_grad, were dropped and all "
                  "units were resharded. Fix: start the accumulation window again (zero_grad()).", stacklevel=3)
    # Waited for, not applied: every gradient is dropped below (and zero_grad() may have set
    # NO_SHARD's .grad, the all-reduce's own buffer, to None since)
    reduce.finish_reductions(rt.pending, apply=False)
    if rt.bucketer is not None:
        rt.bucketer.discard()  # never launched: nothing to match on the other ranks
    for state in rt.states:
        h = state._handle
        if h is None:
            continue
        h.saved_grad_shard = None
        h.flat_param.grad = None
        h.grad_reduced = False
        if h.use_orig_params:
            h.use_sharded_grad_views()  # the original parameters' grads: None
        if not h.always_full:  # NO_SHARD's low-precision copy too
            h.reshard(free=True)
        h.end_iteration()
    rt.callback_queued = False


@torch.no_grad()
def drop_nested_backward_leftovers(rt):
    """An ``autograd.grad`` inside a forward (forces = -dE/dx) runs the
    pre-backward of the units it passes through, but neither their
    post-backward (it asks for input gradients) nor the end-of-backward (queued
    from the root's pre-backward only). When no backward of that forward
    follows (an evaluation under no_grad, an output discarded), the units were
    left gathered in their backward state, which the next forward took for a
    checkpoint recomputation: it ran on stale or freed parameters. Reset them."""
    for h in rt.handles:
        if h.state in (HandleState.BACKWARD_PRE, HandleState.BACKWARD_POST):
            if h.unsharded and not h.always_full:
                h.reshard(free=True)
            h.end_iteration()


def drop_unused_prefetches(rt):
    """After a root forward without grad mode: free units a forward prefetch
    gathered but that did not run (skipped this time), and units kept for a
    reentrant checkpoint's recomputation (``recompute_ahead``), which no
    backward will run. Left gathered, their next forward would reuse the copy
    even after the optimizer changed the shard."""
    for h in rt.handles:
        if (h.prefetched or h.recompute_ahead) and h.unsharded and not h.is_root:
            h.reshard(free=True)


def drop_unused_recompute(rt) -> None:
    """At the end of the backward that recomputed this model's forward (a reentrant checkpoint
    around its root, or this model called inside another one's checkpointed region): units that
    recomputation kept for a backward of this model that never came (its output detached or
    unused) are freed, or they would stay gathered for good and be reused stale."""
    rt.recompute_checked = False
    if rt.callback_queued:  # this model's own backward runs: it frees them
        return
    for h in rt.handles:
        if h.unsharded and h.sharded and not h.always_full and not h.graph_kept:
            h.reshard(free=True)
        h.end_iteration()


@torch.no_grad()
def drop_stale_kept(rt):
    """Free units an earlier forward kept gathered for a backward that has
    not come (its output discarded, or a metric computed with grad mode on)
    if the shard changed since (optimizer.step() in between): reused, they
    would compute with the old parameters (torch FSDP1 does). Likewise units
    kept for a create_graph backward's graph. Runs when the root's last
    forward had grad mode and no backward followed, or while such a graph is
    pending (the same on every rank, except after a forward inside
    ``no_sync``, whose backward a rank with nothing to learn from may skip:
    then it runs only after an optimizer step, which every rank takes and none
    may take between such a backward and a synchronizing one; other changes
    are handled here without communication, see _edits_after_no_sync); each group
    agrees in one small all-reduce over all its units (fixed size: a rank whose
    shard holds only padding sees no change), and a unit that is stale, or not
    gathered, on any rank is freed on all, so all ranks gather the same units
    next (which units were kept differs by rank when ranks skip units by their
    data, or skip a ``no_sync`` backward that would have kept them)."""
    graph_kept = any(h.graph_kept for h in rt.handles)
    if not rt.forward_pending and not graph_kept:
        return
    rt.forward_pending = False
    # Parameters replaced since (p.data = ...): on a kept unit's full views, into its buffer and
    # shard; on the shard views a kept root shows, into the shard, which leaves its buffer stale.
    into_shard = {h for h in rt.handles if h.unsharded and h.use_orig_params and h.writeback_orig_params() and h.sharded}
    if rt.no_sync_forward_steps == validation.optimizer_steps[0] and not graph_kept:
        _edits_after_no_sync(rt, into_shard)  # the flag may be set on this rank only: no collective
        return
    groups = {}
    for h in rt.handles:
        if h.sharded:
            groups.setdefault(h.group, []).append(h)
    for group, hs in groups.items():
        changed = torch.tensor([float(not h.unsharded or h in into_shard or _stale(h)) for h in hs], device=hs[0].device)
        comm.all_reduce(changed, group, op=dist.ReduceOp.MAX, what="checking whether units kept from the last forward are stale")
        for h, c in zip(hs, changed.tolist()):
            if c and h.unsharded:
                h.reshard(free=True)


def _edits_after_no_sync(rt, into_shard) -> None:
    """A kept unit changed since a forward inside no_sync, without an optimizer step: edits of
    its exposed full views are written back to this rank's shard (computed with as they are);
    a shard changed otherwise (a manual update through the optimizer's parameters) cannot be
    re-gathered without the other ranks, which may not be checking (torch FSDP1 reuses the
    old values too): said, once."""
    for h in rt.handles:
        if h.unsharded and (h in into_shard or _stale(h)):  # (exposed views' edits are written back in there)
            warnings.warn(f"zeroshard: the parameters of unit '{h.unit_name}' changed in place, not by an optimizer "
                          "step, after a forward inside no_sync() that kept the unit gathered; its next forward "
                          "computes with the values gathered before (as torch FSDP1's). Fix: change parameters "
                          "outside the accumulation window (after its synchronizing backward).", stacklevel=5)
            h.kept_version = h.shard_version()  # said once


def _stale(h) -> bool:
    kept = h.graph_version if h.graph_kept else h.kept_version
    now = h.shard_version()
    if kept is None or now == kept:
        return False
    if now[1:] == kept[1:] and _write_back_edits(h):  # only the exposed full views changed
        if h.kept_version is not None:
            h.kept_version = now
        if h.graph_kept:
            h.graph_version = now
        return False
    return True


def _write_back_edits(h) -> bool:
    """With use_orig_params a unit kept gathered under ZeRO-2 exposes views of
    its full buffer as the module's parameters, so an in-place edit made before
    the next forward (``p.mul_(0.5)`` over ``model.parameters()`` under
    no_grad) lands in that buffer, not in the shard. Copy this rank's part back,
    as summon_full_params' writeback does, and keep the unit: it is current (it
    was freed, and the edit lost). Not where the buffer is no exact copy of the
    shard (mixed precision, the int8 all-gather: said, and freed), nor once the
    shard changed too."""
    if not (h.use_orig_params and h.unsharded):
        return False
    return _copy_own_part(h, "after a forward whose backward never came", "edit the parameters after a backward or "
                          "under torch.no_grad() forwards, or inside summon_full_params()")


def keep_forward_edits(h) -> None:
    """A forward that edits its parameters in place under no_grad (``nn.Embedding(max_norm=...)``
    renormalizes the rows it looks up) writes into the gathered buffer, which is freed right
    after: copy this rank's part back to the shard, so the edit lasts, as in a plain module
    (torch FSDP1 keeps it only while its root or a ZeRO-2 unit stays gathered)."""
    if h.forward_version is not None and h.unsharded and h.flat_param._version != h.forward_version:
        _copy_own_part(h, "by its own forward", "run that forward in full precision or edit the parameters outside "
                       "forward, inside summon_full_params()")
    h.forward_version = None


def _copy_own_part(h, when: str, fix: str) -> bool:
    """This rank's chunk of the gathered buffer back into its shard; not where the buffer
    is no exact copy of the shard (mixed precision, the int8 all-gather): said, and dropped."""
    if h.quant is not None or h._full.dtype != h.local_shard.dtype:
        warnings.warn(f"zeroshard: the parameters of unit '{h.unit_name}' were edited in place while it held its gathered "
                      f"{'int8-gathered' if h.quant is not None else str(h._full.dtype).replace('torch.', '')} copy "
                      f"({when}); the edit is discarded. Fix: {fix}.", stacklevel=5)
        return False
    start = h.rank * h.layout.shard_numel
    h.local_shard.data.copy_(h._full[start : start + h.layout.shard_numel])  # .data: no version bump
    return True
