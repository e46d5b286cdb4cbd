"""Gradient reduction: reduce-scatter (ZeRO-2/3) or all-reduce (NO_SHARD).

After a unit's backward its FlatParameter holds the *unsharded* local gradient.
Sharded strategies reduce-scatter it so each rank receives the sum of its chunk
over ranks, then add that into the sharded ``.grad`` (gradient accumulation
across steps); NO_SHARD all-reduces the whole gradient like DDP.

Averaging is split into a division before the sum and one after, with torch
FSDP1's factors, so that fp32 results match it bit for bit and low-precision
sums stay in range: pre starts at 1 and doubles while N is divisible by it
and N / pre > pre (2 for N = 2, 3, 4; 4 for N = 6 to 16), post = N / pre.

With hybrid sharding the reduce-scattered shard is then all-reduced across
replica groups, and the factors are those of the whole data-parallel size.

Under mixed precision the gradient is cast to ``reduce_dtype`` before the
pre-division and the reduced shard back to the parameter dtype before it is
accumulated, as torch FSDP1 does.

The collectives are asynchronous: backward keeps computing the next unit while
gloo/NCCL reduces this one; the root's end-of-backward callback waits for all
of them (:func:`finish_reductions`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import comm, trace


def divide_factors(world_size: int) -> tuple[float, float]:
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def _div(t: torch.Tensor, factor: float):
    if factor > 1:
        t.div_(factor)


class PendingReduction:
    """A reduction in flight, completed by :meth:`finish`."""

    def __init__(self, handle, work, out: torch.Tensor, inp: torch.Tensor, post: float):
        self.handle, self.work, self.out, self.inp, self.post = handle, work, out, inp, post
        if trace._active:
            trace.span_begin("reduce_scatter" if handle.sharded else "all_reduce", handle.unit_name)

    def finish(self):
        self.work.wait()
        if trace._active:
            trace.span_end("reduce_scatter" if self.handle.sharded else "all_reduce", self.handle.unit_name)
        self.inp = None  # the send buffer may be freed now
        h = self.handle
        if h.replicate_group is not None:  # HSDP: the shard is summed across replicas too
            comm.all_reduce(self.out, h.replicate_group, what=f"replica all-reduce of unit '{h.unit_name}' gradients")
        _div(self.out, self.post)
        if h.offload and self.out.device != h.local_shard.device:
            self.out = self.out.to(h.local_shard.device)  # the optimizer steps the CPU shard
        if self.out.dtype != h.dtype:  # reduced in low precision: back to the master dtype
            if h.sharded:
                self.out = self.out.to(h.dtype)
            elif not h.keep_low_precision_grads:  # NO_SHARD keeps the reduced dtype then
                h.flat_param.grad.data = self.out.to(h.dtype)
        if h.sharded:
            if h.saved_grad_shard is None:
                h.saved_grad_shard = self.out
            else:
                h.saved_grad_shard += self.out


def start_reduction(handle) -> PendingReduction:
    """Launch the reduction of ``handle.flat_param.grad`` (the local unsharded gradient)."""
    flat = handle.flat_param
    replicas = handle.replicate_group.size() if handle.replicate_group is not None else 1
    pre, post = divide_factors(handle.world_size * replicas)
    if flat.grad.dtype != handle.reduce_dtype:
        flat.grad.data = flat.grad.data.to(handle.reduce_dtype)
    if not handle.sharded:
        grad = flat.grad  # stays in .grad; all-reduced in place
        _div(grad, pre)
        work = comm.all_reduce(grad, handle.group, async_op=True, what=f"NO_SHARD gradient of unit '{handle.unit_name}'")
        return PendingReduction(handle, work, grad, grad, post)
    grad = flat.grad.data
    # Clear .grad now so a second backward before the reduction completes
    # writes a new tensor instead of adding into the one being sent.
    flat.grad = None
    pad = handle.layout.padded_numel - grad.numel()
    padded = F.pad(grad, [0, pad]) if pad else grad
    _div(padded, pre)
    out = padded.new_empty(handle.layout.shard_numel)
    work = comm.reduce_scatter(out, padded, handle.group, what=f"post-backward gradient of unit '{handle.unit_name}'")
    return PendingReduction(handle, work, out, padded, post)


def finish_reductions(pending: list[PendingReduction]):
    """Wait for every reduction launched this backward, in launch order."""
    while pending:
        pending.pop(0).finish()
