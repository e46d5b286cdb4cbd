"""LOCAL_STATE_DICT: each rank saves and loads only its own flat shards, in torch FSDP1's format.

The cheapest checkpoint of ZeRO-3: no gathering at all. Each sharded unit's
FlatParameter is saved as a ``ShardedTensor`` whose global size is the
unpadded flat parameter and whose one local shard is this rank's chunk
``[rank * shard_numel, ...)`` without the world-size padding, under the plain
model's names (``blocks.0._flat_param``), buffers beside it. With
``use_orig_params`` the original parameters' 1-D shard views are saved as well
and each unit's flat entry follows its subtree, as torch orders them. NO_SHARD
units have nothing to shard: they give their full parameters, as under
FULL_STATE_DICT (torch falls back the same way, with the same warning).

A LOCAL dict reloads only at the world size it was saved with (the shard
boundaries depend on it); loading checks the global size and this rank's
offset. Dicts saved by torch FSDP1 load here and the other way round; plain
padded shards under the wrapped names (zeroshard's earlier LOCAL format, and
``compat.hfai``'s per-rank files) load too (with ``use_orig_params`` that format
lacks the original parameters' entries: load it with ``strict=False``).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .state_dict import (CHECKPOINT_PREFIX, FLAT_PARAM, NO_SHARD_WARNING, WRAPPED_PREFIX, buffer_value, clean_fqn, clean_key,
                         plain_module_behaviour, raise_if_any_rank_failed, shape_mismatch, summoned_copy)
from .mixed_precision import orig_buffer_dtypes
from .summon import summon_full_params, units_of


def _layout(root, prefix: str):
    """(raw key prefix, handle) of every sharded unit in pre-order, and the NO_SHARD units."""
    sharded, full = [], []
    for name, m in root.named_modules():
        h = getattr(m, "_handle", None)
        if "_fsdp_wrapped_module" not in m._modules or h is None:  # (a checkpoint wrapper forwards the attributes)
            continue
        if h.sharded:  # the prefix its keys have: checkpoint wrappers' hooks drop their name
            sharded.append((prefix + (name + "." if name else "").replace(CHECKPOINT_PREFIX, ""), h))
        else:
            full.append(m)
    return sharded, full


def _refuse_summoned(root, what: str):
    """Inside summon_full_params the units hold their full parameters under the plain names and
    no flat shard: a LOCAL dict taken there was neither LOCAL nor loadable (torch FSDP1 fails with
    a ShardedTensor offset error). A block entered with ``plain_dicts`` (``compat.hfai``) allows it."""
    if root._plain_dicts:
        return
    busy = next((u for u in units_of(root) if u._summoning), None)
    if busy is not None:
        name = busy._handle.unit_name if busy._handle is not None else type(busy.module).__name__
        raise RuntimeError(f"zeroshard: LOCAL_STATE_DICT {what} inside summon_full_params (of unit {name}), where "
                           "the units hold full parameters, not their shards. Fix: call it outside the "
                           "summon_full_params block.")


def _kept_shards(sharded) -> dict:
    """id of each full view that a unit kept gathered since a forward with grad (use_orig_params:
    ZeRO-2, or a backward still to come) shows under an original parameter's name -> that
    parameter's shard view, which the LOCAL dict holds. torch FSDP1 saves the full tensors there,
    a dict that neither engine loads back."""
    out = {}
    for _, h in sharded:
        if h.use_orig_params:
            for i, (p, info) in enumerate(zip(h.orig_params, h.layout.params)):
                shown = info.module._parameters.get(info.name)
                if shown is not None and shown is not p:
                    out[id(shown)] = h.shard_view(i)
    return out


def _refuse_mesh(root):
    """torch FSDP1 refuses LOCAL_STATE_DICT for a model wrapped with a
    ``device_mesh`` (it saves DTensors there, which LOCAL has no form for);
    zeroshard does the same rather than save a dict torch cannot read."""
    if any(getattr(m, "_device_mesh", None) is not None for m in units_of(root)):
        raise RuntimeError("zeroshard: LOCAL_STATE_DICT does not fit a model wrapped with device_mesh (torch FSDP1 "
                           "refuses it too). Fix: use SHARDED_STATE_DICT (DTensor shards) or FULL_STATE_DICT.")


@contextlib.contextmanager
def _full_no_shard_units(units, writeback: bool):
    """NO_SHARD units show their full parameters under their own names meanwhile."""
    with contextlib.ExitStack() as stack:
        for u in units:
            stack.enter_context(summon_full_params(u, recurse=False, writeback=writeback))
        yield


def _flat_value(h, offload: bool):
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    start, valid = h.layout.shard_start, h.layout.shard_end - h.layout.shard_start
    owner = dist.get_global_rank(h.group, h.rank)  # ShardedTensor places shards by global rank
    shards = [Shard.from_tensor_and_offsets(h.local_shard.detach()[:valid], [start], owner)] if valid else []
    with comm.named("all_gather_object", f"LOCAL state_dict (unit '{h.unit_name}': ShardedTensor metadata)", h.group):
        st = init_from_local_shards(shards, h.layout.numel, process_group=h.group)  # collective: metadata
    return st.cpu() if offload else st


def save(root, prefix: str = "", keep_vars: bool = False) -> dict:
    """The LOCAL state dict. A root whose ``_local_sharded_tensors`` is False
    (``compat.hfai``: per-rank files for torch.save) gets each flat entry as the
    plain padded shard instead of a ShardedTensor."""
    _refuse_mesh(root)
    if root._plain_dicts:  # in a compat block whose dicts are the plain model's (hfai)
        return summoned_copy(root, prefix)
    _refuse_summoned(root, "state_dict()")
    sharded, no_shard = _layout(root, prefix)
    kept = _kept_shards(sharded)
    if no_shard:
        warnings.warn(NO_SHARD_WARNING, stacklevel=3)
    offload = bool(getattr(root._state_dict_config, "offload_to_cpu", False))
    as_sharded_tensor = getattr(root, "_local_sharded_tensors", True)

    def flat_value(h):
        if as_sharded_tensor:
            return _flat_value(h, offload)
        return h.local_shard.detach().cpu() if offload else h.local_shard.detach()

    owned = {id(p) for _, h in sharded if h.use_orig_params for p in h.orig_params}
    flat_keys = {p + WRAPPED_PREFIX + FLAT_PARAM: h for p, h in sharded}
    with _full_no_shard_units(no_shard, writeback=False):
        with plain_module_behaviour():
            raw = nn.Module.state_dict(root, prefix=prefix, keep_vars=True)
        full_params = {id(info.module._parameters[info.name]) for u in no_shard for info in u._handle.layout.params}
        # torch's NO_SHARD fallback is its FULL hook, which casts buffer_dtype buffers back in the unit's whole subtree
        upcast = orig_buffer_dtypes(root, no_shard, prefix)
        out, open_units, pending = {}, [], list(sharded)

        def close(key=None):  # a unit's subtree ended: with use_orig_params its flat entry comes now
            while open_units and (key is None or not key.startswith(open_units[-1][0])):
                p, h = open_units.pop()
                if h.use_orig_params:
                    out[clean_key(p) + FLAT_PARAM] = flat_value(h)

        for k, v in raw.items():
            close(k)
            for unit in [u for u in pending if k.startswith(u[0])]:  # pre-order: outer units first
                pending.remove(unit)
                open_units.append(unit)
            if k in flat_keys:
                value = flat_value(flat_keys[k])
            elif id(v) in kept:
                value = kept[id(v)].detach().cpu() if offload else kept[id(v)].detach()
            elif id(v) in full_params:
                value = v.detach().clone()
            else:
                value = buffer_value(v, keep_vars and id(v) not in owned, upcast.get(k))
                if offload:
                    value = value.cpu()
            out[clean_key(k)] = value
        close()  # the units still open (the root's) end with the dict
    return out


def _flat_local(h, value, key: str) -> torch.Tensor:
    """This rank's elements of a saved flat entry, checked against its shard (raises ValueError)."""
    n = h.local_shard.numel()
    start, valid = h.layout.shard_start, h.layout.shard_end - h.layout.shard_start
    hint = (f"(saved at another world size, or from a model wrapped otherwise? this run has world size {h.world_size}). "
            "Fix: load LOCAL state dicts at the world size and wrapping (policy, param_persistence_threshold) they were "
            "saved with, or save a FULL_STATE_DICT to change them.")
    if type(value).__name__ == "ShardedTensor":
        size, shards = tuple(value.metadata().size), value.local_shards()
        offset = shards[0].metadata.shard_offsets[0] if shards else start
        local = shards[0].tensor if shards else h.local_shard.new_empty(0)
        if size != (h.layout.numel,) or offset != start or local.numel() != valid:
            raise ValueError(f"zeroshard: LOCAL state dict entry '{key}' holds elements [{offset}, {offset + local.numel()}) "
                             f"of {size[0]} but this rank's shard of unit '{h.unit_name}' is [{start}, {start + valid}) "
                             f"of {h.layout.numel} {hint}")
    elif torch.is_tensor(value) and tuple(value.shape) in ((n,), (valid,)):  # zeroshard's earlier format: the shard
        local = value[:valid]
    else:
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"zeroshard: LOCAL state dict entry '{key}' is {shape} but this rank's shard of unit "
                         f"'{h.unit_name}' has {valid} elements ({n} with its padding) {hint}")
    return local


def _write_flat(h, local: torch.Tensor):
    """Copy checked elements (alignment gaps included) into this rank's shard; zero its tail padding."""
    valid = local.numel()
    with torch.no_grad():
        h.local_shard[:valid].copy_(local)
        h.local_shard[valid:].zero_()
    h.reshard(free=True)  # a gathered copy kept since the last forward is stale now


def load(root, state_dict, strict: bool = True):
    _refuse_mesh(root)
    _refuse_summoned(root, "load_state_dict()")
    sharded, no_shard = _layout(root, "")
    for _, h in sharded:
        if h.use_orig_params and h.unsharded:  # kept gathered since a forward: the load replaces it anyway
            h.reshard(free=True)
    # Keys compared without FSDP's and activation checkpointing's wrapper names: a
    # checkpoint wrapper's own hooks drop its name from saved keys, and torch
    # reports none of them missing.
    flat_keys = {clean_fqn(p) + FLAT_PARAM: h for p, h in sharded}
    with _full_no_shard_units(no_shard, writeback=True):
        with plain_module_behaviour():
            current = nn.Module.state_dict(root, keep_vars=True)
        raw_of = {clean_fqn(k): k for k in current}
        flats, rest, unexpected = [], {}, []
        for k, v in state_dict.items():
            key = clean_fqn(k)  # also zeroshard's earlier keys, under the wrapped names
            if key in flat_keys:
                flats.append((key, v))
            elif key in raw_of:
                rest[raw_of[key]] = v
            else:
                unexpected.append(k)
        given = {key for key, _ in flats}
        missing = [clean_fqn(k) for k in current if k not in rest and clean_fqn(k) not in flat_keys]
        missing += [key for key in flat_keys if key not in given]
        # Everything checked, and agreed by every rank, before the first write: a failure half-way left the
        # model part loaded, and a rank whose dict was fine went on alone (torch FSDP1 too).
        try:
            locals_ = [(flat_keys[key], _flat_local(flat_keys[key], v, key)) for key, v in flats]
            bad = shape_mismatch(rest, current)
            if bad is not None:
                raise ValueError(f"zeroshard: LOCAL state dict entry '{clean_fqn(bad[0])}' has shape {bad[1]} but the "
                                 f"model's is {bad[2]}. Fix: load the LOCAL state dict this model saved at this world size, "
                                 "wrapped the same way (the wrap policy and param_persistence_threshold decide which units "
                                 "are sharded, and so the shapes of use_orig_params' shards).")
            if strict and flat_keys and unexpected and not any(key in given for key in flat_keys):
                raise RuntimeError(f"zeroshard: LOCAL state dict load got no flat shard (missing {missing}) but the keys "
                                   f"{unexpected[:3]}...: this is a FULL or SHARDED state dict, and strict=False would load "
                                   "none of it. Fix: load it under the state_dict_type it was saved with.")
            if strict and (missing or unexpected):
                raise RuntimeError(f"zeroshard: LOCAL state dict mismatch: missing {missing}, unexpected {unexpected}. Fix: "
                                   "load the LOCAL state dict this model saved at this world size, wrapped the same way (the "
                                   "wrap policy and param_persistence_threshold decide which units are sharded), or pass "
                                   "strict=False.")
            problem = None
        except (RuntimeError, ValueError) as e:
            problem = e
        raise_if_any_rank_failed(root, problem)
        result = nn.Module.load_state_dict(root, rest, strict=False)
        for h, local in locals_:  # after the original parameters' views: the flat shard has the last word
            _write_flat(h, local)
    return type(result)(missing, unexpected)
