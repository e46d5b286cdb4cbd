"""Process groups for hybrid sharding (HSDP): shard inside a group, replicate across.

With HYBRID_SHARD each parameter is sharded over the ranks of a *shard group*
(e.g. one node, fast links) and replicated across *replica groups* (the same
position in every node). A gradient is reduce-scattered inside the shard group,
then its shard is all-reduced across replicas. Three ways to say the layout,
as in torch FSDP1 plus one zeroshard shorthand:

* ``process_group=(shard_group, replicate_group)``
* ``device_mesh``: a 2-D DeviceMesh, dim 0 replicate, dim 1 shard
* ``fsdp_group_size=k``: consecutive blocks of k ranks shard, blocks replicate

ZeRO++'s hpZ (``hpz_group_size=k``, see ``hpz``) uses the same blocks of k
consecutive ranks for its secondary shards (:func:`hpz_group`).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import comm
from .options import ShardingStrategy

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# (k, world) -> (shard, replicate): built once, so 50 models do not make 50 sets of groups;
# rebuilt once the default group they came from was destroyed (a second init_process_group).
_block_groups: dict[tuple[int, int], tuple] = {}


def _alive(group) -> bool:
    try:
        dist.get_process_group_ranks(group)  # a local lookup; destroy_process_group() drops every group
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


def _default_timeout():
    """The timeout init_process_group was given: new_group would otherwise wait on its own
    groups' collectives for torch's 30-minute default, whatever the user asked for."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # a backend without options: torch's default
        return None


def block_groups(k: int, name: str = "fsdp_group_size"):
    """(shard group of this rank's block of k, replicate group of its position)."""
    world = dist.get_world_size()
    if isinstance(k, bool) or not isinstance(k, int):  # True was 1 (no sharding at all), 2.0 passed
        raise ValueError(f"zeroshard: {name}={k!r} must be an int (the ranks of one shard group). "
                         "Fix: pass an int that divides the world size, e.g. the ranks per node.")
    if k <= 0 or world % k:
        raise ValueError(
            f"zeroshard: {name}={k} does not divide the world size {world}. "
            "Fix: pick a divisor of the world size (e.g. the ranks per node)."
        )
    # Every rank must create every group, in the same order: ranks that disagree on k
    # would wait in new_group's rendezvous (30 minutes by default), so they agree first.
    differs = comm.first_difference(k, None, f"{name} (the same on every rank?)")
    if differs is not None:
        r, first, theirs = differs
        raise ValueError(f"zeroshard: {name} differs across ranks: rank 0 has {first}, rank {r} has {theirs}. "
                         "Fix: pass the same value on every rank.")
    key = (k, world)
    if key not in _block_groups or not all(map(_alive, _block_groups[key])):
        rank, shard, replicate, timeout = dist.get_rank(), None, None, _default_timeout()
        for start in range(0, world, k):
            g = dist.new_group(list(range(start, start + k)), timeout=timeout)
            if start <= rank < start + k:
                shard = g
        for pos in range(k):
            g = dist.new_group(list(range(pos, world, k)), timeout=timeout)
            if rank % k == pos:
                replicate = g
        _block_groups[key] = (shard, replicate)
    return _block_groups[key]


def resolve(process_group, device_mesh, strategy, fsdp_group_size):
    """(shard group, replicate group or None) for this unit."""
    if process_group is None and device_mesh is None and (not dist.is_available() or not dist.is_initialized()):
        raise RuntimeError("zeroshard: FullyShardedDataParallel needs a process group, but torch.distributed is not "
                           "initialized. Fix: call torch.distributed.init_process_group('gloo' or 'nccl', ...) before "
                           "wrapping, or pass process_group=...")
    if process_group is not None and device_mesh is not None:
        raise ValueError("zeroshard: FullyShardedDataParallel got both process_group and device_mesh. "
                         "Fix: pass only one of them (the mesh's groups are the process groups).")
    if fsdp_group_size is not None:
        if process_group is not None or device_mesh is not None:
            raise ValueError("zeroshard: FullyShardedDataParallel got fsdp_group_size and "
                             f"{'process_group' if process_group is not None else 'device_mesh'}; fsdp_group_size makes "
                             "groups of its own, which would replace them. Fix: pass only one of process_group, "
                             "device_mesh and fsdp_group_size.")
        if strategy not in HYBRID and strategy is not None:
            raise ValueError("zeroshard: fsdp_group_size shards within groups, which needs sharding_strategy=HYBRID_SHARD "
                             "or _HYBRID_SHARD_ZERO2. Fix: pass one of them (or leave sharding_strategy unset).")
        return block_groups(fsdp_group_size)
    if device_mesh is not None:
        if device_mesh.ndim == 2 and strategy in HYBRID:
            return device_mesh.get_group(1), device_mesh.get_group(0)
        if device_mesh.ndim == 1 and strategy not in HYBRID:
            return device_mesh.get_group(0), None
        raise ValueError(f"zeroshard: a {device_mesh.ndim}-D device_mesh does not fit {strategy.name}. "
                         "Fix: 2-D (replicate, shard) for hybrid strategies, 1-D otherwise.")
    if strategy in HYBRID:
        if isinstance(process_group, tuple) and len(process_group) == 2:
            _check_member(process_group[0], "process_group[0] (the shard group)")
            _check_member(process_group[1], "process_group[1] (the replicate group)")
            _check_hybrid(*process_group)
            return process_group
        if process_group is not None:
            raise ValueError("zeroshard: hybrid sharding takes process_group=(shard_group, replicate_group). "
                             "Fix: pass the tuple, a 2-D device_mesh, or fsdp_group_size=k.")
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None:
            raise ValueError("zeroshard: HYBRID_SHARD needs to know the shard groups. Fix: pass "
                             "process_group=(shard_group, replicate_group), a 2-D device_mesh, or fsdp_group_size=k "
                             "(or launch with torchrun, which sets LOCAL_WORLD_SIZE: one shard group per node).")
        return block_groups(int(local))
    if isinstance(process_group, tuple):
        raise ValueError(f"zeroshard: a (shard, replicate) process_group tuple needs a hybrid strategy, not {strategy.name} "
                         "(a unit auto-wrapped under a hybrid root is given the root's groups as such a tuple). Fix: give "
                         "the unit HYBRID_SHARD or _HYBRID_SHARD_ZERO2, or a process_group of its own in the policy's "
                         "kwargs (e.g. process_group=dist.group.WORLD to replicate it on every rank).")
    _check_member(process_group, "process_group")
    return process_group, None


def _check_hybrid(shard, replicate) -> None:
    """The two groups are a row and a column of a grid through this rank: they
    share this rank only. Overlapping ones (e.g. the world twice) sum each
    gradient over some ranks twice: wrong values, silently (torch FSDP1 trains
    on them). (Their sizes need not multiply to the world: a data-parallel
    grid may be part of a larger job.)"""
    shard_ranks = set(dist.get_process_group_ranks(shard or dist.group.WORLD))
    replicate_ranks = set(dist.get_process_group_ranks(replicate or dist.group.WORLD))
    if shard_ranks & replicate_ranks != {dist.get_rank()}:
        raise ValueError(
            f"zeroshard: rank {dist.get_rank()}: HYBRID_SHARD's shard group (ranks {sorted(shard_ranks)}) and replicate "
            f"group (ranks {sorted(replicate_ranks)}) share ranks {sorted(shard_ranks & replicate_ranks)}: they must "
            "share only this rank (a row and a column of a grid). Fix: build them as a grid (e.g. "
            "init_device_mesh('cpu', (replicas, shard_size)) and pass device_mesh=), or pass fsdp_group_size=k.")


def check_grid(shard, replicate) -> None:
    """Every rank of the replicate group holds the same part of the model: the
    same position in a shard group of the same size. Crossed columns (ranks 0
    and 3 of shard groups {0,1}, {2,3} replicating each other) would add up
    different halves of each parameter: replicas diverging silently; shard
    groups of different sizes hang in the first collective. And every rank of
    a shard group has a replicate group of one size: ranks 1 and 3 of shard
    groups {0,1}, {2,3} left alone while 0 and 2 replicate each other never
    average their half, which drifts apart. Checked once per pair of groups,
    by one exchange over each group, at the root's first forward (not at
    construction: a rank whose construction raised would leave the others
    waiting in it)."""
    mine = (dist.get_rank(shard), dist.get_world_size(shard))
    everyone = comm.gather_objects(mine, replicate, what="HYBRID_SHARD: checking the replicate group's shard positions")
    sizes = comm.gather_objects(dist.get_world_size(replicate), shard, what="HYBRID_SHARD: checking the replicate groups' sizes")
    fix = ("Fix: build the groups as a grid, e.g. init_device_mesh('cpu', (replicas, shard_size)) and device_mesh=, "
           "or fsdp_group_size=k.")
    if any(theirs != mine for theirs in everyone):
        ranks = dist.get_process_group_ranks(replicate)
        seen = ", ".join(f"rank {r}: {p} of {n}" for r, (p, n) in zip(ranks, everyone))
        raise ValueError(f"zeroshard: HYBRID_SHARD's replicate group (ranks {ranks}) joins ranks at different positions "
                         f"of their shard groups ({seen}); each must hold the same part of the model. {fix}")
    if len(set(sizes)) > 1:
        seen = ", ".join(f"rank {r}: {n}" for r, n in zip(dist.get_process_group_ranks(shard), sizes))
        raise ValueError(f"zeroshard: HYBRID_SHARD's replicate groups have different sizes across the shard group "
                         f"(ranks {dist.get_process_group_ranks(shard)}; replicas {seen}): the parts of the model held by "
                         f"the ranks in smaller groups would be averaged over fewer replicas, or none, and drift apart. {fix}")


def _check_member(group, what: str) -> None:
    """A group is a ProcessGroup this rank belongs to: on ranks outside its
    ranks, dist.new_group returns a placeholder (not a group)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"zeroshard: rank {dist.get_rank()}: {what} is {group!r} ({type(group).__name__}), not a process group this "
            "rank belongs to (dist.new_group(ranks) returns a placeholder on ranks outside `ranks`). Fix: create every "
            "group on every rank and pass each rank the one that contains it.")


def hpz_group(k: int, shard_group, strategy):
    """The group of k consecutive ranks that holds this rank's hpZ secondary shards."""
    if strategy != ShardingStrategy.FULL_SHARD:
        raise ValueError(f"zeroshard: hpz_group_size needs sharding_strategy=FULL_SHARD, not {strategy.name}: only ZeRO-3 "
                         "gathers again for backward (ZeRO-2 keeps the forward's parameters; hybrid already gathers "
                         "within a group). Fix: use FULL_SHARD, or drop hpz_group_size.")
    if shard_group not in (None, dist.group.WORLD) and dist.get_world_size(shard_group) != dist.get_world_size():
        raise ValueError("zeroshard: hpz_group_size shards secondary copies over blocks of the default group; "
                         "a custom process_group is not supported with it. Fix: leave process_group unset.")
    return block_groups(k, "hpz_group_size")[0]
