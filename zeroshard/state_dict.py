"""Seeing and saving the model whole although each rank holds 1/N of it.

* ``summon_full_params`` (in :mod:`zeroshard.summon`): the model whole for
  the duration of a block.
* FULL_STATE_DICT (the default): ``state_dict()`` walks the model as
  nn.Module does, gathering each unit when the walk reaches it (so module
  hooks and ``get_extra_state`` see full values) and copying its parameters
  (to the CPU with ``offload_to_cpu``) before freeing it, as torch FSDP1's
  hooks do; the keys are the plain model's, so a non-FSDP model loads it with
  ``strict=True``. ``load_state_dict()`` first walks the model for its keys
  and full shapes (every rank learns of any mismatch before one writes), then
  runs nn.Module's load with each unit gathered as the load reaches it and
  written back into the shards and freed once its subtree is loaded.
* LOCAL_STATE_DICT: each rank's flat shards, see ``local_state``.
* SHARDED_STATE_DICT: the plain model's keys, each parameter of a sharded
  unit a DTensor of this rank's rows (see ``sharded_state``: ``Shard(0)``
  over the process group, replicated across replica groups under hybrid
  sharding); as torch FSDP1, NO_SHARD units' parameters (with its warning),
  ignored parameters and buffers stay plain tensors. Saved with
  ``torch.distributed.checkpoint``, which records every chunk's offsets, so a
  checkpoint loads at any world size. The rows are cut from each unit's
  gathered parameters while the walk holds it, and a load gathers a unit's
  rows back when it enters the unit (so the modules inside see full values,
  as torch's): the peak is this rank's rows plus about one unit (save) or
  two (load), and no mapping is needed between the flat shard
  (which splits parameters anywhere) and DCP's per-parameter chunks.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm, ext
from .mixed_precision import CHECKPOINT_PREFIX, orig_buffer_dtypes
from .options import StateDictType
from .sharded_state import check_row_shard, device_mesh, from_row_shard, is_sharded, row_keys_differ, to_row_shard
from .summon import summon_full_params, units_of

WRAPPED_PREFIX = "_fsdp_wrapped_module."
FLAT_PARAM = "_flat_param"
# torch FSDP1's words: LOCAL and SHARDED state dicts of NO_SHARD units hold full tensors.
NO_SHARD_WARNING = "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned."

_passthrough = [0]  # >0 while nn.Module's own (un-FSDP'd) state_dict traversal runs


@contextlib.contextmanager
def plain_module_behaviour():
    """Inside, FSDP units' state_dict() is nn.Module's (needed because
    nn.Module.state_dict calls each child's state_dict())."""
    _passthrough[0] += 1
    try:
        yield
    finally:
        _passthrough[0] -= 1


def passthrough_active() -> bool:
    return _passthrough[0] > 0


def clean_key(key: str) -> str:
    return key.replace(WRAPPED_PREFIX, "")


def summoned_copy(module: nn.Module, prefix: str = "") -> dict:
    """The plain model's state dict of ``module`` while its units hold their full parameters
    (inside summon_full_params): copies under the plain keys, with no collective (the block
    frees the gathered originals on exit)."""
    with plain_module_behaviour():
        raw = nn.Module.state_dict(module, prefix=prefix, keep_vars=True)
    return {clean_key(k): v.detach().clone() for k, v in raw.items()}


def clean_fqn(key: str) -> str:
    """A parameter's name as torch FSDP1's optimizer state dicts give it (its
    ``clean_tensor_name``): without FSDP's nor activation checkpointing's wrapper prefixes."""
    return clean_key(key).replace(CHECKPOINT_PREFIX, "")


def _check_full(h):
    infos = h.layout.params
    if h.flat_param.numel() < h.layout.numel or any(info.module._parameters.get(info.name) is None for info in infos):
        # Only inside summon_full_params(rank0_only=True) on another rank than 0 (torch asserts there).
        raise RuntimeError(f"zeroshard: state_dict() inside summon_full_params(rank0_only=True) on rank {h.rank}: "
                           f"unit '{h.unit_name}' holds no full parameters here (only rank 0 keeps them). Fix: take "
                           "the state dict outside the block, or only on rank 0.")


def _unit_copies(h) -> list[torch.Tensor]:
    """Independent copies of one summoned unit's full parameters: one batched
    unflatten (the C++ extension when built) instead of a clone each."""
    infos = h.layout.params
    outs = ext.unflatten(h.flat_param.detach(), [i.offset for i in infos], [i.shape for i in infos])
    return [i.unflat(o.view(-1)) for o, i in zip(outs, infos)]  # each copy holds its segment in memory order


class _Walk:
    """One FULL/SHARDED ``state_dict()`` walk under way (see :func:`walk_unit`):
    whether to copy (not off rank 0 with rank0_only), to the CPU or not, or
    only to record full shapes (load's check); for SHARDED, the mesh whose rows
    of sharded units' parameters are copied instead of the full tensors; which
    keys got copies, and the ids of the copies of sharded units' parameters."""

    def __init__(self, copy: bool, offload: bool, shapes: bool = False, rows=None):
        self.copy, self.offload, self.shapes, self.rows = copy, offload, shapes, rows
        self.copied, self.sharded_ids = set(), set()  # ids of the copies of sharded units' parameters


_walk: list[_Walk | None] = [None]


def walk_unit(unit, destination, walk):
    """``walk(destination)`` (nn.Module's state_dict over ``unit``'s subtree)
    with the unit's full parameters registered, as torch FSDP1's state-dict
    pre/post hooks do: the unit is gathered when the traversal reaches it, and
    when its subtree is done every entry holding its full parameters (or a
    view of them a hook made) becomes an independent copy, before it is freed.
    Module hooks and ``get_extra_state`` thus see full values, and at most the
    units on one path from the root are gathered at a time."""
    ctx = _walk[0]
    if ctx is None or unit._handle is None:
        return walk(destination)
    start = len(destination)
    with summon_full_params(unit, recurse=False, writeback=False, inside_summon=True):
        if ctx.copy:
            _check_full(unit._handle)
        walk(destination)
        if ctx.copy:
            _copy_out(unit._handle, destination, start, ctx)
        elif ctx.shapes:  # load's check: the full shapes, read before the unit is freed
            for k, v in list(destination.items())[start:]:
                if torch.is_tensor(v):
                    destination[k] = v.shape
    return destination


def _copy_out(h, destination, start: int, ctx: _Walk):
    index = {id(info.module._parameters.get(info.name)): i for i, info in enumerate(h.layout.params)}
    storage = h.flat_param.untyped_storage().data_ptr()
    copies = None
    for k, v in list(destination.items())[start:]:
        if not torch.is_tensor(v) or id(v) in ctx.sharded_ids:  # a nested unit's copy (a DTensor under SHARDED)
            continue
        if id(v) in index:
            if h.sharded and ctx.rows is not None:  # SHARDED: only this rank's rows are ever copied
                destination[k] = to_row_shard(v, ctx.rows)
            else:
                if copies is None:
                    copies = [c.cpu() for c in _unit_copies(h)] if ctx.offload else _unit_copies(h)
                destination[k] = copies[index[id(v)]]
            if h.sharded:
                ctx.sharded_ids.add(id(destination[k]))
        elif v.untyped_storage().data_ptr() == storage:  # a hook's view of a full parameter
            # Always a copy: .cpu() of a CPU tensor is the view itself, left on the freed gather buffer.
            destination[k] = v.detach().to("cpu", copy=True) if ctx.offload else v.detach().clone()
        else:
            continue
        ctx.copied.add(k)


def _upcast_dtypes(root, prefix: str) -> dict[str, torch.dtype]:
    """Keys of the buffers a FULL/SHARDED state dict saves in their original dtype, with that dtype.

    torch FSDP1 upcasts a buffer cast by ``buffer_dtype`` in the state-dict hook
    of each unit that holds it, but that hook returns early for a unit without
    parameters of its own. So a buffer comes back upcast only when some unit
    containing it has a FlatParameter; e.g. a root whose parameters all sit in
    nested units leaves its own buffers in ``buffer_dtype``. zeroshard matches.
    """
    return orig_buffer_dtypes(root, [u for u in units_of(root) if u._handle is not None], prefix)


def _cloned_buffers(root) -> set[int]:
    """ids of the buffers a FULL/SHARDED state dict holds as copies, not as the live tensors.

    torch FSDP1's state-dict hook of a unit with parameters and ``buffer_dtype``
    set replaces every buffer in its subtree (but its own ignored modules') with a
    clone, whether it cast it back or not: int counters, BatchNorm statistics in
    a unit of their own. A dict kept in memory then does not move on with training."""
    out = set()
    for u in units_of(root):
        if u._handle is not None and u.mixed_precision.buffer_dtype is not None:
            ignored = {id(b) for m in u._ignored_modules for b in m.buffers()}
            out |= {id(b) for b in u.buffers() if id(b) not in ignored}
    return out


def buffer_value(v, keep_vars: bool, orig: torch.dtype | None, clone: bool = False):
    """A state dict's value for buffer ``v``: with ``orig`` (its dtype before
    ``buffer_dtype``, see ``mixed_precision.orig_buffer_dtypes``), cast back to
    it; with ``clone`` (see ``_cloned_buffers``) a copy in any case."""
    if orig is not None and torch.is_floating_point(v) and v.dtype != orig:
        return v.detach().to(orig)
    if clone:
        return v.detach().clone()
    return v if keep_vars else v.detach()


class OffRank0(dict):
    """The empty dict a rank0_only state dict (model or optimizer) is on other
    ranks; checkpoint.save refuses to write it (it would replace rank 0's
    file). Pickled as a plain dict."""

    def __reduce__(self):
        return dict, ()


@contextlib.contextmanager
def _gathered_while_loading(root, rows: bool = False):
    """Inside, nn.Module's load of a plain-keyed state dict reaches every unit
    as torch FSDP1's load pre/post hooks do: the keys under the unit are given
    the wrapper's prefix (so hooks of the modules inside see their own names,
    e.g. to rename legacy keys), and the unit is gathered (writeback) for its
    subtree's load, then written back and freed: at most one root-to-leaf
    path of units is gathered. With ``rows`` (SHARDED) a sharded unit's
    parameters arrive as rows and are gathered into full tensors when the
    unit is entered, so the modules inside (their hooks, their
    ``_load_from_state_dict``) see full values, as torch's; they are dropped
    with the unit's part of the dict once its subtree has loaded."""
    opened, handles = [], []  # the open units' summons, innermost last (nn.Module's load nests pre/post hooks)

    def enter(unit, state_dict, prefix, *args):
        for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + WRAPPED_PREFIX)]:
            state_dict[prefix + WRAPPED_PREFIX + k[len(prefix):]] = state_dict.pop(k)
        if rows:  # the unit's own entries, not its nested units'; every rank: the same keys in one order
            units = set(units_of(unit))
            nested = tuple(clean_fqn(n) + "." for n, m in unit.named_modules() if m is not unit and m in units)
            for k in sorted(k for k in state_dict if k.startswith(prefix)):
                if not clean_fqn(k[len(prefix):]).startswith(nested):
                    state_dict[k] = from_row_shard(state_dict[k])
        stack = contextlib.ExitStack()
        if unit._handle is not None:
            stack.enter_context(summon_full_params(unit, recurse=False, writeback=True, inside_summon=True))
        opened.append(stack)

    def leave(unit, incompatible_keys):
        opened.pop().close()

    try:
        for u in units_of(root):
            handles += [u._register_load_state_dict_pre_hook(enter, with_module=True),
                        u.register_load_state_dict_post_hook(leave)]
        yield
    finally:
        for h in handles:
            h.remove()
        while opened:  # an error inside the load: close what is open, innermost first (each restores grad mode)
            opened.pop().close()


def _full_state_dict(root, prefix: str, keep_vars: bool, rank0_only: bool = False, offload: bool = False,
                     shapes: bool = False, rows=None):
    """(FULL state dict, the keys of the parameters sharded units hold); ({},
    set()) off rank 0 with rank0_only (whose ranks still walk the model: the
    all-gathers are collective).

    As in torch FSDP1, the units are gathered one at a time as the traversal
    reaches them (:func:`walk_unit`) and copied (to the CPU with ``offload``)
    before they are freed: the peak is the units on one root-to-leaf path on
    top of the copies, not the whole model twice. With ``shapes`` (load's
    check) nothing is copied: the values are the full shapes. With ``rows``
    (SHARDED's mesh) sharded units' parameters are this rank's rows, cut while
    the unit is gathered, so no full copy of them is ever made."""
    ctx = _Walk(copy=not shapes and not (rank0_only and root.rank != 0), offload=offload, shapes=shapes, rows=rows)
    destination, previous = {}, _walk[0]
    _walk[0] = ctx
    try:
        with plain_module_behaviour():
            upcast, cloned = _upcast_dtypes(root, prefix), _cloned_buffers(root)
            walk_unit(root, destination, lambda d: nn.Module.state_dict(root, destination=d, prefix=prefix, keep_vars=True))
    finally:
        _walk[0] = previous
    if shapes:
        return destination, set()
    if not ctx.copy:
        return OffRank0(), set()
    out = {}
    for k, v in destination.items():
        if torch.is_tensor(v) and k not in ctx.copied:  # buffers, ignored parameters (not extra states)
            v = buffer_value(v, keep_vars, upcast.get(k), clone=id(v) in cloned)
            v = v.cpu() if offload else v
        out[clean_key(k)] = v
    # By the copies, not by the keys seen then: a checkpoint wrapper around a unit renames them afterwards.
    return out, {clean_key(k) for k, v in destination.items() if id(v) in ctx.sharded_ids}


def save(root, prefix: str = "", keep_vars: bool = False) -> dict:
    kind, config = root._state_dict_type, root._state_dict_config
    if kind == StateDictType.FULL_STATE_DICT:
        rank0_only = bool(getattr(config, "rank0_only", False))  # torch's config classes too
        return _full_state_dict(root, prefix, keep_vars, rank0_only, getattr(config, "offload_to_cpu", False))[0]
    if kind == StateDictType.SHARDED_STATE_DICT:
        if any(not u._handle.sharded for u in units_of(root) if u._handle is not None):
            warnings.warn(NO_SHARD_WARNING, stacklevel=3)
        # As torch FSDP1: rows only for parameters of sharded units; NO_SHARD
        # units' parameters, ignored parameters (this rank's own values) and
        # buffers stay plain tensors (DCP saves them once, as replicated).
        return _full_state_dict(root, prefix, keep_vars, rows=device_mesh(root))[0]
    raise ValueError(f"zeroshard: state_dict type {kind.name} is not supported. Fix: use FULL or SHARDED_STATE_DICT here (LOCAL: local_state).")


def _normalize_full(state_dict, current: dict) -> dict:
    """Map a FULL state dict's keys onto the plain model's: a DDP ``module.``
    or FSDP ``_fsdp_wrapped_module.`` prefix is stripped (with a warning, never
    silently), and the first value whose shape differs raises."""
    stripped, out = [], {}
    for k, v in state_dict.items():
        key = k
        if key not in current and WRAPPED_PREFIX in key:
            key = clean_key(key)
        if key not in current and key.startswith("module.") and key[len("module."):] in current:
            key = key[len("module."):]
        if key != k:
            stripped.append(k)
        out[key] = v
    if stripped:
        warnings.warn(f"zeroshard: load_state_dict stripped a 'module.' (DDP) or '{WRAPPED_PREFIX}' (FSDP) prefix from "
                      f"{len(stripped)} key(s), e.g. '{stripped[0]}'; this model's keys are the plain model's.", stacklevel=4)
    bad = shape_mismatch(out, current)
    if bad is not None:
        raise RuntimeError(f"zeroshard: load_state_dict: '{bad[0]}' has shape {bad[1]} in the state dict but "
                           f"{bad[2]} in the model. Fix: load a state dict saved from the same model configuration.")
    return out


def shape_mismatch(values: dict, current: dict) -> tuple | None:
    """(key, shape given, shape in the model) of the first tensor in ``values``
    whose shape differs from ``current``'s entry (a tensor, or a shape), or None.
    Extra states are not compared: set_extra_state takes anything, as in torch."""
    for k, v in values.items():
        if k in current and torch.is_tensor(v) and not k.endswith("_extra_state"):
            want = tuple(getattr(current[k], "shape", current[k]))
            if tuple(v.shape) != want:
                return k, tuple(v.shape), want
    return None


def refuse_dcp_state_dict_helpers(unit):
    """The units' ``_fqn_modifiers``: only torch.distributed.checkpoint.state_dict calls it, on modules it
    does not take for torch's FSDP. Treating a unit as a plain module, it would save each rank's optimizer
    shards as if whole (and cannot map FlatParameters to names): refused instead of a wrong checkpoint."""
    raise RuntimeError(f"zeroshard: torch.distributed.checkpoint.state_dict (get_state_dict, set_state_dict, "
                       f"get_model_state_dict, ...) does not recognize zeroshard's units such as '{type(unit.module).__name__}' "
                       "(it tests for torch's FSDP class), so it would save each rank's optimizer shards as whole ones. "
                       "Fix: inside FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT) (or FULL), use "
                       "model.state_dict() / load_state_dict() and FSDP.optim_state_dict() / optim_state_dict_to_load(), "
                       "saved with zeroshard.checkpoint.save_sharded / load_sharded (or torch.distributed.checkpoint).")


def raise_if_any_rank_failed(root, problem: Exception | None):
    """Every rank of the root's groups learns whether any rank's state dict is
    unloadable before one writes anything: a rank loading alone would leave
    the shards a mix of old and new values on a model whose other ranks raised."""
    found = None if problem is None else (dist.get_rank(), str(problem))  # (rank that found it, what)
    for group in (root.process_group, getattr(root, "_replicate_group", None)):
        if group is not None:
            first = comm.first_problem(found, group, what="load_state_dict: checking the state dict")
            found = None if first is None else first[1]
    if problem is not None:
        raise problem
    if found is not None:
        raise RuntimeError(f"zeroshard: load_state_dict: nothing was loaded: rank {found[0]} cannot load its state "
                           f"dict: {found[1]}")


def load(root, state_dict, strict: bool = True):
    kind = root._state_dict_type
    rows = kind == StateDictType.SHARDED_STATE_DICT  # row shards: gathered unit by unit while loading
    if kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        # The model's keys and shapes (a walk that gathers each unit in turn and copies nothing), then
        # nn.Module's load with each unit gathered only while its subtree loads, as torch's hooks do.
        current = _full_state_dict(root, "", keep_vars=True, shapes=True)[0]
        try:
            state_dict, problem = _normalize_full(state_dict, {clean_key(k): v for k, v in current.items()}), None
            for v in state_dict.values() if rows else ():
                check_row_shard(v)
            sharded = next((k for k, v in state_dict.items() if is_sharded(v)), None) if not rows else None
            if sharded is not None:  # copy_ would fail key by key with "got mixed torch.Tensor and DTensor"
                raise ValueError(f"zeroshard: load_state_dict under FULL_STATE_DICT got a sharded entry '{sharded}' "
                                 f"({type(state_dict[sharded]).__name__}), as SHARDED_STATE_DICT saves. Fix: load it inside "
                                 "FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT).")
        except (RuntimeError, ValueError) as e:
            problem = e
        if rows:  # rows are all-gathered key by key: every rank must hold the same sharded keys (collective: always)
            differ = row_keys_differ(sorted(k for k, v in state_dict.items() if is_sharded(v)), root.process_group)
        else:  # a key one rank lacks (strict: it raises there alone) would be loaded by the others only
            differ = row_keys_differ(sorted(map(str, state_dict)), root.process_group, "state dict keys")
        problem = problem or differ
        raise_if_any_rank_failed(root, problem)
        with _gathered_while_loading(root, rows):
            result = nn.Module.load_state_dict(root, state_dict, strict=False)
        missing, unexpected = [clean_key(k) for k in result.missing_keys], [clean_key(k) for k in result.unexpected_keys]
        if strict and (missing or unexpected):  # nn.Module's error, with the plain model's names as torch FSDP1 gives
            errors = [f"{what} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in keys) + ". "
                      for what, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys]
            raise RuntimeError(f"Error(s) in loading state_dict for {type(root).__name__}:\n\t" + "\n\t".join(errors))
        return type(result)(missing, unexpected)
    raise ValueError(f"zeroshard: load_state_dict for {kind.name} is not supported. Fix: use FULL or SHARDED_STATE_DICT here (LOCAL: local_state).")
