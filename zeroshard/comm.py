"""The three collectives of ZeRO: all-gather (parameters), reduce-scatter
(gradients) and all-reduce (NO_SHARD gradients, replicas, norms).

Every collective the engine issues goes through here so that one place counts
the bytes each rank sends (compare with the ZeRO-3 volume 3Ψ(N−1)/N) and names
the collective, the unit and the lifecycle step when it fails (a dead or
diverged peer surfaces as a CollectiveError within the process group's
timeout instead of a silent hang).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to the
# *_single names (the old names warn); keep working on torch versions without them.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)  # windows are removed by identity: two with equal counts are still two
class CommStats:
    """Calls and bytes per collective, as seen by this rank.

    ``bytes`` counts the payload a ring algorithm moves per rank: (N−1)/N of
    the gathered/reduced buffer for all-gather and reduce-scatter, 2(N−1)/N
    for all-reduce, which is the accounting the ZeRO paper uses.
    """

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(float))
    group_sizes: dict = field(default_factory=lambda: defaultdict(set))  # kind -> sizes of the groups used
    group_ranks: dict = field(default_factory=lambda: defaultdict(set))  # kind -> the groups used, as global ranks

    def total_bytes(self) -> float:
        return float(sum(self.bytes.values()))


_active: list[CommStats] = []


@contextlib.contextmanager
def comm_stats():
    """Count the collectives zeroshard issues inside the block."""
    stats = CommStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


def _record(kind: str, full_numel: int, elem_size: int, world: int, group, factor: float = 1.0):
    if not _active or world == 1:
        return
    moved = factor * full_numel * elem_size * (world - 1) / world
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    for stats in _active:
        stats.calls[kind] += 1
        stats.bytes[kind] += moved
        stats.group_sizes[kind].add(world)
        stats.group_ranks[kind].add(ranks)


class CollectiveError(RuntimeError):
    """A collective that could not complete: a peer died, diverged or timed out."""


def _fail(kind: str, what: str, group, err: BaseException):
    rank = dist.get_rank()
    # gloo words a timeout either way: "Timed out waiting ..." on the waiting side,
    # "Application timeout caused pair closure" once its own timeout closed the pair.
    text = str(err).lower()
    cause = "timed out (the process group's timeout)" if "timed out" in text or "timeout caused" in text else "failed"
    return CollectiveError(
        f"zeroshard: rank {rank}: {kind} for {what} {cause} on a group of {dist.get_world_size(group)} ranks: {err}\n"
        "Likely causes: another rank died or raised, did not make this call (state_dict, optim_state_dict and "
        "checkpoint saves/loads are collective: every rank calls them), or ranks diverged (a different model or wrap "
        "policy, or a different number of forward/backward calls on some rank). Fix that rank; the error there names its cause. "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL names collectives that do not pair (where gloo may abort a rank instead)."
    )


class Pending:
    """An asynchronous collective whose ``wait()`` names it if it fails."""

    def __init__(self, work, kind: str, what: str, group):
        self.work, self.kind, self.what, self.group = work, kind, what, group

    def wait(self):
        try:
            self.work.wait()
        except RuntimeError as e:
            raise _fail(self.kind, self.what, self.group, e) from e


@contextlib.contextmanager
def named(kind: str, what: str, group=None):
    """Collectives that torch issues inside the block (DCP's save/load, ShardedTensor's
    metadata exchange), not through this module, named with the rank if they fail:
    gloo's own error says neither which rank nor which call."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        if not dist.is_initialized() or not _from_a_collective(e):
            raise  # torch's own error inside the block (a planner's, a metadata check's): not a collective's
        raise _fail(kind, what, group, e) from e


def _from_a_collective(err: RuntimeError) -> bool:
    """Raised by a collective: c10d's DistError, or any error whose innermost Python frame is
    torch.distributed's collective code (the call or its wait: gloo's timeouts and closed peers,
    DETAIL's mismatch and monitoredBarrier reports), whatever its wording."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    # By name, not against distributed_c10d.__file__: a venv moved after install keeps its old paths in the .pyc files.
    return isinstance(err, dist.DistError) or (tb is not None and tb.tb_frame.f_code.co_filename.endswith("distributed_c10d.py"))


def _issue(kind: str, what: str, group, async_op: bool, call):
    try:
        work = call()
    except RuntimeError as e:
        raise _fail(kind, what, group, e) from e
    if not async_op:
        return None
    return Pending(work, kind, what, group)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True, what: str = "parameters"):
    """Gather every rank's ``shard`` into ``output`` (rank r's at r·len(shard))."""
    world = dist.get_world_size(group)
    _record("all_gather", output.numel(), output.element_size(), world, group)
    return _issue("all_gather", what, group, async_op, lambda: _all_gather(output, shard, group=group, async_op=async_op))


def reduce_scatter(shard_out: torch.Tensor, full: torch.Tensor, group, async_op: bool = True, what: str = "gradients"):
    """Sum ``full`` over ranks and keep this rank's contiguous chunk."""
    world = dist.get_world_size(group)
    _record("reduce_scatter", full.numel(), full.element_size(), world, group)
    return _issue("reduce_scatter", what, group, async_op, lambda: _reduce_scatter(shard_out, full, group=group, async_op=async_op))


def all_reduce(tensor: torch.Tensor, group, async_op: bool = False, op=dist.ReduceOp.SUM, what: str = "gradients"):
    world = dist.get_world_size(group)
    _record("all_reduce", tensor.numel(), tensor.element_size(), world, group, factor=2.0)
    return _issue("all_reduce", what, group, async_op, lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def gather_objects(obj, group=None, what: str = "exchanging metadata", tag: str | None = None) -> list:
    """Every rank's picklable ``obj``, by group rank (``all_gather_object``,
    named in the error if a rank never joins). Each rank sends ``what`` beside
    ``obj`` (or ``tag``, where ``what`` holds a name that may differ across ranks):
    ranks that diverged into two different exchanges (a unit more on one rank, an
    argument given on some ranks only) would otherwise read each other's data as
    their own and report a wrong cause; every rank of the exchange raises naming both."""
    everyone = [None] * dist.get_world_size(group)
    tag = what if tag is None else tag
    _issue("all_gather_object", what, group, False, lambda: dist.all_gather_object(everyone, (tag, obj), group=group))
    other = next((r for r, (t, _) in enumerate(everyone) if t != tag), None)
    if other is not None:
        rank = dist.get_rank()
        theirs = other if group is None else dist.get_global_rank(group, other)
        raise CollectiveError(
            f"zeroshard: rank {rank}: the ranks are in different exchanges: this one in '{tag}', rank {theirs} in "
            f"'{everyone[other][0]}'. The ranks diverged: a different model or wrap policy (a unit more or of another "
            "class on some rank), different FSDP arguments on some ranks (e.g. sync_module_states), or different calls "
            "(a state dict or checkpoint call on some ranks only). Fix: build and call the same on every rank.")
    return [o for _, o in everyone]


def broadcast_objects(box: list, src: int, group=None, what: str = "exchanging metadata") -> None:
    """``broadcast_object_list(box, src)`` in place (``src`` a global rank), named in the error."""
    _issue("broadcast_object_list", what, group, False, lambda: dist.broadcast_object_list(box, src=src, group=group))


def broadcast(tensor: torch.Tensor, src: int, group=None, what: str = "parameters") -> None:
    """``broadcast(tensor, src)`` in place (``src`` a global rank), named in the error."""
    _issue("broadcast", what, group, False, lambda: dist.broadcast(tensor, src=src, group=group))


def barrier(group=None, what: str = "waiting for every rank") -> None:
    _issue("barrier", what, group, False, lambda: dist.barrier(group=group))


def first_problem(problem, group=None, what: str = "checking the inputs"):
    """(global rank, problem) of the first rank of ``group`` (default: all) whose
    ``problem`` (any picklable value; None: no problem) is not None, or None:
    every rank learns of any rank's problem before acting, so no rank goes
    ahead alone (collective where distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None if problem is None else (0, problem)
    everyone = gather_objects(problem, group, what)
    r = next((r for r, p in enumerate(everyone) if p is not None), None)
    return None if r is None else (r if group is None else dist.get_global_rank(group, r), everyone[r])


def first_difference(value, group=None, what: str = "comparing across ranks"):
    """(global rank, rank 0's ``value``, that rank's) for the first rank of ``group``
    (default: all) whose picklable ``value`` differs from the group's first rank's, or
    None: every rank names the same difference (collective where distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    first, *rest = gather_objects(value, group, what)
    r = next((r for r, v in enumerate(rest, 1) if v != first), None)
    return None if r is None else (r if group is None else dist.get_global_rank(group, r), first, rest[r - 1])
