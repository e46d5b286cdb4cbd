"""One unit's FlatParameter through the ZeRO-3 lifecycle: shard, unshard, reshard.

* **shard** (construction): the unit's parameters are flattened (see
  ``flat_param``) and each rank keeps only its chunk; the full buffer is freed.
* **unshard** (before forward / backward): the chunks are all-gathered into a
  padded buffer and the original parameters are re-pointed to views of it
  (``module_views``), so the unchanged module code computes with full tensors
  and autograd sends their gradients into one flat gradient.
* **reshard** (after forward / backward): the FlatParameter points back at the
  shard and the padded buffer's storage is resized to zero, really freeing it.
  Tensors autograd saved for backward keep pointing into that storage; it is
  re-filled in place by the next all-gather, which is why the storage object is
  reused rather than reallocated.

Gradient reduction lives in ``reduce``; when these steps run is ``forward_pass``'s and ``backward_pass``'s job.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import agreement, comm, trace, validation
from .flat_param import PADDING_VALUE, FlatLayout, FlatParameter, FreedView, build_layout, flatten_params, shard_of
from .full_params import FullParams
from .module_views import HandleState, ModuleViews
from .options import ShardingStrategy
from .orig_params import OrigParams
from .quantize import QuantizedGather
from .working_set import unsharded_tracker

# Strategies that free parameters after forward (ZeRO-3) rather than keeping
# them gathered until the unit's own post-backward (ZeRO-2; inside no_sync,
# until the next forward).
RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class FlatParamHandle(ModuleViews, OrigParams, FullParams):
    """Owns one unit's FlatParameter, its shard, and its padded unsharded buffer."""

    def __init__(self, entries, aliases, *, group, strategy: ShardingStrategy, use_orig_params: bool, unit_name: str,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 replicate_group=None, compute_device: torch.device | None = None, offload_params: bool = False,
                 keep_low_precision_grads: bool = False, settings: dict | None = None):
        self.group = group
        # HSDP: shards are replicated across this group; gradients are
        # all-reduced over it after the reduce-scatter (see reduce).
        self.replicate_group = replicate_group
        self.world_size = group.size()
        self.rank = group.rank()
        self.strategy = strategy
        self.sharded = strategy != ShardingStrategy.NO_SHARD
        self.use_orig_params = use_orig_params
        self.unit_name = unit_name
        params = [e[3] for e in entries]
        validation.check_uniform(entries, use_orig_params, unit_name)
        validation.watch_optimizers()
        self._mp_dtypes = (param_dtype, reduce_dtype)
        self._set_dtype(params[0].dtype)
        dtype = self.dtype
        # keep_low_precision_grads: .grad is handed to the optimizer in the
        # compute dtype (accumulation across steps still happens in full precision).
        self.keep_low_precision_grads = keep_low_precision_grads
        # Aligning each parameter to 16 bytes (of the compute dtype) keeps the
        # views handed to the optimizer and kernels aligned; torch FSDP1 does too.
        align = 16 // self.compute_dtype.itemsize if use_orig_params else 0
        self.layout: FlatLayout = build_layout(entries, aliases, self.world_size, self.rank, align)
        # This shard's padding ranges, which hold PADDING_VALUE when aligned (qwZ quantizes them as zeros).
        self.shard_padding = self.layout.shard_padding() if align else []
        agreement.check_same_layout(self.layout, dtype, group, unit_name, dict(
            sharding_strategy=strategy.name, use_orig_params=use_orig_params, param_dtype=param_dtype,
            reduce_dtype=reduce_dtype, keep_low_precision_grads=keep_low_precision_grads,
            frozen_parameters=[e[2] for e in entries if not e[3].requires_grad] or None, **(settings or {})),
            replicate_group)
        # With alignment the gaps hold torch FSDP1's marker value, as in its FlatParameter (and so
        # in LOCAL state dicts); the shard's own tail padding stays zero, as torch's does.
        flat = flatten_params(self.layout, params, PADDING_VALUE if align else 0)
        self.local_shard = shard_of(flat, self.layout) if self.sharded else flat
        del flat
        # CPU offload: the shard (and the optimizer state built on it) stays on
        # CPU; only the gathered buffers live on the compute device.
        self.device = compute_device or self.local_shard.device
        self.offload = offload_params
        if offload_params:
            self.local_shard = self.local_shard.cpu()
        elif self.local_shard.device != self.device:
            self.local_shard = self.local_shard.to(self.device)
        requires_grad = any(p.requires_grad for p in params)
        self.flat_param = FlatParameter(self.local_shard, requires_grad=requires_grad)
        self.flat_param._fqns = self.layout.fqns  # noqa: SLF001 (for readers/debuggers)
        self._new_full_buffers()
        self.orig_params: list[nn.Parameter] = params if use_orig_params else []
        self.grad_none = set()
        for p in params:
            p._zeroshard_unit = unit_name  # marks it as owned; see wrap checks
        self.flat_param_host: nn.Module | None = None  # module whose _parameters hold flat_param
        self.compute_module: nn.Module | None = None  # the wrapped module (its .training: see forced_full_precision)
        self.full_prec_in_eval = False  # FSDP_USE_FULL_PREC_IN_EVAL=1 when the unit was wrapped
        self.is_root = False
        self.state = HandleState.IDLE
        self._gather_work = None
        self.prefetched = False
        # shard_version() when a forward kept the unit gathered for its backward; None otherwise (see hooks)
        self.kept_version: tuple[int, int, int] | None = None
        self.forward_version: int | None = None  # flat_param._version as this forward began (kept.keep_forward_edits)
        # A create_graph backward built a graph holding this unit's full parameters, still to be
        # backpropagated: the AccumulateGrad node it feeds, whether the full buffer is kept for it
        # (the FlatParameter pointing at the shard meanwhile) and the shard_version() it holds
        # (see backward_pass.post_backward_final)
        self.graph_node = None
        self.graph_kept = False
        self.accumulate_node = None  # the FlatParameter's AccumulateGrad node, kept across iterations (end_iteration)
        self.recompute_ahead = False  # set by each forward: kept past a no-grad forward (forward_pass.post_forward)
        self.graph_version: tuple[int, int, int] | None = None
        self.needs_pre_forward_unshard = False
        self.needs_pre_backward_unshard = False
        self.ran_pre_backward = False
        self.post_backward_called = False
        # The post-backward hook on this iteration's first AccumulateGrad node
        # (node, removable handle), and whether any gradient accumulated (see backward_pass).
        self.post_backward_hook = None
        self.accumulate_hooked = self.grad_accumulated = False
        self.summoned_writeback: bool | None = None  # inside summon_full_params: its writeback (full_params)
        self.summoned_rank0_only = False  # inside summon_full_params(rank0_only=True), on every rank (summon)
        self.forward_views: list | None = None  # the views made as the post-backward hook was placed (forward_pass.pre_forward)
        self.pre_forward_index: int | None = None
        self.post_forward_index: int | None = None
        self.saved_grad_shard: torch.Tensor | None = None
        # A persistent unit (see bucket) is NO_SHARD inside a sharded model;
        # its reduced .grad is set aside before the next backward and added
        # after that one's reduction, as a shard's is (same sums, same bits).
        self.persistent = False
        self.grad_reduced = False
        self.quant = None  # an Int8BlockQuant: all-gather int8 blocks (see quantize)
        self.hpz = None  # SecondaryShards: gather for backward within a group (see hpz)
        self.comm_hook = None  # (hook, state): replaces the gradient's collective (see comm_hooks)
        self.secondary: torch.Tensor | None = None
        self.secondary_version = None  # shard_version() when it was kept
        for info in (*self.layout.params, *self.layout.shared):
            del info.module._parameters[info.name]
        if use_orig_params:
            # Re-registered after whatever the unit does not manage (ignored
            # parameters), so named_parameters() orders them as torch does.
            self.use_sharded_views()
        else:
            for p, info in zip(params, self.layout.params):
                # Replaced by the FlatParameter: an optimizer stepping it trains nothing.
                p._zeroshard_retired = f"{info.fqn} of unit '{unit_name}'"
            if self.always_full:
                self.use_unsharded_views()
            else:
                self._placeholder_views()

    def _set_dtype(self, dtype: torch.dtype):
        # Mixed precision: the shard (the optimizer's master copy) keeps its
        # dtype; all-gather, forward and backward run in compute_dtype and the
        # gradient is reduced in reduce_dtype (param_dtype if only it is given).
        # Integer and complex units stay out of it (a cast would round ids, drop imaginary parts).
        param_dtype, reduce_dtype = self._mp_dtypes if dtype.is_floating_point else (None, None)
        self.dtype = dtype
        self.compute_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or param_dtype or dtype

    def _new_full_buffers(self):
        # The full buffers (compute dtype, and the shard's dtype for
        # summon_full_params under mixed precision), created with no storage.
        self._full_buffers: dict[torch.dtype, torch.Tensor] = {}
        self._freed_views: list[FreedView] | None = None  # see _placeholder_views
        self.installed_views: list | None = None  # what the module's slots were last set to (see OrigParams)
        self.padded = self._full_buffer(self.compute_dtype) if self.sharded else None
        self.padded_bytes = self.layout.padded_numel * self.compute_dtype.itemsize
        # NO_SHARD in the shard's dtype computes on the shard itself: nothing to gather.
        self.always_full = not self.sharded and self.compute_dtype == self.dtype and self.local_shard.device == self.device
        self._full: torch.Tensor | None = self.local_shard if self.always_full else None
        self._recast_into: torch.Tensor | None = None  # NO_SHARD: the forward's compute copy (see _recast)
        self.unsharded = self.always_full

    @property
    def forced_full_precision(self) -> bool:
        """Mixed precision is off for this unit now: ``FSDP_USE_FULL_PREC_IN_EVAL=1``
        and its module in eval mode (torch FSDP1's rule): gather, compute and reduce in ``dtype``."""
        return (self.full_prec_in_eval and not self.compute_module.training
                and (self.compute_dtype != self.dtype or self.reduce_dtype != self.dtype))

    def follow_cast(self):
        """``module.to(dtype)`` (or ``.double()``, ...) after wrapping cast the
        FlatParameter, or with ``use_orig_params`` the original parameters, but
        not the shard: adopt the new dtype for the shard and the buffers, as
        torch FSDP1 does before its first forward. Called before every unshard."""
        now = self.param_dtype_now()
        if now == self.dtype:
            self._follow_data_assignment()
            return
        if self.unsharded and not self.always_full or self.flat_param.grad is not None:
            raise RuntimeError(f"zeroshard: unit '{self.unit_name}' was cast from {self.dtype} to {now} while it holds "
                               "gathered parameters or gradients. Fix: cast the module before wrapping or between steps "
                               "after optimizer.zero_grad(set_to_none=True) (or use MixedPrecision).")
        shard = self.local_shard.to(now) if self.use_orig_params else self.flat_param.data
        self.local_shard = self.flat_param.data = shard
        if self.use_orig_params:  # then the parameters' values, in `now`: a cast's own, or values assigned by hand
            self.writeback_orig_params()
        self._set_dtype(now)
        self._new_full_buffers()
        if self.use_orig_params:
            self.use_sharded_views()
        elif self.always_full:
            self.use_unsharded_views()
        else:
            self._placeholder_views()

    def param_dtype_now(self) -> torch.dtype:
        """The dtype the parameters have now: another than ``self.dtype`` after a ``module.to(dtype)``.
        With ``use_orig_params`` only when every original parameter has it: one given ``p.data`` of
        another dtype by hand is written back into the shard in the shard's dtype, as torch FSDP1 does
        (the unit used to be cast when that was its first parameter, and the others stayed behind)."""
        if not self.use_orig_params:
            return self.flat_param.dtype
        now = {p.dtype for p in self.orig_params}
        return now.pop() if len(now) == 1 else self.dtype

    def _follow_data_assignment(self):
        """``flat_param.data = t`` between steps (a re-initialization, weights loaded by
        hand) replaced the shard the next all-gather reads: adopt ``t`` as the shard, as
        torch FSDP1 does before its first forward (it was ignored, and the next reshard
        put the old shard back)."""
        if self.use_orig_params or (self.unsharded and not self.always_full):
            return
        if self.flat_param.data_ptr() == self.local_shard.data_ptr() and self.flat_param.shape == self.local_shard.shape:
            return
        data = self.flat_param.data
        if data.shape != self.local_shard.shape or data.device != self.local_shard.device:
            raise RuntimeError(f"zeroshard: unit '{self.unit_name}': its FlatParameter's .data was replaced by a tensor of "
                               f"shape {tuple(data.shape)} on {data.device}, but it holds this rank's shard of shape "
                               f"{tuple(self.local_shard.shape)} on {self.local_shard.device}. Fix: assign a tensor of that "
                               "shape and device, or copy_ into the parameter under torch.no_grad().")
        self.local_shard = data
        if self.always_full:  # NO_SHARD computes on the shard itself
            self._full = data
            self.use_unsharded_views()

    def _full_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._full_buffers:
            buf = self.local_shard.new_empty(self.layout.padded_numel, dtype=dtype, device=self.device)
            buf.untyped_storage().resize_(0)
            self._full_buffers[dtype] = buf
        return self._full_buffers[dtype]

    def shard_version(self) -> tuple[int, int, int]:
        """What moves when this rank's shard may have changed: the in-place
        version counters of the FlatParameter (and the views of it a kept unit
        exposes) and of the original parameters (use_orig_params), and the
        count of optimizer steps (fused optimizers update in place without
        bumping the counters)."""
        orig = sum(p._version for p in self.orig_params) if self.use_orig_params else 0
        return self.flat_param._version, orig, validation.optimizer_steps[0]

    def end_iteration(self):
        """Back to idle after a backward: the next forward starts afresh."""
        self.kept_version = None
        self.state = HandleState.IDLE
        self.ran_pre_backward = self.needs_pre_backward_unshard = self.prefetched = False
        self.post_backward_called = self.grad_accumulated = False
        self._grads_at_backward = self._outside = None  # (see absorb_outside_grads) held no longer than one backward
        self.forward_views = self._recast_into = None
        if self.post_backward_hook is not None:
            # The AccumulateGrad node stays alive (as torch FSDP1 keeps it): dropped, an op on the
            # sharded FlatParameter between steps (parameters_to_vector) would make a new one shaped
            # like the shard, and the next backward's unsharded gradient would be refused.
            self.accumulate_node = self.post_backward_hook[0]
            self.post_backward_hook[1].remove()
            self.post_backward_hook = None

    # ------------------------------------------------------------------ unshard
    def unshard(self, full_precision: bool = False):
        """Issue the all-gather (asynchronously); :meth:`wait_unshard` completes it.

        ``full_precision`` gathers in the shard's dtype even under mixed precision.
        """
        self.follow_cast()
        self.writeback_orig_params()
        step = "summon_full_params" if full_precision else "forward/backward"
        full_precision = full_precision or self.forced_full_precision
        dtype = self.dtype if full_precision else self.compute_dtype
        if self.unsharded and self._full.dtype != dtype:
            self.reshard(free=True)  # gathered in the other precision (compute vs. summon / eval in full precision)
        if self.unsharded:
            return
        if self.sharded:
            # Casting the shard before the all-gather halves its bytes under bf16/fp16.
            src = self.local_shard.to(self.device, dtype)  # no copy unless offloaded or cast
            self._full = self._full_buffer(dtype)
            self._full.untyped_storage().resize_(self._full.numel() * self._full.element_size())
            what = f"unshard ({step}) of unit '{self.unit_name}'"
            if self.secondary is not None and not full_precision:  # ZeRO++ hpZ: backward gather inside the group
                self._gather_work, self.secondary = self.hpz.gather(self._full, self.secondary, what), None
            elif self.quant is not None and not full_precision:  # ZeRO++ qwZ: int8 blocks on the wire
                self._gather_work = QuantizedGather(self.quant, self._full, self.local_shard.to(self.device), self.group,
                                                    what, self.shard_padding)
            else:
                self._gather_work = comm.all_gather(self._full, src, self.group, what=what)
        else:
            self._full = self._recast(dtype)
        self.unsharded = True
        unsharded_tracker.add(self)
        if trace._active:
            trace.unsharded(self, unsharded_tracker.live_bytes, gathered=self.sharded)

    def _recast(self, dtype: torch.dtype) -> torch.Tensor:
        """NO_SHARD's compute copy of the shard (the shard itself without a cast or device move).
        The backward's copy goes into the forward's buffer, as torch FSDP1 re-casts into one
        persistent buffer: the forward's views, over it, then still feed the AccumulateGrad node
        the post-backward hook is on, and a reentrant checkpoint's recomputation reuses them
        (module_views): its backward reduces the unit, as torch's does."""
        into, self._recast_into = self._recast_into, None
        same_device = into is not None and into.device.type == self.device.type and self.device.index in (None, into.device.index)
        if same_device and into.dtype == dtype:
            return into.copy_(self.local_shard)
        return self.local_shard.to(self.device, dtype)

    def wait_unshard(self, full_precision: bool = False):
        """Finish the all-gather and point the parameters at the full tensors."""
        self.unshard(full_precision)
        if self._gather_work is not None:
            t = trace._active and trace.now()
            self._gather_work.wait()  # a failure stays pending: the next use raises it again, never reads the buffer
            self._gather_work = None
            if trace._active:
                trace.gather_waited(self, t)
        self.flat_param.data = self._full[: self.layout.numel]
        self.use_unsharded_views()

    def keep_secondary(self):
        """hpZ: before the forward's buffer is freed, keep this rank's piece of it."""
        if self.hpz is not None and self.unsharded and self._full.dtype == self.compute_dtype:
            self.secondary = self.hpz.save(self._full)
            self.secondary_version = self.shard_version()

    # ------------------------------------------------------------------ reshard
    def reshard(self, free: bool, sharded_views: bool = True):
        """Point back at the local shard; with ``free``, release the full buffer.
        ``sharded_views=False`` (use_orig_params) leaves the module's tensors
        the unsharded views they are (ZeRO-2 between forward and backward)."""
        was_unsharded = self.unsharded
        self.flat_param.data = self.local_shard
        # A NO_SHARD low-precision copy is dropped at every reshard: the next
        # use re-casts the (possibly updated) shard.
        if (free or not self.sharded) and self.unsharded and not self.always_full:
            if self._gather_work is not None:  # a prefetch nobody consumed
                self._gather_work.wait()
                self._gather_work = None
            if self.sharded:
                self._full.untyped_storage().resize_(0)
            elif (self._full is not self.local_shard and self.state == HandleState.FORWARD and torch.is_grad_enabled()
                  and self.flat_param.requires_grad):
                self._recast_into = self._full  # a copy autograd holds until the backward anyway (_recast)
            self._full = None
            self.unsharded = self.graph_kept = False
            self.kept_version = None
            if self.sharded:  # the full parameters a pending graph of gradients held are gone
                self.graph_node = None
            unsharded_tracker.remove(self)
            if self.sharded and not self.use_orig_params:
                self._placeholder_views()
        if self.use_orig_params and sharded_views:
            self.use_sharded_views()
        self.prefetched = False
        if trace._active:
            trace.resharded(self, self.padded_bytes if was_unsharded and not self.unsharded else 0, unsharded_tracker.live_bytes)

    # ---------------------------------------------------------------- gradients
    def prepare_gradient_for_backward(self):
        """Move a sharded gradient from a previous step aside, so that autograd
        writes a fresh unsharded gradient; reduce adds the two afterwards.
        An unsharded gradient (from ``no_sync``) stays and autograd adds to it."""
        g = self.flat_param.grad
        if g is not None and (g.numel() != self.layout.numel or self.grad_reduced):
            self.saved_grad_shard = g.data if g.dtype == self.dtype else g.data.to(self.dtype)
            self.flat_param.grad = None
        elif g is not None and g.device != self.device:
            # NO_SHARD under CPU offload: the reduced gradient went to the CPU shard; autograd adds
            # the next micro-batch's on the compute device (it refuses a CPU .grad there). Through
            # .data: the .grad setter refuses an fp32 gradient on the low-precision compute copy.
            g.data = g.data.to(self.device)
        self.grad_reduced = False

    def prepare_gradient_for_optim(self):
        """After a synchronized backward, ``.grad`` is the reduced shard."""
        # No reduction took it (an autograd.grad pass reaching no parameter): still the reduced one. Unless
        # .grad holds a no_sync gradient: both stay for the next synchronized backward to add.
        moved = self.saved_grad_shard is not None and self.flat_param.grad is None
        if moved:
            self.flat_param.grad, self.saved_grad_shard = self.saved_grad_shard, None
            self.grad_reduced = True  # (a persistent unit's next backward sets it aside again)
        if self.use_orig_params:  # in full precision, before the cast below, as torch adds them
            self.absorb_outside_grads()
        low = self.keep_low_precision_grads and not self.forced_full_precision
        # A persistent unit (NO_SHARD inside a sharded model) casts as the sharded units do (torch's
        # FULL_SHARD: accumulated in the reduce dtype, handed over in the parameter dtype).
        grad = self.flat_param.grad
        if (moved or self.persistent) and low and grad is not None and grad.dtype != self.compute_dtype:
            grad.data = grad.data.to(self.compute_dtype)
        if self.use_orig_params:
            self.use_grad_views()

