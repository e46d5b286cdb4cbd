"""Small units: bucketed gradient reduction, and persistent (never sharded) units.

**Persistence** (DeepSpeed ZeRO-3's ``stage3_param_persistence_threshold``):
a unit whose parameters total at most ``param_persistence_threshold``
elements is not worth an all-gather before every use; it is kept whole on
every rank — a NO_SHARD unit inside a sharded model — and its gradient is
all-reduced (:func:`unit_strategy`). It costs its size in memory on each rank
and saves two all-gathers per step.

**Bucketing**: many small units' gradients in one collective.

A collective has a fixed cost per call (latency, a kernel launch, a gloo
round) on top of its bytes, so a model of many small units pays more in calls
than in bandwidth. This is FairScale's ``ReduceScatterBucketer`` (its FSDP's
``bucket_cap_mb``) and DeepSpeed ZeRO-3's ``reduce_bucket_size``: gradients
wait in a bucket until it holds ``bucket_cap_mb`` MiB, then one collective
reduces them all.

* reduce-scatter (sharded units): every unit's padded gradient is N chunks of
  its ``shard_numel``; the bucket lays them out rank-major — rank 0's chunk of
  every unit, then rank 1's, ... — so that one reduce-scatter hands each rank
  the concatenation of its own shards (:func:`pack_rows`).
* all-reduce (NO_SHARD and persistent units): the gradients are concatenated.

Each element is still the sum of the same N per-rank values; only its position
in the buffer changes. With 2 ranks that sum (a + b) is exact whatever the
algorithm, so bucketed gradients are bit-identical to unbucketed ones; with
more ranks a ring algorithm may add the N values in a different order
(differences of a few ulps; see tests/test_bucket.py).

A gradient of ``bucket_cap_mb`` or more goes alone, at once. Buckets still
open when backward ends are flushed by the end-of-backward callback, so a
bucket delays a reduction (less overlap with backward) but never loses one.
This module packs and unpacks; ``reduce`` launches and completes.
"""
from __future__ import annotations

import torch

from .options import ShardingStrategy

MIB = 1 << 20


def unit_strategy(strategy: ShardingStrategy, numel: int, persistence_threshold: int | None) -> ShardingStrategy:
    """The strategy of one unit of ``numel`` parameters: NO_SHARD if persistent."""
    if persistence_threshold is not None and strategy != ShardingStrategy.NO_SHARD and numel <= persistence_threshold:
        return ShardingStrategy.NO_SHARD
    return strategy


class Bucket:
    """Gradients of units that share a group, dtype and collective kind."""

    def __init__(self, sharded: bool):
        self.sharded = sharded  # reduce-scatter, else all-reduce
        self.entries: list[tuple] = []  # (handle, gradient, post-divide factor)
        self.nbytes = 0

    def add(self, handle, grad: torch.Tensor, post: float):
        self.entries.append((handle, grad, post))
        self.nbytes += grad.numel() * grad.element_size()


class Bucketer:
    """Open buckets, one per (group, replicate group, dtype, device, kind)."""

    def __init__(self, cap_mb: float):
        if cap_mb <= 0:
            raise ValueError(f"zeroshard: bucket_cap_mb={cap_mb} must be positive (None turns bucketing off).")
        self.cap_bytes = cap_mb * MIB
        self.open: dict[tuple, Bucket] = {}

    def add(self, handle, grad: torch.Tensor, post: float) -> list[Bucket]:
        """Put ``grad`` (pre-divided, padded) in its bucket; returns the buckets
        that are full and must be launched now, in order."""
        nbytes = grad.numel() * grad.element_size()
        lone = Bucket(handle.sharded)
        lone.add(handle, grad, post)
        if nbytes >= self.cap_bytes:
            return [lone]  # a large gradient gains nothing from waiting
        key = (id(handle.group), id(handle.replicate_group), grad.dtype, grad.device, handle.sharded)
        bucket = self.open.get(key)
        full = []
        if bucket is not None and bucket.nbytes + nbytes > self.cap_bytes:
            full.append(self.open.pop(key))
            bucket = None
        if bucket is None:
            bucket = self.open[key] = Bucket(handle.sharded)
        bucket.add(handle, grad, post)
        return full

    def flush(self) -> list[Bucket]:
        """Every open bucket, oldest first (the end of backward)."""
        out = list(self.open.values())
        self.open.clear()
        return out

    def discard(self):
        self.open.clear()


def pack_rows(grads: list[torch.Tensor], world_size: int) -> tuple[torch.Tensor, list[int]]:
    """One reduce-scatter input for several padded gradients: row r holds
    every gradient's r-th chunk. Returns (flat input, shard sizes)."""
    sizes = [g.numel() // world_size for g in grads]
    if len(grads) == 1:
        return grads[0], sizes
    rows = torch.cat([g.view(world_size, s) for g, s in zip(grads, sizes)], dim=1)
    return rows.view(-1), sizes


def pack_flat(grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One all-reduce input for several gradients, end to end."""
    sizes = [g.numel() for g in grads]
    return (grads[0] if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])), sizes
