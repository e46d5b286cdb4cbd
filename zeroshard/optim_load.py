"""Loading optimizer state under ZeRO: the inverse of ``optim_state``.

:func:`optim_state_dict_to_load` cuts a checkpoint's optimizer state dict back
into what ``optim.load_state_dict`` expects on this rank, for the sharded
layout the optimizer really steps (see ``optim_state`` for both layouts):

* ``use_orig_params=False``: one state per FlatParameter, the per-parameter
  states flattened and concatenated at the parameters' offsets (zeros in the
  padding), then cut to this rank's shard (:func:`_flatten_shard`);
* ``use_orig_params=True``: each original parameter's 1-D slice that falls in
  this rank's shard (:func:`_orig_shard`).

The full states come from the dict itself (FULL), from rank 0 (``rank0_only``:
broadcast one state at a time, :class:`_Rank0States`) or from their rows
(DTensor or torch FSDP1's ShardedTensor, all-gathered one parameter at a time,
:class:`_FullStates`), so no rank holds more than one parameter's full states
beyond what it was given.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .optim_state import _fqns, _is_elem, _is_rank0, _optim_params, _param_index, _settings
from .sharded_state import from_row_shard, is_sharded
from .summon import units_of


class _FullStates:
    """The full states of a FULL or SHARDED optimizer state dict, one FQN at a
    time: rows (DTensor / ShardedTensor) are all-gathered on demand. Every
    rank must ask for the same FQNs in the same order (the collectives match)."""

    def __init__(self, osd: dict):
        if "state" not in osd or "param_groups" not in osd:
            raise ValueError("zeroshard: optim_state_dict_to_load got a dict without 'state' and 'param_groups'. Fix: pass "
                             "what optim_state_dict returned; if only rank 0 has it, load under state_dict_type(..., "
                             "FullOptimStateDictConfig(rank0_only=True)).")
        self.state, self.param_groups = osd["state"], osd["param_groups"]
        # (FQN, name) of every row-sharded state: fetching one all-gathers it.
        self.row_keys = sorted((f, k) for f, st in self.state.items() if isinstance(st, dict) for k, v in st.items()
                               if is_sharded(v))
        self.collective = bool(self.row_keys)

    def get(self, fqn: str) -> dict | None:
        st = self.state.get(fqn)
        if st is None:
            return None
        full = {k: from_row_shard(st[k]) for k in sorted(st)}  # sorted: the same order on every rank
        return {k: full[k] for k in st}


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple
    dtype: torch.dtype


class _Rank0States:
    """rank0_only: only rank 0 holds the dict. Its layout (scalars and
    param_groups included) is broadcast once; each per-element state is
    broadcast when asked for, so other ranks hold one parameter's at a time."""

    def __init__(self, osd: dict | None, group, device: torch.device):
        self.group, self.device = group, device
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.rank0 = _is_rank0(group)
        layout = None
        if self.rank0:
            if not osd or "state" not in osd or "param_groups" not in osd:
                layout = "zeroshard: optim_state_dict_to_load with rank0_only=True needs the full optimizer state " \
                         "dict on rank 0. Fix: pass there the dict that optim_state_dict returned on rank 0 (other ranks may pass {})."
            else:
                specs = {fqn: {k: _TensorSpec(tuple(v.shape), v.dtype) if _is_elem(v) else v for k, v in st.items()}
                         for fqn, st in osd["state"].items()}
                layout = {"state": specs, "param_groups": osd["param_groups"]}
        box = [layout]
        comm.broadcast_objects(box, self.src, group, "optim_state_dict_to_load (rank 0's rank0_only dict layout)")
        if isinstance(box[0], str):  # raised on every rank, not only on rank 0 (the others would wait forever)
            raise ValueError(box[0])
        self.specs, self.param_groups = box[0]["state"], box[0]["param_groups"]
        self.full = osd["state"] if self.rank0 else None
        self.row_keys, self.collective = [], True  # every per-element state is broadcast

    def get(self, fqn: str) -> dict | None:
        spec = self.specs.get(fqn)
        if spec is None:
            return None
        out = {}
        for k in sorted(spec):
            v = spec[k]
            if isinstance(v, _TensorSpec):
                if self.rank0:
                    t = self.full[fqn][k].to(self.device).contiguous()
                else:
                    t = torch.empty(v.shape, dtype=v.dtype, device=self.device)
                comm.broadcast(t, self.src, self.group, f"optim_state_dict_to_load (rank 0's '{fqn}' {k})")
                v = t
            out[k] = v
        return {k: out[k] for k in spec}


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict, group=None,
                             rank0_only: bool | None = None, named: bool = False, agree: bool = True) -> dict:
    """Turn an optimizer state dict from :func:`optim_state_dict` (FULL, or
    SHARDED rows: zeroshard's DTensors or torch FSDP1's ShardedTensors) into
    ``optim.load_state_dict``'s input for this rank.

    Collective: call on every rank. One exchange of metadata first checks
    that every rank can convert its dict (:func:`_agree`; ``agree=False``
    skips it, for a FULL dict converted without communication); then a FULL dict
    needs no communication, rows are all-gathered, and with
    ``FullOptimStateDictConfig(rank0_only=True)`` set by ``state_dict_type``
    only rank 0's dict is read (other ranks may pass ``{}``) and broadcast.
    ``rank0_only`` overrides that setting (torch's older API names it in the
    call: ``optim_legacy``). ``optim`` may be anything with ``param_groups``.

    ``named`` (torch's ``is_named_optimizer``): key the result by parameter
    name instead of position, for torchrec's KeyedOptimizer or torch's
    ``_NamedOptimizer`` (see :func:`_by_name`).
    """
    if rank0_only is None:
        rank0_only = _settings(model)[1]
    index = _param_index(model)
    params, source = _optim_params(optim) if optim is not None else [], None
    try:  # checked on every rank before any state is fetched (see _agree)
        if rank0_only:  # collective: rank 0 broadcasts what it holds
            source = _Rank0States(optim_state_dict, group, units_of(model)[0].compute_device)
        else:
            source = _FullStates(optim_state_dict)
        if optim is None:
            optim = _saved_groups_over(model, index, source.param_groups)
            params = _optim_params(optim)
        fqn_groups = [_fqns(index, p, "optim_state_dict_to_load") for p in params]
        groups, problem = _param_groups(source.param_groups, optim, fqn_groups), None
    except ValueError as e:
        problem = e
    state = empty_shard = None
    if problem is None and not source.collective:
        # Nothing to fetch: this rank's dict converts, or fails its per-parameter checks (a state's shape,
        # a state missing for some of a FlatParameter's parameters), before the ranks agree, so a dict bad on
        # one rank raises on every rank instead of loading on the others.
        try:
            state, empty_shard = _convert(index, params, source)
        except Exception as e:  # noqa: BLE001 - a malformed entry (TypeError, KeyError) too: raised below, on every rank
            problem = e
    held = {}  # a dict of each rank's own: which states it holds for the parameters this rank's optimizer steps
    if problem is None and not source.collective:
        try:
            held = {f: tuple(sorted(map(str, st))) if isinstance(st := source.state.get(f), dict) else None
                    for fqns in fqn_groups for f in fqns}
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            problem = e
    if agree:  # over the model's groups unless told (a model on some ranks only: the others are not in the call)
        root = units_of(model)[0]
        pgs = [group] if group is not None else [root.process_group, getattr(root, "_replicate_group", None)]
        _agree(problem, source.row_keys if source is not None else [], held, [g for g in pgs if g is not None])
    elif problem is not None:
        raise problem
    if state is None:
        state, empty_shard = _convert(index, params, source)
    state = dict(sorted(state.items()))  # the optimizer's order
    if named:
        return _by_name(model, optim, params, state, groups, empty_shard)
    return {"state": state, "param_groups": groups}


def _convert(index: dict, params: list, source) -> tuple[dict, list]:
    """(this rank's state by optimizer position, the positions whose parameter has no element in
    this rank's shard), from the full states ``source`` gives."""
    pid_of = {id(p): pid for pid, p in enumerate(params)}
    state, empty_shard = {}, []
    # The model's parameters in the model's order, the same on every rank, so the fetches' collectives match
    # even where this rank's optimizer holds other parameters than another rank's (a parameter it does not
    # hold is still fetched, and dropped, when fetching is collective).
    for key, (kind, h, i, names) in index.items():
        pid = pid_of.get(key)
        if pid is None:
            for f in (names if kind == "flat" else [names]) if source.collective else ():
                source.get(f)
            continue
        if kind == "flat":
            st = _flatten_shard(h, names, {f: v for f in names if (v := source.get(f)) is not None})
        elif kind == "orig":
            full = source.get(names)
            st = _orig_shard(h, i, full, names)
            if full is not None and st is None:
                empty_shard.append(pid)
        else:
            full = source.get(names)
            st = {k: v.clone() if torch.is_tensor(v) else v for k, v in full.items()} if full is not None else None
        if st:
            state[pid] = st
    return state, empty_shard


def _saved_groups_over(model: nn.Module, index: dict, saved_groups: list) -> SimpleNamespace:
    """No optimizer given (torch's older calls allow it): the saved groups, each name turned into
    the model parameter holding it (a FlatParameter once), as torch numbers them."""
    holder = {}
    for p in model.parameters():
        kind, _, _, names = index[id(p)]
        holder.update((n, p) for n in (names if kind == "flat" else [names]))
    groups = []
    for saved in saved_groups:
        held = [holder[n] for n in saved["params"] if n in holder]  # unknown names: _param_groups names them
        groups.append({"params": [p for i, p in enumerate(held) if all(q is not p for q in held[:i])]})
    return SimpleNamespace(param_groups=groups)


def _param_groups(saved_groups: list, optim, fqn_groups: list) -> list:
    """The saved groups' settings with this optimizer's positions, after checking that each saved group
    names exactly the parameters of the optimizer's group."""
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(f"zeroshard: the optimizer state dict has {len(saved_groups)} param groups but the optimizer has "
                         f"{len(optim.param_groups)}. Fix: build the optimizer with the same param groups as when saving.")
    groups, pos = [], 0
    for gi, (saved, ours) in enumerate(zip(saved_groups, optim.param_groups)):
        ids = list(range(pos, pos + len(ours["params"])))
        pos += len(ours["params"])
        expected = [f for pid in ids for f in fqn_groups[pid]]
        if set(saved["params"]) != set(expected):
            missing = sorted(set(expected) - set(saved["params"]))[:3]
            extra = sorted(set(saved["params"]) - set(expected))[:3]
            fix = ("it is keyed by parameter IDs (a plain optimizer.state_dict()): convert it with "
                   "FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model), or load one from "
                   "FSDP.optim_state_dict" if extra and all(isinstance(k, int) for k in saved["params"]) else
                   "load a state dict saved from the same model and param groups")
            raise ValueError(f"zeroshard: param group {gi} of the optimizer state dict does not hold this optimizer's "
                             f"parameters (missing e.g. {missing}, unexpected e.g. {extra}). Fix: {fix}.")
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return groups


def _agree(problem: ValueError | None, row_keys: list, held: dict, groups: list) -> None:
    """Every rank learns whether any rank cannot load its dict, and whether all hold the same row-sharded
    states, before a state is fetched: fetching rows or rank 0's states is collective, so a rank raising
    alone would leave the others waiting, and mismatched all-gathers abort the processes under gloo. Over
    each of ``groups`` in turn (hybrid: the shard group, then the replicate group), what a rank learnt in
    one is passed on in the next, and nobody raises before all exchanges are done.

    ``held`` (a dict that each rank passes for itself): the state names it holds for each parameter
    this rank's optimizer steps, None for none. Ranks must agree where both step a parameter: one
    missing a parameter's state on one rank only restarted it there (under NO_SHARD the replicas
    drifted apart silently, as in torch FSDP1), or dropped it from that rank's shard."""
    found = None  # the first problem seen on another rank
    if dist.is_available() and dist.is_initialized():
        for group in (g for g in groups if dist.get_world_size(g) > 1):
            mine = (None if problem is None else str(problem), row_keys, held, found)
            everyone = comm.gather_objects(mine, group, "optim_state_dict_to_load: checking every rank's state dict")
            for r, (theirs, keys, their_held, relayed) in enumerate(everyone):
                who = dist.get_global_rank(group, r)
                unlike = next((f for f in held if f in their_held and held[f] != their_held[f]), None)
                if found is None and theirs is not None:
                    found = (f"zeroshard: optim_state_dict_to_load: nothing was converted: rank {who} cannot load its "
                             f"optimizer state dict: {theirs}")
                elif found is None and relayed is not None:
                    found = relayed
                elif found is None and keys != row_keys:
                    here, there = sorted(set(row_keys) - set(keys))[:3], sorted(set(keys) - set(row_keys))[:3]
                    found = (f"zeroshard: optim_state_dict_to_load: this rank and rank {who} hold different "
                             f"row-sharded optimizer states (only here: {here}, only there: {there}). Fix: give every "
                             "rank the dict that optim_state_dict returned on it (or that DCP loaded).")
                elif found is None and unlike is not None:
                    found = (f"zeroshard: optim_state_dict_to_load: nothing was converted: this rank's optimizer state "
                             f"dict and rank {who}'s hold different states for '{unlike}' (here: "
                             f"{_names(held[unlike])}, there: {_names(their_held[unlike])}). Fix: give every rank the "
                             "same dict (what optim_state_dict returned, or one file loaded on every rank).")
    if problem is not None:
        raise problem
    if found is not None:
        raise ValueError(found)


def _names(keys: tuple | None):
    return "none" if keys is None else list(keys)


def _by_name(model: nn.Module, optim, params: list, state: dict, groups: list, empty_shard: list) -> dict:
    """The dict keyed as a named optimizer keys it: each parameter by its name
    in ``model.named_parameters()`` (with the units' prefixes, as the named
    optimizer was built from), each group's names sorted, as torch FSDP1 does.
    A named optimizer creates every parameter's state eagerly, also for
    ``use_orig_params`` parameters with no element in this rank's shard: those
    keep the state the optimizer already holds (torch copies it the same way)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    for pid in empty_shard:
        held = optim.state.get(params[pid])
        if held:
            state[pid] = copy.deepcopy(held)
    keyed = {name_of[id(params[pid])]: st for pid, st in sorted(state.items())}
    groups = [{**g, "params": sorted(name_of[id(params[pid])] for pid in g["params"])} for g in groups]
    return {"state": keyed, "param_groups": groups}


def _flatten_shard(h, fqns: list[str], full: dict) -> dict | None:
    """This rank's FlatParameter state: the per-parameter states flattened,
    concatenated at the parameters' offsets (zeros in padding), then sharded."""
    present = [f for f in fqns if f in full]
    if not present:
        return None
    # One FlatParameter has one state: every parameter of the unit must have one, with the same names, the
    # same dtype per name and the same scalars (torch FSDP1 refuses the same dicts).
    fix = "Fix: load with use_orig_params=True, or load a state dict saved from the same model."
    if len(present) < len(fqns):
        raise ValueError(f"zeroshard: the optimizer state dict has states for {present[:3]} but not for "
                         f"{[f for f in fqns if f not in full][:3]}, parameters of unit '{h.unit_name}' that share one "
                         f"FlatParameter (use_orig_params=False) and so one optimizer state. {fix}")
    names = list(full[present[0]])
    for f in present:
        if set(full[f]) != set(names):
            raise ValueError(f"zeroshard: the optimizer states of '{present[0]}' ({sorted(names)}) and '{f}' "
                             f"({sorted(full[f])}) have different names, but they share one FlatParameter of unit "
                             f"'{h.unit_name}' and so one optimizer state. {fix}")
    layout, device = h.layout, h.local_shard.device
    out = {}
    for name in sorted(names):
        values = [full[f][name] for f in present]
        sample = values[0]
        if not _is_elem(sample):
            # One FlatParameter has one scalar (e.g. step): its parameters must agree.
            if any(torch.is_tensor(v) != torch.is_tensor(sample) or (torch.is_tensor(v) and not torch.equal(v, sample))
                   or (not torch.is_tensor(v) and v != sample) for v in values):
                raise ValueError(f"zeroshard: optimizer state '{name}' differs between parameters of unit '{h.unit_name}' "
                                 f"({present}); with use_orig_params=False they share one FlatParameter and one '{name}'. "
                                 "Fix: load with use_orig_params=True, or make the values equal.")
            out[name] = sample.clone() if torch.is_tensor(sample) else sample
            continue
        if any(not _is_elem(v) or v.dtype != sample.dtype for v in values):
            raise ValueError(f"zeroshard: optimizer state '{name}' has different dtypes or kinds across the parameters "
                             f"of unit '{h.unit_name}' ({[str(getattr(v, 'dtype', type(v).__name__)) for v in values]}), "
                             f"which share one FlatParameter state. {fix}")
        shard = torch.zeros(h.local_shard.numel(), dtype=sample.dtype, device=device)
        start = layout.shard_start if h.sharded else 0
        end = layout.shard_end if h.sharded else layout.numel
        for fqn, info in zip(fqns, layout.params):
            v = full[fqn][name]
            _check_shape(v, info, name, fqn)
            lo, hi = max(info.offset, start), min(info.offset + info.numel, end)
            if lo < hi:
                shard[lo - start : hi - start].copy_(info.flat_of(v)[lo - info.offset : hi - info.offset])
        out[name] = shard
    return out


def _orig_shard(h, i: int, st: dict | None, fqn: str) -> dict | None:
    """This rank's state of original parameter ``i`` (``fqn``): its 1-D slice,
    or none when the shard holds no element of it (the optimizer never steps
    it). Shapes are checked on every rank first, so all of them raise."""
    if st is None:
        return None
    if not h.sharded:  # the parameter whole: its states as they are, whatever their shapes (Adafactor's factors), as torch
        return {k: v.to(h.local_shard.device, copy=True) if torch.is_tensor(v) else v for k, v in st.items()}
    info, sl = h.layout.params[i], h.layout.shard_slices[i]
    for name, v in st.items():
        if _is_elem(v):
            _check_shape(v, info, name, fqn)
    if sl is None:
        return None
    out = {}
    for name, v in st.items():
        if not _is_elem(v):
            out[name] = v.clone() if torch.is_tensor(v) else v
            continue
        out[name] = info.flat_of(v)[sl.offset_in_param : sl.offset_in_param + sl.numel_in_shard].to(h.local_shard.device, copy=True)
    return out


def _check_shape(v: torch.Tensor, info, name: str, fqn: str):
    # The shape, not only the element count: a transposed state would load scrambled (torch raises here too).
    if tuple(v.shape) != tuple(info.shape):
        raise ValueError(f"zeroshard: optimizer state '{name}' of '{fqn}' has shape {tuple(v.shape)} but the parameter has "
                         f"shape {tuple(info.shape)}. Fix: load an optimizer state dict saved from the same model.")
