"""Communication hooks: replace how a unit's gradient is reduced.

The *reduce* step of ZeRO (``reduce``) ends each unit's backward with a
reduce-scatter of its flat gradient (an all-reduce under NO_SHARD), averaged
in two divisions. ``FullyShardedDataParallel.register_comm_hook(state, hook)``
swaps that collective for ``hook``, as torch FSDP1 does, so gradient
compression, error feedback or gossip can be tried without touching the
engine. For every unit below the root, after backward:

* sharded strategies call ``hook(state, grad, output)``: ``grad`` is the
  unit's unsharded flat gradient (in ``reduce_dtype``, padded to a multiple of
  the world size), ``output`` an empty tensor of one shard; the hook must fill
  ``output`` with this rank's reduced (averaged) shard;
* NO_SHARD (and units kept whole by ``param_persistence_threshold``) call
  ``hook(state, grad)``, which must reduce ``grad`` in place.

The hook does its own communication and division, synchronously; zeroshard
then accumulates the result into ``.grad`` (cast to the parameter dtype) as
after its own collective. A hook may swap ``output.data`` / ``grad.data``
(a compression hook does). Hooks are not supported with hybrid sharding or
``bucket_cap_mb`` (whose collectives span several units or groups).

This module also has the four hooks torch ships, written over ``comm`` so that
their collectives are counted by ``comm_stats`` and named in errors:
``allreduce_hook`` / ``reduce_scatter_hook`` (what zeroshard does by default)
and ``fp16_compress_hook`` / ``bf16_compress_hook`` (communicate in half
precision, then cast back to ``state.parameter_type``). torch's own hooks
(``torch.distributed.algorithms._comm_hooks.default_hooks``) work too, its
compression hooks on CUDA only (they call ``record_stream``). A hook that
cannot take its units' call is refused at registration.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from . import comm
from .reduce import _TORCH_LOW_PRECISION_HOOKS, divide_factors


class DefaultState:
    """What the default hooks need: the group and the two division factors
    (the same as zeroshard's own reduction, see ``reduce.divide_factors``)."""

    __slots__ = ("process_group", "world_size", "gradient_predivide_factor", "gradient_postdivide_factor")

    def __init__(self, process_group):
        if process_group is None:
            raise ValueError(
                "zeroshard: DefaultState needs the process group the gradients are reduced over. "
                "Fix: pass model.process_group (the group the FullyShardedDataParallel root was built with)."
            )
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_predivide_factor, self.gradient_postdivide_factor = divide_factors(self.world_size)


class LowPrecisionState(DefaultState):
    """DefaultState plus the dtype gradients return to after a compressed reduction."""

    __slots__ = ("parameter_type",)

    def __init__(self, process_group, parameter_type: torch.dtype = torch.float32):
        super().__init__(process_group)
        self.parameter_type = parameter_type


def _div(t: torch.Tensor, factor: float):
    if factor > 1:
        t.div_(factor)


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """NO_SHARD: average ``grad`` over the group in place (pre-divide, all-reduce, post-divide)."""
    _div(grad, state.gradient_predivide_factor)
    comm.all_reduce(grad, state.process_group, what="gradient (allreduce_hook)")
    _div(grad, state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Sharded: ``output`` = this rank's shard of the average of ``grad`` over the group."""
    _div(grad, state.gradient_predivide_factor)
    comm.reduce_scatter(output, grad, state.process_group, async_op=False, what="gradient (reduce_scatter_hook)")
    _div(output, state.gradient_postdivide_factor)


def _compressed(dtype: torch.dtype, state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None):
    """Reduce in ``dtype`` (half the bytes of fp32), then cast the result back."""
    if grad.dtype != dtype:
        grad.data = grad.data.to(dtype)
    if output is None:
        allreduce_hook(state, grad)
        grad.data = grad.data.to(state.parameter_type)
        return
    if output.dtype != dtype:
        output.data = output.data.to(dtype)
    reduce_scatter_hook(state, grad, output)
    output.data = output.data.to(state.parameter_type)


def fp16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Communicate the gradient in float16 (either signature)."""
    _compressed(torch.float16, state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Communicate the gradient in bfloat16 (either signature)."""
    _compressed(torch.bfloat16, state, grad, output)


# Like torch's, they cast the gradient themselves: FSDP casts neither before nor after them.
fp16_compress_hook.casts_itself = bf16_compress_hook.casts_itself = True


def register(root, units, state, hook) -> None:
    """``FullyShardedDataParallel.register_comm_hook``: give every unit below
    ``root`` (``units``, root included) the hook. Checks everything before
    setting anything, so a refused call leaves no unit half-registered."""
    if not callable(hook):
        raise ValueError(f"zeroshard: register_comm_hook: the hook must be callable, got {hook!r}.")
    if not root.check_is_root():
        raise RuntimeError(
            "zeroshard: register_comm_hook must be called on the root FullyShardedDataParallel instance "
            "(it applies to every unit below it). Fix: call it on the outermost wrapper."
        )
    for u in units:
        if u._replicate_group is not None:
            raise ValueError(
                f"zeroshard: register_comm_hook: unit {type(u.module).__name__} uses {u.sharding_strategy.name}; "
                "communication hooks are not supported with hybrid sharding (as in torch FSDP1). "
                "Fix: use FULL_SHARD / SHARD_GRAD_OP / NO_SHARD, or no hook."
            )
        if u.bucket_cap_mb is not None:
            raise ValueError(
                "zeroshard: register_comm_hook: bucket_cap_mb packs several units' gradients into one collective, "
                "but a hook reduces one unit's gradient. Fix: leave bucket_cap_mb=None, or register no hook."
            )
        if u._comm_hook is not None:
            raise RuntimeError(
                f"zeroshard: a communication hook ({u._comm_hook!r}) is already registered; it can be registered once. "
                "Fix: register a single hook before the first forward."
            )
        if u._handle is not None:
            _check_call(hook, state, u._handle)
    for u in units:
        u._comm_hook, u._comm_hook_state = hook, state
        if u._handle is not None:
            u._handle.comm_hook = (hook, state)


def _check_call(hook, state, handle) -> None:
    """The hook must take the call its unit makes (see the module docstring),
    and torch's compression hooks need CUDA: refused here, naming the unit,
    rather than a TypeError or torch's 'unknown parameter type' in backward."""
    unit = handle.unit_name
    if hook in _TORCH_LOW_PRECISION_HOOKS and handle.device.type == "cpu":
        raise ValueError(f"zeroshard: register_comm_hook: torch's {hook.__name__} calls record_stream, which only "
                         f"CUDA tensors have, and unit {unit} computes on the CPU (torch FSDP1 fails there too). "
                         f"Fix: use zeroshard.comm_hooks.{hook.__name__} (the same casts and collectives).")
    try:
        signature = inspect.signature(hook, follow_wrapped=False)  # what is called: a functools.wraps wrapper's own
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    args = (state, None, None) if handle.sharded else (state, None)
    try:
        signature.bind(*args)
    except TypeError:
        call, why = (("hook(state, grad, output)", "it is sharded") if handle.sharded else
                     ("hook(state, grad)", "param_persistence_threshold keeps it whole" if handle.persistent
                      else "it is NO_SHARD"))
        raise ValueError(f"zeroshard: register_comm_hook: unit {unit} calls {call} ({why}), which "
                         f"{getattr(hook, '__name__', repr(hook))}{signature} does not take. Fix: a hook that "
                         "takes both calls (output=None by default, as zeroshard.comm_hooks.bf16_compress_hook), "
                         "or one strategy for the whole model.") from None
