"""ZeRO-3's backward: gather again, reduce-scatter, free.

For one unit (a FullyShardedDataParallel instance with its FlatParamHandle),
hooked during its forward (``forward_pass``):

  pre-backward    (first gradient reaching the unit's outputs) all-gather
                  again, prefetch the unit that runs backward next
                  (BACKWARD_PRE)
  post-backward   (flat gradient accumulated, on the FlatParameter's
                  AccumulateGrad node) free the parameters, prefetch
                  (BACKWARD_POST), launch the reduce-scatter
  end of backward (root only, queued on the autograd engine) wait for every
                  reduction, put the reduced shards in ``.grad``, reshard
                  stragglers, keep what a create_graph backward's graph holds
"""
from __future__ import annotations

import weakref

import torch
from torch.autograd import Variable

from . import agreement, reduce, trace, validation
from .handle import RESHARD_AFTER_FORWARD, HandleState
from .hpz import drop_changed_secondaries
from .options import BackwardPrefetch
from .prefetch import backward_target, prefetch, unshard_for_compute


def hook_post_backward(state, handle, node=None):
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
        node = node or accumulate_node(flat)
        handle.post_backward_hook = (node, node.register_hook(lambda *_: post_backward(unit(), flat, graph)))


def accumulate_node(flat):
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
            hook_post_backward(state, handle)
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
                        handle.graph_node = accumulate_node(handle.flat_param)
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
                    hook_post_backward(state, handle, handle.graph_node)
    rt.first_iter = False
    rt.callback_queued = False
    rt.forward_pending = False
