"""ZeRO stage 0, plain data parallelism: DeepSpeed's ``allreduce_gradients``.

At an accumulation boundary every trainable parameter's gradient is summed
over the ranks and scaled by 1/world_size. A parameter that got no gradient
contributes zeros, so every rank reduces the same elements and the optimizer
steps it, as in DeepSpeed. torch DDP, used by the engine before, refuses a
parameter without gradient (its next forward raises) and broadcasts rank 0's
buffers every forward, which DeepSpeed does not.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from . import comm, ext

BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE


@torch.no_grad()
def allreduce_gradients(params: Iterable[torch.nn.Parameter], world_size: int) -> None:
    """Fill in missing gradients with zeros (a sparse one is made dense), then
    all-reduce and multiply by 1/world_size (DeepSpeed's post-scaling; the same
    bits as DDP's pre-division when world_size is a power of 2), in flat buckets
    of at most ``BUCKET_ELEMENTS`` per dtype and device."""
    by_kind: dict = {}  # (dtype, device) -> gradients, in parameter order (the same on every rank)
    for p in params:
        if not p.requires_grad or p.numel() == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.layout != torch.strided:
            p.grad = p.grad.to_dense()
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    if world_size == 1:
        return
    for grads in by_kind.values():
        start = 0
        while start < len(grads):
            offsets, numel, end = [], 0, start
            while end < len(grads) and (end == start or numel + grads[end].numel() <= BUCKET_ELEMENTS):
                offsets.append(numel)
                numel += grads[end].numel()
                end += 1
            flat = ext.flatten(grads[start:end], offsets, numel)
            comm.all_reduce(flat, dist.group.WORLD, what="ZeRO stage 0 gradients")
            flat.mul_(1.0 / world_size)
            ext.unflatten_into(flat, offsets, grads[start:end])
            start = end
