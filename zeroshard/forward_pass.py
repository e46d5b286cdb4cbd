"""ZeRO-3's forward: the hooks around each unit's forward.

For one unit (a FullyShardedDataParallel instance with its FlatParamHandle):

  root pre-forward  once per step, before any unit: units left gathered from
                    before (an unused prefetch, a backward that raised, a shard
                    the optimizer changed) are dealt with (``kept``)
  pre-forward       all-gather the unit's parameters (unless prefetched), maybe
                    prefetch the next unit's (``forward_prefetch``), hook the
                    FlatParameter's gradient node for the post-backward
  post-forward      free them again (FULL_SHARD / HYBRID_SHARD; not the root,
                    which backward needs first), hook the outputs for the
                    pre-backward

The backward half (pre-backward, post-backward, end of backward) is in
``backward_pass``; which unit is prefetched, and the state all units under one root
share, are in ``prefetch``.

Activation checkpointing recomputes a forward during backward. A
non-reentrant recomputation runs after the unit's pre-backward has gathered
it (state BACKWARD_PRE: the forward hooks step aside); a reentrant one calls
the unit's forward from inside backward before its pre-backward, so the
post-forward keeps the parameters gathered for the backward that follows.
Either way a unit is gathered once for backward and reduced once.
"""
from __future__ import annotations

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from . import backward_pass, kept, trace, validation
from .handle import RESHARD_AFTER_FORWARD, HandleState
from .mixed_precision import buffers_for_mode, cast_buffers, remember_buffer_dtypes, tensors_in
from .prefetch import prefetch, unshard_for_compute


def root_pre_forward(state):
    rt = state._runtime
    if rt.callback_queued and torch._C._current_graph_task_id() == rt.backward_task:
        return  # a checkpoint around the whole model recomputes it inside its backward: that step goes on
    if rt.callback_queued:  # the last backward never reached its end: it raised
        kept.recover_from_interrupted_backward(rt)
    elif not in_backward():
        kept.drop_nested_backward_leftovers(rt)
    kept.drop_unused_prefetches(rt)
    kept.drop_stale_kept(rt)
    if not rt.parameters_checked and not any(s._summoning for s in rt.states):
        validation.refuse_unmanaged_parameters(rt.states)
        rt.parameters_checked = True
    rt.post_forward_order.clear()
    if any(h.param_dtype_now() != h.dtype for h in rt.handles):  # module.to(dtype) cast the buffers too:
        if state.__dict__.get("_buffers_in_full_precision"):  # in their own dtype now (eval): it is the new one
            remember_buffer_dtypes(state)
        else:  # back to buffer_dtype, the new dtype remembered
            cast_buffers(rt.states)
    buffers_for_mode(state, rt.states)
    for h in rt.handles:
        h.post_forward_index = None
        h.secondary = None  # hpZ: from before the optimizer step, stale
        h.reset_grad_if_orig_grads_none()
        if state.forward_prefetch:
            h.needs_pre_forward_unshard = True
            h.prefetched = False


def pre_forward(state):
    handle = state._handle
    if handle is None:
        return
    if handle.state == HandleState.BACKWARD_PRE:  # recomputation (checkpointing)
        return
    rt = state._runtime
    validation.refuse_forward_inside_summon(handle)
    validation.refuse_replaced_flat_param(handle)
    handle.state = HandleState.FORWARD
    if rt.first_iter and handle.pre_forward_index is None:
        handle.pre_forward_index = len(rt.pre_forward_order)
        rt.pre_forward_order.append(handle)
    unshard_for_compute(handle)
    handle.forward_version = handle.flat_param._version if handle.sharded else None  # (kept.keep_forward_edits)
    hooked = handle.post_backward_hook is not None
    if hooked and handle.post_backward_called and torch.is_grad_enabled() and handle.flat_param.requires_grad:
        # Run again in the backward that already reduced it (a reentrant checkpoint around it, one
        # recomputation per forward; or any forward with grad mode inside that backward): under mixed
        # precision the gather gave .data another dtype, so this gradient comes through a new
        # AccumulateGrad node. The spent hook moves there, or the gradient would never be reduced.
        node, hook = handle.post_backward_hook
        if backward_pass.accumulate_node(handle.flat_param) is not node:
            hook.remove()
            handle.post_backward_hook, hooked = None, False
    backward_pass.hook_post_backward(state, handle)
    if not hooked and handle.post_backward_hook is not None:
        handle.forward_views = handle.installed_views  # they feed the node just hooked (module_views)
    if trace._active:
        trace.span_begin("forward", handle)
    handle.needs_pre_forward_unshard = False
    if state.forward_prefetch and not rt.first_iter and handle.pre_forward_index is not None:
        nxt = handle.pre_forward_index + 1
        if nxt < len(rt.pre_forward_order) and rt.pre_forward_order[nxt].needs_pre_forward_unshard:
            prefetch(state, rt.pre_forward_order[nxt])


@torch.compiler.disable  # runs eagerly under torch.compile (see FullyShardedDataParallel.forward)
def post_forward(state, output):
    handle = state._handle
    if handle is not None and handle.state == HandleState.BACKWARD_PRE:
        return output
    rt = state._runtime
    # A forward run from inside this model's backward (or after a no-grad root forward on inputs
    # needing grad: a reentrant checkpoint around the root) is that checkpoint's recomputation:
    # its backward follows at once, so the parameters stay gathered for it (one all-gather, not
    # two) and the execution order recorded by the real forward is kept. Not a model run from
    # inside another one's backward (a teacher in the student's checkpointed region): no backward
    # of its own may come to free what it kept.
    recompute = in_backward() and (rt.callback_queued or rt.reentrant_forward)
    if recompute and not rt.callback_queued and not rt.recompute_checked:  # whose backward may never come
        rt.recompute_checked = True
        Variable._execution_engine.queue_callback(lambda: kept.drop_unused_recompute(rt))
    if handle is not None:
        if not recompute:
            handle.post_forward_index = len(rt.post_forward_order)
            rt.post_forward_order.append(handle)
        if trace._active:
            trace.span_end("forward", handle)
        # The root keeps its parameters for backward, which starts with it;
        # ZeRO-2 keeps them all. Without grad mode no backward will come to
        # free them, so they are freed right away; except a ZeRO-2 unit fed
        # tensors that need grad (a reentrant checkpoint: its recomputation in
        # backward reuses the gather, as in torch). A kept unit whose shard
        # changes meanwhile gathers again (kept_version).
        zero2 = handle.strategy not in RESHARD_AFTER_FORWARD
        keep = (torch.is_grad_enabled() and (state._is_root or recompute or zero2)
                or handle.recompute_ahead and zero2 and not state._is_root)
        if not keep and torch.is_grad_enabled():
            handle.keep_secondary()  # hpZ: the backward gathers from it within the group
        # ZeRO-2 units computing with grad mode keep exposing the unsharded
        # views until their backward, as torch does (its skipped sharded views):
        # model.parameters() then reads the full values the forward used.
        zero2_kept = torch.is_grad_enabled() and handle.sharded and handle.strategy not in RESHARD_AFTER_FORWARD
        free = not keep and not handle.graph_kept
        if free and handle.sharded and handle.unsharded:
            validation.refuse_outputs_on_the_freed_buffer(handle, tensors_in(output))
            kept.keep_forward_edits(handle)
        handle.reshard(free=free, sharded_views=not zero2_kept)
        if keep and handle.sharded and not recompute:
            handle.kept_version = handle.shard_version()
        # torch re-points the grads too (NO_SHARD included: a frozen parameter's grad goes back to None)
        if handle.use_orig_params and not recompute and not zero2_kept:
            handle.use_grad_views()
        handle.state = HandleState.IDLE
    if state._is_root and not torch.is_grad_enabled():  # no backward will come to free them
        kept.drop_unused_prefetches(state._runtime)
    if state._is_root and torch.is_grad_enabled() and not recompute:
        state._runtime.forward_pending = True
        # Inside no_sync: a backward runs no collective, so a rank whose loss does not reach the model
        # may skip it and keep the flag where the others clear it (kept.drop_stale_kept).
        state._runtime.no_sync_forward_steps = None if state._sync_gradients else validation.optimizer_steps[0]
    _register_pre_backward(state, output)
    return output


def end_interrupted_forward(rt):
    """An exception inside forward, caught by the user (a bad micro-batch skipped),
    skips the post-forward of the units it unwinds through: the root and the unit
    that raised stay gathered, a FlatParameter full-size (the next optimizer step
    fails on it) and, once stepped past, computing with the old parameters. Their
    forward ends here as if its output were dropped: each unit freed or kept as
    post_forward decides, a kept one gathered again if its shard changes before the
    next forward (kept.drop_stale_kept). Gradients from before are untouched.
    The root's post-forward runs even where it holds no parameters: it marks the
    forward for that check. Not inside a backward (a checkpoint's recomputation
    raised): the backward fails with it, and its own recovery frees the units. A
    second failure here (a collective that failed with the forward) is dropped,
    so the user's exception is the one raised."""
    if in_backward():
        return
    root, *inner = rt.states
    for state in [s for s in reversed(inner) if s._handle is not None and s._handle.state == HandleState.FORWARD] + [root]:
        try:  # inner units before the ones around them, the root last
            post_forward(state, None)
        except Exception:  # noqa: BLE001 - the exception unwinding the forward is the one to see
            pass


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _register_pre_backward(state, output):
    if not torch.is_grad_enabled():
        return
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    handle = state._handle
    if handle is not None:
        handle.ran_pre_backward = False
        handle.needs_pre_backward_unshard = bool(tensors)
    if tensors:
        register_multi_grad_hook(tensors, lambda _grad: backward_pass.pre_backward(state), mode="any")


