"""Hierarchical secondary shards: ZeRO++'s hpZ (Wang et al., 2023, section 3.2).

ZeRO-3 all-gathers a unit's parameters over all N ranks twice per step. hpZ
makes the backward one cheap: when the forward's all-gather has produced the
full parameters, each rank keeps a *secondary shard* of them, partitioned
only within its group of k consecutive ranks (a node, on real hardware:
NVLink instead of the network), and the backward all-gather runs over that
intra-group process group. The k ranks of a group hold the k consecutive
pieces of the padded buffer, so their gather rebuilds it exactly: training is
bit-identical to FULL_SHARD.

The trade: each rank holds ``padded_numel / k`` extra elements (compute dtype)
per unit from its forward to its backward — at most the sum over the non-root
units at the start of backward — and sends ``padded·(k−1)/k`` per unit in the
backward gather over k ranks instead of ``padded·(N−1)/N`` over N
(``estimate.hpz_tradeoff`` computes both for a model). Gradients are still
reduce-scattered over all N ranks; the secondary copy is dropped once the
backward gather has consumed it, and at the next forward in any case (the
optimizer has changed the parameters by then).

Use: ``FullyShardedDataParallel(model, hpz_group_size=k)`` with FULL_SHARD.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm


class SecondaryShards:
    """This rank's place in its hpZ group of ``k`` consecutive ranks."""

    def __init__(self, group):
        self.group = group
        self.k, self.index = group.size(), group.rank()

    def save(self, full: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's piece of the gathered buffer (``full``, padded)."""
        n = full.numel() // self.k  # the padded buffer is N shards, and k divides N
        return full[self.index * n : (self.index + 1) * n].clone()

    def gather(self, full: torch.Tensor, secondary: torch.Tensor, what: str) -> "SecondaryGather":
        return SecondaryGather(comm.all_gather(full, secondary, self.group, what=what + " from hpZ secondary shards"),
                               secondary)


def drop_changed_secondaries(handles) -> None:
    """At the start of a backward: the secondary shards of units whose shard changed on any
    rank since their forward (an optimizer step, an in-place edit: ``shard_version()``) are
    dropped on every rank, so those units gather the new shard over the whole group, as
    ZeRO-3, and the others inside their hpZ group. One MAX all-reduce: a rank deciding alone
    (its slice empty, its counters unmoved) gathered over another group than its partners and
    hung. Edits through ``.data`` move no counter and are not seen (as for a kept unit)."""
    hs = [h for h in handles if h.hpz is not None]
    if not hs:
        return
    changed = torch.tensor([float(h.secondary is not None and h.secondary_version != h.shard_version()) for h in hs],
                           device=hs[0].device)
    comm.all_reduce(changed, hs[0].group, op=dist.ReduceOp.MAX, what="hpZ: checking whether shards changed since forward")
    for h, c in zip(hs, changed.tolist()):
        if c:
            h.secondary = None


class SecondaryGather:
    """The intra-group all-gather in flight; it owns the secondary shard until done."""

    def __init__(self, work, secondary: torch.Tensor):
        self.work, self.secondary = work, secondary

    def wait(self):
        self.work.wait()
        self.secondary = None  # consumed: its memory is released
