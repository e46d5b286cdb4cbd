"""When each step of the ZeRO-3 lifecycle runs: the forward/backward hooks.

For one unit (a FullyShardedDataParallel instance with its FlatParamHandle):

  pre-forward    all-gather the unit's parameters (unless prefetched), maybe
                 prefetch the next unit's (``forward_prefetch``)
  post-forward   free them again (FULL_SHARD / HYBRID_SHARD; not the root,
                 which backward needs first), hook the outputs for the
                 pre-backward
  pre-backward   (first gradient reaching the unit's outputs) all-gather again,
                 prefetch the unit that runs backward next (BACKWARD_PRE)
  post-backward  (flat gradient accumulated) free the parameters, prefetch
                 (BACKWARD_POST), launch the reduce-scatter
  end of backward (root only, queued on the autograd engine) wait for every
                 reduction, put the reduced shards in ``.grad``, reshard stragglers

Which unit is prefetched, and the state all units under one root share, are
in ``prefetch``.

Activation checkpointing recomputes a forward during backward. A
non-reentrant recomputation runs after the unit's pre-backward has gathered
it (state BACKWARD_PRE: the forward hooks step aside); a reentrant one calls
the unit's forward from inside backward before its pre-backward, so the
post-forward keeps the parameters gathered for the backward that follows.
Either way a unit is gathered once for backward and reduced once.
"""
from __future__ import annotations

import weakref

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from . import agreement, kept, reduce, trace, validation
from .handle import RESHARD_AFTER_FORWARD, HandleState
from .hpz import drop_changed_secondaries
from .mixed_precision import buffers_for_mode, cast_buffers, remember_buffer_dtypes, tensors_in
from .options import BackwardPrefetch
from .prefetch import backward_target, prefetch, unshard_for_compute

# ----------------------------------------------------------------- forward
def root_pre_forward(state):
    rt = state._runtime
    if rt.callback_queued and torch._C._current_graph_task_id() == rt.backward_task:
        return  # a checkpoint around the whole model recomputes it inside its backward: that step goes on
    if rt.callback_queued:  # the last backward never reached its end: it raised
        kept.recover_from_interrupted_backward(rt)
    elif not _in_backward():
        kept.drop_nested_backward_leftovers(rt)
    kept.drop_unused_prefetches(rt)
    kept.drop_stale_kept(rt)
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
        if _accumulate_node(handle.flat_param) is not node:
            hook.remove()
            handle.post_backward_hook, hooked = None, False
    _hook_post_backward(state, handle)
    if not hooked and handle.post_backward_hook is not None:
        handle.forward_views = handle.installed_views  # they feed the node just hooked (module_views)
    if trace._active:
        trace.span_begin("forward", handle)
    handle.needs_pre_forward_unshard = False
    if state.forward_prefetch and not rt.first_iter and handle.pre_forward_index is not None:
        nxt = handle.pre_forward_index + 1
        if nxt < len(rt.pre_forward_order) and rt.pre_forward_order[nxt].needs_pre_forward_unshard:
            prefetch(state, rt.pre_forward_order[nxt])


def _hook_post_backward(state, handle, node=None):
    """Run ``post_backward`` when the FlatParameter's gradient is complete.

    The hook goes on the FlatParameter's AccumulateGrad node of the first
    forward of the iteration, as torch FSDP1 does. A unit run twice before one
    backward may have two nodes: under mixed precision each unshard changes
    the dtype of ``.data``, which drops autograd's cached node. The first
    forward's node runs last in backward, once every use has added its part;
    a hook on the tensor would fire at the first node and free parameters the
    other use still needs. A tensor hook only notes that a gradient arrived,
    for the end of backward to catch a node that never ran (see ``post_backward_final``).
    The hooks live in C++, out of the garbage collector's sight: they hold the unit weakly.
    """
    flat = handle.flat_param
    if not torch.is_grad_enabled() or not flat.requires_grad:
        return
    unit = weakref.ref(state)
    if not handle.accumulate_hooked:
        flat.register_post_accumulate_grad_hook(lambda p: _note_accumulated(unit()))
        flat.register_hook(lambda g: _before_accumulate(unit()))
        handle.accumulate_hooked = True
    if handle.post_backward_hook is None:
        graph = node is not None  # the node a create_graph backward's graph feeds (post_backward_final)
        node = node or _accumulate_node(flat)
        handle.post_backward_hook = (node, node.register_hook(lambda *_: post_backward(unit(), flat, graph)))


def _accumulate_node(flat):
    return flat.expand_as(flat).grad_fn.next_functions[0][0]


def _note_accumulated(state):
    if state is not None:
        state._handle.grad_accumulated = True


def _before_accumulate(state):
    if state is None:
        return
    _start_backward(state._runtime, state._is_root)
    # Between a create_graph backward and the backward through its graph, a kept unit's
    # FlatParameter is its shard (for the optimizer); the gradient coming is unsharded.
    # When no pre-backward ran (the unit's output not reached, only that graph), a reduced
    # gradient from before moves aside for it here.
    handle = state._handle
    if handle.graph_kept and handle.flat_param.data_ptr() != handle._full.data_ptr():
        handle.wait_unshard()
    if not handle.ran_pre_backward:
        handle.prepare_gradient_for_backward()
    if handle.post_backward_called and not handle.sharded:
        # More gradient after this backward reduced the unit (a reentrant checkpoint around part of
        # it): NO_SHARD all-reduces .grad in place (a bucket copies back into it), so that reduction
        # must be done before autograd adds the rest, as torch's synchronous one is.
        rt = state._runtime
        rt.pending += reduce.flush(rt.bucketer)
        reduce.finish_reductions(rt.pending)


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
    recompute = _in_backward() and (rt.callback_queued or rt.reentrant_forward)
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
    if _in_backward():
        return
    root, *inner = rt.states
    for state in [s for s in reversed(inner) if s._handle is not None and s._handle.state == HandleState.FORWARD] + [root]:
        try:  # inner units before the ones around them, the root last
            post_forward(state, None)
        except Exception:  # noqa: BLE001 - the exception unwinding the forward is the one to see
            pass


def _in_backward() -> bool:
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
        register_multi_grad_hook(tensors, lambda _grad: pre_backward(state), mode="any")


# ----------------------------------------------------------------- backward
def _start_backward(rt, from_root: bool):
    """Queue the end-of-backward callback, once per backward, from its first
    pre-backward or first gradient. Usually the root's outputs start backward;
    a loss built only from an inner unit's output (the root's unused), or only
    from a graph an earlier create_graph backward built, must still end with the
    root's callback (torch FSDP1 raises in the first case; without it gradients
    would silently stay unreduced). Not from an autograd.grad inside the root's
    forward: the callback would end the step there."""
    if rt.callback_queued or (rt.in_forward and not from_root):
        return
    rt.callback_queued = True
    rt.backward_task = torch._C._current_graph_task_id()
    rt.graph_backward = torch.is_grad_enabled()  # create_graph=True: a later backward runs through this one
    root = rt.states[0]
    Variable._execution_engine.queue_callback(lambda: post_backward_final(root))
    for h in rt.handles:
        h.reset_grad_if_orig_grads_none()
        h.note_grads_at_backward()
    drop_changed_secondaries(rt.handles)  # hpZ (collective where used)


def pre_backward(state):
    handle = state._handle
    # Once per backward, unless the unit was already reduced in it: a unit called twice in forward,
    # with a reentrant checkpoint inside, runs one inner backward per call, and the earlier call's
    # recomputation needs the full parameters again (a sharded unit freed them: gather again).
    if handle is not None and handle.ran_pre_backward:
        if not handle.post_backward_called:
            return
        exposed = handle.use_orig_params and handle.orig_exposed
        if not handle.sharded:
            if exposed:
                raise RuntimeError(
                    f"zeroshard: unit '{handle.unit_name}' (unsharded, use_orig_params=True) was called more than "
                    "once in forward with a reentrant activation checkpoint inside it: an earlier call's "
                    "recomputation would run on the original parameters after the unit was reduced, and its "
                    "gradient would be lost. Fix: checkpoint with use_reentrant=False (CheckpointImpl.NO_REENTRANT), "
                    "or use_orig_params=False, or a sharded strategy.")
            return
        if handle.unsharded:
            if not exposed:
                return
            # Kept gathered (ZeRO-2 in no_sync), but its post-backward put the sharded parameters back in
            # the modules: the recomputation needs the full views again.
            handle.needs_pre_backward_unshard = True
    rt = state._runtime
    _start_backward(rt, state._is_root)
    if handle is None:
        return
    handle.state = HandleState.BACKWARD_PRE
    handle.kept_version = None
    # A second backward through a forward whose backward already ran
    # (retain_graph=True, or an autograd.grad before it): hook the post-backward
    # anew, and gather again unless that backward built a graph and kept the
    # unit; its gradient then adds to the first one's reduced shard as an
    # accumulated micro-batch does.
    if handle.post_backward_hook is None:
        with torch.enable_grad():
            _hook_post_backward(state, handle)
    if not handle.needs_pre_backward_unshard and handle.sharded and (handle.graph_kept or not handle.unsharded):
        handle.needs_pre_backward_unshard = True
    # An unsharded unit whose last backward put the original parameters back (use_orig_params): a
    # reentrant checkpoint's recomputation must compute with views again, or its gradient lands in
    # p.grad, never all-reduced (a second backward through a retained graph).
    if not handle.sharded and handle.use_orig_params and handle.orig_exposed:
        handle.needs_pre_backward_unshard = True
    handle.refuse_replaced_full_views()  # kept gathered since its forward: changed meanwhile?
    if handle.needs_pre_backward_unshard:
        unshard_for_compute(handle)
    if trace._active:
        trace.span_begin("backward", handle)
    handle.needs_pre_backward_unshard = False
    if state.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
        prefetch(state, backward_target(rt, handle))
    handle.prepare_gradient_for_backward()
    handle.ran_pre_backward = True


def _free_in_backward(state, handle) -> bool:
    # Outside no_sync every sharded unit frees after its backward. Inside it,
    # ZeRO-2 keeps the parameters (memory for speed: the next forward needs them).
    return handle.sharded and (state._sync_gradients or handle.strategy in RESHARD_AFTER_FORWARD)


@torch.no_grad()
def post_backward(state, flat_param, through_graph=False):
    handle = state._handle
    handle.post_backward_called = True
    handle.state = HandleState.BACKWARD_POST
    if trace._active:
        trace.span_end("backward", handle)
    if flat_param.grad is None:
        return
    if flat_param.grad.requires_grad:
        raise RuntimeError(
            f"zeroshard: backward(create_graph=True) reached the parameters of unit '{handle.unit_name}': "
            "gradients of their gradients are not supported (the reduced gradients are shards). For a "
            "gradient penalty, take the gradient with torch.autograd.grad(out, inputs, create_graph=True) "
            "(or backward(inputs=..., create_graph=True)) and call backward() on the penalty as usual.")
    free = _free_in_backward(state, handle)
    if handle.graph_node is not None:  # a create_graph backward's graph holds this unit (post_backward_final)
        if through_graph:  # this backward reached the node that graph feeds: done with it
            handle.graph_node, handle.graph_kept = None, False
        else:  # another backward: the graph still needs the full parameters
            free = False
    handle.reshard(free)
    if state.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        prefetch(state, backward_target(state._runtime, handle))
    validation.note_unreduced(handle, (handle.sharded or handle.world_size > 1) and not state._sync_gradients)
    if not state._sync_gradients:
        if handle.use_orig_params:
            handle.fold_outside_grads()
            handle.use_unsharded_grad_views()
        return
    if handle.use_orig_params:
        handle.gradients_computed()
        handle.detach_grad_views()
    rt = state._runtime
    rt.pending += reduce.start_reduction(handle, rt.bucketer)
    reduce.settle_earlier(rt.pending)


@torch.no_grad()
def post_backward_final(root):
    rt = root._runtime
    for state in rt.states:
        h = state._handle
        # A gradient reached a node other than the hooked one (whose forward's graph backward
        # never reached, e.g. a forward with no backward before this one): finish it now.
        if h is not None and h.grad_accumulated and not h.post_backward_called:
            post_backward(state, h.flat_param)
    rt.pending += reduce.flush(rt.bucketer)
    reduce.finish_reductions(rt.pending)
    agreement.check_same_order(root)
    for state in rt.states:
        handle = state._handle
        if handle is not None:
            if trace._active:  # a unit whose post-backward hook never ran
                trace.span_end("backward", handle)
            # Still gathered (outputs unused by the loss, a frozen unit), or views left in place of the
            # original parameters (a frozen NO_SHARD unit: no post-backward re-registered them).
            # A backward with create_graph=True (a gradient penalty) keeps the full parameters of the
            # units it gathered: the graph it built holds them for the backward still to come. The
            # post-backward waits for the node that graph feeds, taken before the reshard: under mixed
            # precision a new dtype of .data gives later forwards other nodes, which run first.
            if rt.graph_backward and handle.ran_pre_backward:
                if handle.flat_param.requires_grad:
                    with torch.enable_grad():
                        handle.graph_node = _accumulate_node(handle.flat_param)
                # A frozen unit's parameters are in that graph too (the input gradients flow through
                # them), but no node of theirs tells when it has run: kept until a later backward without
                # create_graph ends.
                handle.graph_kept = handle.unsharded and handle.sharded
                handle.graph_version = handle.shard_version()
            elif handle.graph_kept and not handle.flat_param.requires_grad and not rt.graph_backward:
                # The backward through the graph has run (frozen: see above); not another create_graph
                # backward that did not reach the unit: the first graph still holds it.
                handle.graph_kept = False
            if (handle.unsharded and not handle.always_full) or (handle.use_orig_params and not handle.orig_exposed):
                handle.reshard(not handle.graph_kept and _free_in_backward(state, handle))
            handle.secondary = None
            if handle.flat_param.requires_grad and state._sync_gradients:
                handle.prepare_gradient_for_optim()
            handle.end_iteration()
            if handle.graph_node is not None:
                with torch.enable_grad():
                    _hook_post_backward(state, handle, handle.graph_node)
    rt.first_iter = False
    rt.callback_queued = False
    rt.forward_pending = False
