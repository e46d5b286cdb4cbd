"""Gradient reduction: reduce-scatter (ZeRO-2/3) or all-reduce (NO_SHARD).

After a unit's backward its FlatParameter holds the *unsharded* local gradient.
Sharded strategies reduce-scatter it so each rank receives the sum of its chunk
over ranks, then add that into the sharded ``.grad`` (gradient accumulation
across steps); NO_SHARD all-reduces the whole gradient like DDP.

Averaging is split into a division before the sum and one after, with torch
FSDP1's factors, so that fp32 results match it bit for bit and low-precision
sums stay in range: pre starts at 1 and doubles while N is divisible by it
and N / pre > pre, post = N / pre. So pre is 2 for N = 2 to 5 and every odd
N > 1, 4 for every even N from 6 to 18, and 8 for every multiple of 4 from 20
to 68.

With hybrid sharding the reduce-scattered shard is then all-reduced across
replica groups, and the factors are those of the whole data-parallel size.

Under mixed precision the gradient is cast to ``reduce_dtype`` before the
pre-division and the reduced shard back to the parameter dtype before it is
accumulated, as torch FSDP1 does.

The collectives are asynchronous: backward keeps computing the next unit while
gloo/NCCL reduces this one. Once the next unit's reduction is issued this one
is waited for and its send buffer, the unsharded gradient, freed (under HSDP
its replica all-reduce is issued then); the root's end-of-backward callback
waits for the rest and hands each unit its reduced shard
(:func:`finish_reductions`). With ``bucket_cap_mb`` several units'
gradients share one collective (see ``bucket``). A communication hook
(``comm_hooks``) replaces the collective and both divisions for every unit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import comm, trace
from .bucket import Bucket, Bucketer, pack_flat, pack_rows

try:  # torch's fp16/bf16_compress_hook, which torch FSDP1 treats specially (see casts_itself)
    from torch.distributed.algorithms._comm_hooks import LOW_PRECISION_HOOKS as _TORCH_LOW_PRECISION_HOOKS
except ImportError:  # pragma: no cover - a torch without them
    _TORCH_LOW_PRECISION_HOOKS = ()


def divide_factors(world_size: int) -> tuple[float, float]:
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def _div(t: torch.Tensor, factor: float):
    if factor > 1:
        t.div_(factor)


class PendingReduction:
    """A reduction in flight (one unit's, or a bucket's): :meth:`settle` once the next one is
    issued, :meth:`finish` at the end of backward."""

    def __init__(self, entries, work, out: torch.Tensor, inp: torch.Tensor, sizes: list[int]):
        # entries: (handle, post-divide factor); out: their results end to end.
        self.entries, self.work, self.out, self.inp, self.sizes = entries, work, out, inp, sizes
        self.replica_work = None
        _spans(entries, trace.span_begin)

    settled = property(lambda self: self.work is None)

    def settle(self):
        """Wait for the collective and drop its send buffer, the units' unsharded gradients (so
        that, as in torch FSDP1, they do not all live until the end of backward); under HSDP issue
        the replica all-reduce of the shard, which the other ranks issue at the same point."""
        if self.settled:
            return
        self.work.wait()
        self.work = self.inp = None
        _spans(self.entries, trace.span_end)
        h0 = self.entries[0][0]
        if h0.replicate_group is not None:  # HSDP: the shard is summed across replicas too
            _spans(self.entries, trace.span_begin, "all_reduce")
            self.replica_work = comm.all_reduce(self.out, h0.replicate_group, async_op=True,
                                                what=f"replica all-reduce of {_names(self.entries)} gradients")

    def finish(self, apply: bool = True):
        """Settle it and wait for the replica all-reduce; with ``apply``, hand each unit its
        gradient (without: an interrupted backward drops them)."""
        self.settle()
        if self.replica_work is not None:
            self.replica_work.wait()
            self.replica_work = None
            _spans(self.entries, trace.span_end, "all_reduce")
        if not apply:
            return
        outs = self.out.split(self.sizes) if len(self.entries) > 1 else [self.out]
        for (h, post), out in zip(self.entries, outs):
            _accumulate(h, out, post)


def _spans(entries, mark, kind: str | None = None) -> None:
    """A trace span's begin or end (``mark``) for each unit reduced (its own collective's kind by default)."""
    if trace._active:
        for h, _ in entries:
            mark(kind or _kind(h), h)


def _kind(h) -> str:
    return "reduce_scatter" if h.sharded else "all_reduce"


def _names(entries) -> str:
    names = [f"'{h.unit_name}'" for h, _ in entries]
    return f"unit {names[0]}" if len(names) == 1 else f"units {', '.join(names)} (one bucket)"


def _accumulate(h, out: torch.Tensor, post: float, cast: bool = True):
    """Post-divide one unit's reduced gradient and hand it to the unit
    (``cast``: back to the parameter dtype if it was reduced in another)."""
    _div(out, post)
    if not h.sharded and out.data_ptr() != h.flat_param.grad.data_ptr():
        h.flat_param.grad.data.copy_(out)  # bucketed all-reduce: back from the bucket
        out = h.flat_param.grad.data
    if h.offload and out.device != h.local_shard.device:
        out = out.to(h.local_shard.device)  # the optimizer steps the CPU shard
        if not h.sharded:  # NO_SHARD reduced .grad in place: it must follow to the CPU too
            h.flat_param.grad.data = out
    if cast and out.dtype != h.dtype:  # reduced in low precision: back to the master dtype
        if h.sharded and out._base is None:  # in place, as torch FSDP1: a comm hook's output becomes the gradient
            out.data = out.data.to(h.dtype)
        elif h.sharded:  # a view of a bucket's output: a copy of its own, not the whole bucket kept alive
            out = out.to(h.dtype)
        elif not h.keep_low_precision_grads or h.persistent:  # NO_SHARD keeps the reduced dtype then;
            # a persistent unit adds its earlier gradient in the master dtype, as the sharded units do
            h.flat_param.grad.data = out.to(h.dtype)
    if h.persistent:  # add the gradient set aside before this backward
        if h.saved_grad_shard is not None:
            h.flat_param.grad.data += h.saved_grad_shard
            h.saved_grad_shard = None
        h.grad_reduced = True
    if h.sharded:
        if h.saved_grad_shard is None:
            h.saved_grad_shard = out
        else:
            h.saved_grad_shard += out


def casts_itself(hook) -> bool:
    """fp16/bf16 compression hooks (torch's, and zeroshard's marked with
    ``casts_itself``) do their own casts: as in torch FSDP1, the gradient is
    then neither cast to ``reduce_dtype`` before the hook nor back to the
    parameter dtype after it."""
    return hook in _TORCH_LOW_PRECISION_HOOKS or getattr(hook, "casts_itself", False)


def start_reduction(handle, bucketer: Bucketer | None = None) -> list[PendingReduction]:
    """Launch the reduction of ``handle.flat_param.grad`` (the local unsharded
    gradient), or put it in a bucket; returns the reductions launched."""
    flat = handle.flat_param
    hooked = handle.comm_hook is not None
    # Not under FSDP_USE_FULL_PREC_IN_EVAL in eval mode: torch FSDP1 reduces in full precision then.
    if flat.grad.dtype != handle.reduce_dtype and not (hooked and casts_itself(handle.comm_hook[0])) and not handle.forced_full_precision:
        flat.grad.data = flat.grad.data.to(handle.reduce_dtype)
    if hooked:  # the hook communicates and divides
        return [_run_hook(handle)]
    replicas = handle.replicate_group.size() if handle.replicate_group is not None else 1
    pre, post = divide_factors(handle.world_size * replicas)
    if not handle.sharded:
        grad = flat.grad  # stays in .grad; all-reduced in place (unless bucketed)
        _div(grad, pre)
    else:
        grad = flat.grad.data
        # Clear .grad now so a second backward before the reduction completes
        # writes a new tensor instead of adding into the one being sent.
        flat.grad = None
        pad = handle.layout.padded_numel - grad.numel()
        grad = F.pad(grad, [0, pad]) if pad else grad
        _div(grad, pre)
    if bucketer is None:
        bucket = Bucket(handle.sharded)
        bucket.add(handle, grad, post)
        return [launch(bucket)]
    return [launch(b) for b in bucketer.add(handle, grad, post)]


class HookedReduction:
    """A unit's gradient already reduced by a communication hook (see
    ``comm_hooks``): it only remains to hand it to the unit."""

    def __init__(self, handle, out: torch.Tensor):
        self.handle, self.out = handle, out

    settled = True  # the hook ran its collective to completion

    def settle(self):
        pass

    def finish(self, apply: bool = True):
        if apply:
            _accumulate(self.handle, self.out, 1.0, cast=not casts_itself(self.handle.comm_hook[0]))  # the hook divided


def _run_hook(handle) -> HookedReduction:
    hook, state = handle.comm_hook
    flat = handle.flat_param
    if trace._active:
        trace.span_begin(_kind(handle), handle)
    if handle.sharded:
        grad = flat.grad.data
        flat.grad = None  # as on the default path: a second backward writes a new tensor
        pad = handle.layout.padded_numel - grad.numel()
        grad = F.pad(grad, [0, pad]) if pad else grad
        out = grad.new_empty(grad.numel() // handle.world_size)
        hook(state, grad, out)
    else:
        hook(state, flat.grad)  # reduces .grad in place
        out = flat.grad
    if trace._active:
        trace.span_end(_kind(handle), handle)
    return HookedReduction(handle, out)


def launch(bucket: Bucket) -> PendingReduction:
    """One collective for every gradient in ``bucket``."""
    h = bucket.entries[0][0]
    grads = [g for _, g, _ in bucket.entries]
    entries = [(e[0], e[2]) for e in bucket.entries]
    if not bucket.sharded:
        inp, sizes = pack_flat(grads)
        what = f"NO_SHARD gradient of {_names(entries)}"
        return PendingReduction(entries, comm.all_reduce(inp, h.group, async_op=True, what=what), inp, inp, sizes)
    inp, sizes = pack_rows(grads, h.world_size)
    out = inp.new_empty(sum(sizes))
    work = comm.reduce_scatter(out, inp, h.group, what=f"post-backward gradient of {_names(entries)}")
    return PendingReduction(entries, work, out, inp, sizes)


def flush(bucketer: Bucketer | None) -> list[PendingReduction]:
    """Launch every bucket still open (the end of backward)."""
    return [launch(b) for b in bucketer.flush()] if bucketer is not None else []


def settle_earlier(pending: list) -> None:
    """Settle every reduction in ``pending`` but the newest: one unsharded gradient stays in
    flight while backward computes the next unit's, the earlier ones are freed. (They settle
    in launch order, so the unsettled ones are the tail: only those are visited.)"""
    first = len(pending) - 1
    while first > 0 and not pending[first - 1].settled:
        first -= 1
    for p in pending[first:-1]:
        p.settle()


def finish_reductions(pending: list[PendingReduction], apply: bool = True):
    """Wait for every reduction launched this backward, in launch order (``apply``: see finish)."""
    while pending:
        pending.pop(0).finish(apply)
