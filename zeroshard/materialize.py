"""Before sharding: give every rank the same, real parameters for its unit.

* **Meta-device init**: a model built under ``torch.device("meta")`` has no
  storage. Each unit materializes only its own modules (children that are
  units did so when they were wrapped, bottom-up), so no rank ever holds the
  whole unsharded model: ``param_init_fn(module)`` if given, else
  ``to_empty`` + ``reset_parameters()``, in torch FSDP1's breadth-first order
  so that the random streams, and hence the values, match it. As in torch,
  one meta state makes the whole unit re-initialized, real modules included.
* **sync_module_states**: rank 0's parameters and buffers are broadcast so
  that ranks that initialized differently start identical. They are packed
  into one flat buffer per dtype, and each buffer is broadcast once per
  process group (the shard group, then the replicate group under hybrid
  sharding) from that group's first rank.
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist
import torch.nn as nn

from . import agreement, comm, ext


def unit_modules(root: nn.Module, skip) -> list[nn.Module]:
    """The unit's modules, breadth-first, not entering ``skip`` (nested units, ignored).
    No modules when ``root`` is itself skipped (``FSDP(FSDP(m))``: the inner unit owns them all)."""
    if skip(root):
        return []
    order, queue, seen = [], collections.deque([root]), {root}
    while queue:
        m = queue.popleft()
        order.append(m)
        for child in m.children():
            if child not in seen and not skip(child):
                seen.add(child)
                queue.append(child)
    return order


def _own_states(module: nn.Module) -> tuple[torch.Tensor, ...]:
    return (*module.parameters(recurse=False), *module.buffers(recurse=False))


def _has_meta_state(module: nn.Module, ignored_params=frozenset()) -> bool:
    return any(t.is_meta and t not in ignored_params for t in _own_states(module))


def _wrapped_storages(root: nn.Module, is_unit) -> list[int]:
    """Where the parameters of the units already wrapped under ``root`` live
    (not ignored modules': those are the user's to initialize, as in torch)."""
    return [t.untyped_storage().data_ptr() for m in root.modules() if m is not root and is_unit(m)
            for t in m.parameters()]


@torch.no_grad()
def materialize(root: nn.Module, skip, is_unit, device: torch.device, param_init_fn=None,
                ignored_params=frozenset()) -> dict[int, nn.Parameter]:
    """Materialize the unit's modules if one of their states is on meta; ``ignored_params``
    (``ignored_states``) do not count, as in torch FSDP1: a model real but for an ignored
    parameter is left as it is, the parameter the user's to fill. Returns the parameters
    re-created (``to_empty``), by the id of the one each replaced: an ignored one's successor
    stays ignored (torch FSDP1 flattens it into the unit, and frees it after the forward)."""
    modules = unit_modules(root, skip)
    if not any(_has_meta_state(m, ignored_params) for m in modules):
        return {}
    before = [(m, dict(m._parameters)) for m in modules]
    _initialize(root, modules, is_unit, device, param_init_fn, ignored_params)
    return {id(old): m._parameters[n] for m, params in before for n, old in params.items()
            if old is not None and m._parameters.get(n) is not None and m._parameters[n] is not old}


def _initialize(root, modules, is_unit, device, param_init_fn, ignored_params) -> None:
    if param_init_fn is not None:
        if not callable(param_init_fn):
            raise ValueError(f"zeroshard: param_init_fn must be callable, got {type(param_init_fn).__name__}.")
        wrapped = _wrapped_storages(root, is_unit)
        for m in modules:
            param_init_fn(m)
        left = next((f"{type(m).__name__}.{n}" for m in modules for n, t in (*m.named_parameters(recurse=False),
                     *m.named_buffers(recurse=False)) if t.is_meta and t not in ignored_params), None)
        if left is not None:
            raise ValueError(f"zeroshard: after param_init_fn, {left} (in {type(root).__name__}) is still on the meta "
                             "device, with no values to shard. Fix: have param_init_fn materialize every module it is "
                             "given, e.g. module.to_empty(device=..., recurse=False) and then its initialization.")
        if wrapped != _wrapped_storages(root, is_unit):
            raise ValueError(
                f"zeroshard: param_init_fn re-created the parameters of a unit wrapped already, inside "
                f"{type(root).__name__} (e.g. module.to_empty(device=...) without recurse=False): that unit's values "
                "would be garbage (torch FSDP1 trains on them silently). Fix: initialize only the module's own "
                "states: module.to_empty(device=..., recurse=False), then reset them.")
        return
    # As torch FSDP1: once any state of the unit is on meta, *every* module of
    # the unit with states of its own is re-created and reset, real ones too
    # (so the random stream, and the values, are torch's).
    for m in modules:
        if not _own_states(m):
            continue
        if not hasattr(m, "reset_parameters"):
            what = "has meta-device parameters or buffers" if _has_meta_state(m) else (
                "sits in a unit with meta-device states (as torch FSDP1, every module of such a unit is re-created "
                "with to_empty + reset_parameters(), real ones too)")
            raise ValueError(f"zeroshard: {type(m).__name__} {what} but has no reset_parameters(). "
                             "Fix: give it a reset_parameters() method or pass param_init_fn=...")
        m.to_empty(device=device, recurse=False)
        m.reset_parameters()


@torch.no_grad()
def sync_module_states(root: nn.Module, skip, groups, ignored_params=frozenset()) -> None:
    """Broadcast the unit's parameters (not ``ignored_params``) and every
    buffer under ``root`` not synced yet (ignored modules' too, as torch
    FSDP1) from the first rank of each group."""
    tensors = []
    for m in unit_modules(root, skip):
        tensors += [t for t in m.parameters(recurse=False) if t not in ignored_params]
    for b in root.buffers():  # nested units synced theirs when they were wrapped
        if b.is_meta:  # an ignored module's, left for the user to fill (as torch FSDP1): no values to send
            continue
        if not getattr(b, "_zeroshard_synced", False):
            b._zeroshard_synced = True
            tensors.append(b)
    tensors = list(dict.fromkeys(tensors))  # tied tensors once
    _check_same_states(root, tensors, groups)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = collections.defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    for same in by_dtype.values():
        offsets, pos = [], 0
        for t in same:
            offsets.append(pos)
            pos += t.numel()
        flat = ext.flatten([t.detach() for t in same], offsets, pos)
        for group in groups:
            if group is not None and group.size() > 1:
                comm.broadcast(flat, dist.get_global_rank(group, 0), group, "sync_module_states")
        ext.unflatten_into(flat, offsets, [t.data for t in same])


def _check_same_states(root: nn.Module, tensors: list, groups) -> None:
    """Every rank must broadcast the same list of tensors: one buffer more or less on a rank
    (gloo does not compare sizes) shifts every later buffer's values into its neighbours'.
    Under hybrid sharding (``groups``: shard, replicate) every rank of the grid learns of a
    difference anywhere in it (agreement.difference_in_grid): one whose row and column agree
    waited in the next comparison while the ranks that found one raised."""
    names = {id(t): n for named in (root.named_parameters(remove_duplicate=False), root.named_buffers(remove_duplicate=False))
             for n, t in named}
    mine = [(names.get(id(t), "?"), tuple(t.shape), str(t.dtype)) for t in tensors]

    def words(differs, group) -> str:
        r, first, theirs = differs
        i, a, b = agreement.first_mismatch(first, theirs)
        return f"#{i} is {a} on rank {dist.get_global_rank(group, 0)} but {b} on rank {r}"

    found = agreement.difference_in_grid(mine, groups[0], groups[1] if len(groups) > 1 else None,
                                         "sync_module_states (comparing the states across ranks)",
                                         "sync_module_states (sharing what the comparisons found)", words)
    if found is not None:
        raise ValueError(f"zeroshard: sync_module_states in FullyShardedDataParallel({type(root).__name__}): "
                         f"the states to broadcast differ across ranks: {found}. Fix: build the same model "
                         "(parameters and buffers) on every rank.")
