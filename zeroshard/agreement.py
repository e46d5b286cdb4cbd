"""Ranks agree: the comparisons across ranks that keep a mistake on one rank
from training on silently. Collectives pair by call order, not by content, so
ranks that wrapped different models (or the same one with other settings)
would all-gather mismatched buffers (garbage, or a hang): each unit's layout
and settings are compared once, at construction. Under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, after every backward, the ranks also
compare the units they ran forward, in order, and the ones they reduced.
``zeroshard.initialize`` compares its parsed DeepSpeed config.
"""
from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from . import comm
from .flat_param import FlatLayout


def check_same_layout(layout: FlatLayout, dtype, group, unit_name: str, settings: dict | None = None,
                      replicate_group=None):
    """Ranks that wrapped different models would all-gather mismatched
    buffers (garbage or a hang); compare the layouts once, at construction,
    and the ``settings`` that must agree too (sharding strategy,
    use_orig_params, mixed-precision dtypes, which parameters are frozen:
    ranks disagreeing there train on to silently wrong, even non-finite,
    values, or their collectives mismatch). Under hybrid sharding the shard
    group and the replica group are compared, then the shard group shares
    what each rank found: a rank that agrees with its whole row and column
    still learns of a difference elsewhere in the grid, so every rank raises."""
    mine = (str(dtype), [(p.fqn, tuple(p.shape), p.stride) for p in layout.params],  # stride: the memory order flattened
            sorted((k, str(v)) for k, v in (settings or {}).items()))
    diff = difference_in_grid(mine, group, replicate_group, f"construction (comparing unit '{unit_name}' across ranks)",
                              f"construction (sharing what the comparisons of unit '{unit_name}' found)", _layout_words)
    if diff is not None:
        raise ValueError(
            f"zeroshard: unit '{unit_name}' has a different layout on different ranks ({diff}). "
            "Fix: build the same model, with the same wrap policy, ignored modules and FSDP arguments, on every rank."
        )


def first_mismatch(ours: list, theirs: list) -> tuple[int, object, object]:
    """(i, ours[i], theirs[i]) at the first position where two lists compared across ranks
    differ; past the end of the shorter one its side reads "nothing"."""
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return i, *(v[i] if i < len(v) else "nothing" for v in (ours, theirs))


def difference_in_grid(value, group, replicate_group, what: str, sharing: str, words) -> str | None:
    """The first difference in ``value`` across ranks, in ``words(first_difference's result, the
    group)``, or None. Compared over ``group`` (None: not compared) and, under hybrid sharding,
    ``replicate_group``: every rank runs both comparisons, then the shard group shares what they
    found (``sharing`` names that exchange), on every rank of it (a replicate group of 1 too, see
    groups.check_grid), so a rank that agrees with its whole row and column still learns of a
    difference elsewhere in the grid."""
    found = None
    for g in (group, replicate_group):
        differs = comm.first_difference(value, g, what) if g is not None else None
        if differs is not None and found is None:
            found = words(differs, g)
    if replicate_group is not None:
        shared = comm.first_problem(found, group, sharing)
        found = shared[1] if shared is not None else None
    return found


def _layout_words(differs, group) -> str:
    """A layout difference (``first_difference``'s result over ``group``), in words."""
    r, first, theirs = differs
    r0 = dist.get_global_rank(group, 0)
    if theirs[0] != first[0]:
        return f"dtype {first[0]} on rank {r0}, {theirs[0]} on rank {r}"
    if theirs[2] != first[2]:
        (k, a), (_, b) = next((x, y) for x, y in zip(first[2], theirs[2]) if x != y)
        return f"{k}={a} on rank {r0}, {k}={b} on rank {r}"
    i, a, b = first_mismatch(first[1], theirs[1])
    return f"parameter #{i}: rank {r0} has {a}, rank {r} has {b}"


def described(obj):
    """A setting compared across ranks: a dataclass by its fields, another object by its class
    (its default repr holds a memory address, which differs on every rank)."""
    if obj is None or dataclasses.is_dataclass(obj):
        return obj
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_same_order(root) -> None:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (where torch FSDP1 compares its forward
    order across ranks): after each backward the ranks compare the units they ran
    forward, in order, and the units they reduced. Units of the same shapes pair
    up silently otherwise: a branch taken on one rank only all-gathers another
    unit's shards, and a loss using different heads on different ranks sums one
    head's gradient with another's. One object all-gather per backward."""
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() != "DETAIL" or root.process_group.size() == 1:
        return
    rt = root._runtime
    path = {id(m): n.replace("_fsdp_wrapped_module.", "") or "<root>" for n, m in root.named_modules()}
    units = [s for s in rt.states if s._handle is not None]
    name = {id(s._handle): path.get(id(s), type(s.module).__name__) for s in units}
    mine = ([name[id(h)] for h in rt.post_forward_order], [name[id(s._handle)] for s in units if s._handle.post_backward_called])
    differs = comm.first_difference(mine, root.process_group, "TORCH_DISTRIBUTED_DEBUG=DETAIL order check")
    if differs is not None:
        r, first, theirs = differs
        i, what = next((i, w) for i, w in ((0, "ran forward through units"), (1, "reduced the gradients of units"))
                       if theirs[i] != first[i])
        raise RuntimeError(
            f"zeroshard: ranks disagree (TORCH_DISTRIBUTED_DEBUG=DETAIL): rank 0 {what} {first[i]}, rank {r} {what} "
            f"{theirs[i]}; their collectives paired different units, so the gradients are wrong. Fix: run the same "
            "units on every rank, and make every output a unit computes part of every rank's loss "
            "(e.g. + 0 * head_b_out.sum()).")


def check_same_model(model) -> None:
    """``zeroshard.initialize`` at stages 0/1, whose parameters are replicated: every rank must hold
    the same parameters and buffers (as DDP checks), else rank 0's weights broadcast into other
    shapes and the flat gradients sum unrelated elements, silently or as an abort (collective)."""
    mine = [(n, tuple(t.shape), str(t.dtype)) for named in (model.named_parameters(), model.named_buffers())
            for n, t in named]
    differs = comm.first_difference(mine, None, "initialize (comparing the model across ranks)")
    if differs is not None:
        r, first, theirs = differs
        i, a, b = first_mismatch(first, theirs)
        raise ValueError(f"zeroshard.initialize: the model differs across ranks: tensor #{i} is {a} on rank 0 but {b} "
                         f"on rank {r}. Fix: build the same model on every rank.")


def check_same_config(cfg) -> None:
    """``zeroshard.initialize``: every rank must train with one config: a different stage, accumulation or
    precision mismatches collectives (a timeout or an abort naming unrelated ones),
    a different clipping or optimizer drifts the replicas apart silently (collective)."""
    ignored = ("raw.", "steps_per_print", "wall_clock_breakdown", "zero.not_acted_on.")  # no effect on training
    mine = {k: repr(v) for k, v in _flat(dataclasses.asdict(cfg), "").items() if not k.startswith(ignored)}
    differs = comm.first_difference(mine, None, "initialize (comparing the config across ranks)")
    if differs is not None:
        r, first, theirs = differs
        key = next(k for k in sorted(set(first) | set(theirs)) if first.get(k) != theirs.get(k))
        raise ValueError(f"zeroshard.initialize: config {key} is {_shown(first, key)} on rank 0 but "
                         f"{_shown(theirs, key)} on rank {r}. Fix: give every rank the same config.")


def _flat(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _shown(flat: dict, key: str) -> str:
    """``key``'s value in a ``_flat`` config; a section one rank sets (and so was split into
    subkeys) where another has None or {} is shown whole."""
    if key in flat:
        return flat[key]
    inside = [f"{k[len(key) + 1:]}: {v}" for k, v in flat.items() if k.startswith(key + ".")]
    return "{" + ", ".join(inside) + "}" if inside else "not set"
