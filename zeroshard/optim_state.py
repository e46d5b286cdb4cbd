"""Optimizer state dicts of FSDP units, under every sharding strategy: each
rank's sharded optimizer state, gathered and scattered for checkpoints (the
ZeRO-1 optimizer in ``zero1`` has state dicts of its own).

Under ZeRO every rank's optimizer only ever sees this rank's shard: with
``use_orig_params=False`` one state per FlatParameter (1-D, ``shard_numel``
elements, tail padding included), with ``use_orig_params=True`` one 1-D state
per original parameter slice that falls in this rank's shard (none where the
shard holds no element of it). A checkpoint must not depend on that layout, so

* :func:`optim_state_dict` all-gathers each unit's per-element states (one
  all-gather per unit and state name, the same shard layout as the parameters)
  and returns torch FSDP1's format: ``state`` keyed by the plain model's
  parameter FQNs, and ``param_groups`` whose ``params`` are FQN lists. The
  model's state dict type picks the form, as in torch:

  - FULL_STATE_DICT (default): full-shape tensors (``exp_avg``...) on every
    rank, or only on rank 0 with ``FullOptimStateDictConfig(rank0_only=True)``
    (other ranks get ``{}``);
  - SHARDED_STATE_DICT: each full-shape state cut into this rank's rows, a
    DTensor (see ``sharded_state``), for ``torch.distributed.checkpoint`` to
    save and to reshard at another world size. Scalars (``step``) stay plain.
    torch FSDP1 returns ShardedTensors here on CPU (DTensors when given a
    device mesh); the chunks, keys and so the DCP checkpoints are the same.
  - LOCAL_STATE_DICT: the same rows as torch FSDP1 gives them there,
    ShardedTensors over each unit's process group.

* ``optim_load.optim_state_dict_to_load`` cuts such a dict back into what
  ``optim.load_state_dict`` expects on this rank: the flattened and sharded
  concatenation of the per-parameter states (zeros in the padding) for a
  FlatParameter, or the 1-D slice for each original parameter. Full states
  come from the dict itself, from rank 0 (``rank0_only``: broadcast one state
  at a time) or from their rows (DTensor or torch's ShardedTensor: all-gathered
  one parameter at a time), so no rank ever holds more than one parameter's
  full states beyond what it was given.

As in torch, a state counts as per-element when it is a tensor with at least
one dimension; zero-dimensional tensors and non-tensors are scalars (``step``).
A freshly built optimizer has no state for DCP to load into:
:func:`init_optim_state` creates it (as ``torch.distributed.checkpoint``'s
``get_optimizer_state_dict`` does).
"""
from __future__ import annotations

import copy
import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .options import StateDictType
from .sharded_state import device_mesh, to_chunk_sharded_tensor, to_row_shard
from .state_dict import OffRank0, clean_fqn, clean_key
from .state_dict_settings import state_dict_settings
from .summon import units_of


def _settings(model: nn.Module) -> tuple[str, bool]:
    """(form, rank0_only) from what ``state_dict_type`` set on the model's
    units. As in torch, the state dict type decides the form and the optim
    config only adds options (so torch's config classes work here too).
    Forms: "full"; "rows" (SHARDED: DTensors); "chunks" (LOCAL: torch FSDP1
    gives the same rows there, as ShardedTensors over each unit's group)."""
    units = units_of(model)
    if not units:
        raise ValueError("zeroshard: the model has no FullyShardedDataParallel unit. Fix: pass the wrapped model.")
    state_dict_settings(model)  # every unit the same (torch asserts), or the first unit's would pass for all
    kind = units[0]._state_dict_type
    if kind == StateDictType.LOCAL_STATE_DICT and any(getattr(u, "_device_mesh", None) is not None for u in units):
        raise RuntimeError("zeroshard: LOCAL_STATE_DICT does not fit a model wrapped with device_mesh (torch FSDP1 "
                           "refuses it too). Fix: use SHARDED_STATE_DICT (DTensor shards) or FULL_STATE_DICT.")
    cfg = units[0].__dict__.get("_optim_state_dict_config")
    form = {StateDictType.SHARDED_STATE_DICT: "rows", StateDictType.LOCAL_STATE_DICT: "chunks"}.get(kind, "full")
    return form, form == "full" and bool(getattr(cfg, "rank0_only", False))


def _is_rank0(group) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _unit_prefixes(model: nn.Module):
    """(handle, FQN prefix in the plain model) for every unit with parameters."""
    units = set(units_of(model))
    out = []
    for name, m in model.named_modules():
        if m in units and m._handle is not None:
            out.append((m._handle, clean_key(name + ".") if name else ""))
    return out


def _param_index(model: nn.Module):
    """id(parameter the optimizer holds) -> (kind, handle, index, fqn(s)).

    kind is "flat" (a FlatParameter: all its FQNs), "orig" (an original
    parameter of a use_orig_params unit) or "plain" (not managed by a unit).
    """
    index = {}
    for h, prefix in _unit_prefixes(model):
        fqns = [clean_fqn(prefix + info.fqn) for info in h.layout.params]
        if h.use_orig_params:
            for i, p in enumerate(h.orig_params):
                index[id(p)] = ("orig", h, i, fqns[i])
        else:
            index[id(h.flat_param)] = ("flat", h, None, fqns)
    for name, p in model.named_parameters():
        index.setdefault(id(p), ("plain", None, None, clean_fqn(name)))
    return index


_NOT_IN_MODEL = ("zeroshard: {}: the optimizer holds a parameter that is not in the model. Fix: pass the model "
                 "whose parameters the optimizer was built from.")


def _fqns(index: dict, p, what: str) -> list[str]:
    """The plain model's FQN(s) of a parameter the optimizer holds (a FlatParameter stands for several)."""
    kind, _, _, names = index.get(id(p), ("plain", None, None, None))
    if names is None:
        raise ValueError(_NOT_IN_MODEL.format(what))
    return names if kind == "flat" else [names]


def _optim_params(optim: torch.optim.Optimizer):
    return [p for group in optim.param_groups for p in group["params"]]


def _is_elem(v) -> bool:
    return torch.is_tensor(v) and v.dim() > 0


def _ordered(state: dict, orig_params: bool) -> dict:
    """torch's order inside one parameter's state. Flat parameters: per-element
    tensors, then zero-dim tensors, then the rest. With ``use_orig_params``:
    the rest, then zero-dim tensors, then per-element tensors. Each kind
    sorted by name (a NO_SHARD ``use_orig_params`` parameter's state passes
    through in the optimizer's own order instead: see :func:`_gather_unit`)."""

    def rank(kv):
        kind = 0 if _is_elem(kv[1]) else 1 if torch.is_tensor(kv[1]) else 2
        return (2 - kind if orig_params else kind, kv[0])

    return dict(sorted(state.items(), key=rank))


def _local_spec(states: list[dict | None]) -> dict:
    """What this rank knows of one unit's state: index -> (empty, {name: dtype | scalar}).
    ``empty``: its per-element states have no element here (e.g. Adagrad's
    state of a parameter this rank holds none of, made at construction, whose
    ``step`` never moved); as torch, such a rank's scalars are used only when
    no other rank has the parameter's state."""
    spec = {}
    for i, st in enumerate(states):
        if st is not None:
            empty = any(_is_elem(v) and v.numel() == 0 for v in st.values())
            spec[i] = (empty, {k: ("elem", v.dtype) if _is_elem(v) else ("scalar", v) for k, v in st.items()})
    return spec


def _gather_unit(h, prefix: str, states_of: dict, finish) -> dict[str, dict]:
    """Full (unsharded) states of one unit's parameters, keyed by FQN; each
    per-element state passes through ``finish`` (a CPU copy, or this rank's
    rows for SHARDED). ``finish=None``: take part in the collectives only
    (rank0_only on ranks other than 0) and return {}."""
    n = len(h.layout.params)
    if h.use_orig_params and not h.sharded:
        # Each rank holds these parameters whole: their states pass through as they are (torch's too), whatever
        # their shapes (Adafactor's row and column factors are not shaped like the parameter).
        if finish is None:
            return {}
        out = {}
        for info, p in zip(h.layout.params, h.orig_params):
            if states_of.get(p):
                out[clean_fqn(prefix + info.fqn)] = {k: finish(v) if _is_elem(v) else v.detach().to("cpu", copy=True)
                                                     if torch.is_tensor(v) else v for k, v in states_of[p].items()}
        return out
    if h.use_orig_params:
        states = [states_of.get(p) or None for p in h.orig_params]
    else:
        states = [states_of.get(h.flat_param) or None] * n  # one state for the whole FlatParameter
    # Ranks holding no element of a parameter have no state for it (and a
    # rank cannot know its dtype or step): exchange what each rank has.
    spec = _local_spec(states)
    if h.sharded and h.world_size > 1:
        # tag: the unit's name is '<path> (Class)' only after a lazy init that may have run on some ranks alone
        specs = comm.gather_objects(spec, h.group, f"optim_state_dict (unit '{h.unit_name}': which ranks hold optimizer state)",
                                    tag="optim_state_dict (which ranks hold optimizer state)")
    else:
        specs = [spec]
    merged: dict[int, dict] = {}
    for empty_ones in (False, True):
        for s in specs:
            for i, (empty, names) in s.items():
                if empty == empty_ones:
                    for k, v in names.items():
                        merged.setdefault(i, {}).setdefault(k, v)
    out = {clean_fqn(prefix + h.layout.params[i].fqn): {} for i in sorted(merged)}
    elem_names = sorted({k: v[1] for names in merged.values() for k, v in names.items() if v[0] == "elem"}.items())
    device = h.local_shard.device
    for name, dtype in elem_names:
        full = _full_flat(h, states, name, dtype, device, flat=not h.use_orig_params)
        if finish is None:
            continue
        for i, info in enumerate(h.layout.params):
            if name in merged.get(i, {}):
                # A copy, not a view of the gathered buffer: each state must
                # own its memory (torch FSDP1 on CPU returns views of one
                # buffer it reuses for every state name, see the tests).
                out[clean_fqn(prefix + info.fqn)][name] = finish(info.unflat(full[info.offset : info.offset + info.numel]))
    if finish is None:
        return {}  # a unit's part, merged into the dict below
    for i, names in merged.items():
        for k, (kind, v) in names.items():
            if kind == "scalar":
                out[clean_fqn(prefix + h.layout.params[i].fqn)][k] = v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
    return {k: _ordered(v, h.use_orig_params) for k, v in out.items()}


def _full_flat(h, states, name, dtype, device, flat: bool) -> torch.Tensor:
    """The unsharded flat buffer of state ``name``: this rank's shard is
    assembled from its states (zeros where it has none), then all-gathered."""
    layout = h.layout
    if flat:  # the FlatParameter's state is already this rank's shard (or full with NO_SHARD)
        st = states[0]
        shard = st[name] if st is not None and name in st else torch.zeros(h.local_shard.numel(), dtype=dtype, device=device)
    else:  # use_orig_params, sharded (an unsharded unit's states pass through: see _gather_unit)
        shard = torch.zeros(h.local_shard.numel(), dtype=dtype, device=device)
        for st, sl in zip(states, layout.shard_slices):
            if st is not None and name in st and sl is not None:
                shard[sl.offset_in_shard : sl.offset_in_shard + sl.numel_in_shard].copy_(st[name])
    if not h.sharded or h.world_size == 1:
        return shard
    full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
    comm.all_gather(full, shard.to(device).contiguous(), h.group, async_op=False)
    return full


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None, group=None) -> dict:
    """torch FSDP1's optimizer state dict of ``optim`` (collective: call on every rank).

    FULL, FULL on rank 0 only, or SHARDED, as ``state_dict_type`` set on the
    model (see the module docstring). ``optim_state_dict`` (default
    ``optim.state_dict()``, as torch) is the state converted: its states
    (keyed by position, or by name for a named optimizer) and its
    ``param_groups``; ``optim`` maps positions to parameters. ``group``: the
    ranks among which "rank 0" is meant (default: all); each unit gathers
    over its own process group.
    """
    form, rank0_only = _settings(model)
    return _optim_state_dict(model, optim, optim_state_dict, group, rank0_only, form)


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool = True, group=None) -> dict:
    """torch's older API: the FULL optimizer state dict whatever the state dict
    type, by default on rank 0 only (``{}`` on the other ranks), as in torch."""
    return _optim_state_dict(model, optim, None, group, rank0_only, "full")


def _states_of(osd: dict, params: list, by_name: dict) -> dict:
    """The states of a given optimizer state dict, keyed by parameter (as ``optim.state`` is)."""
    out = {}
    for key, st in osd.get("state", {}).items():
        p = by_name.get(key) if isinstance(key, str) else params[key] if 0 <= key < len(params) else None
        if p is None:
            raise ValueError(f"zeroshard: optim_state_dict: the given optimizer state dict has a state for parameter "
                             f"{key!r}, which the optimizer does not hold. Fix: pass a state dict of this optimizer "
                             "(optim.state_dict()).")
        out[p] = st
    return out


def _optim_state_dict(model, optim, osd, group, rank0_only: bool, form: str) -> dict:
    index = _param_index(model)
    params = _optim_params(optim)
    live = osd is None  # optim.state itself is read in place, nothing re-keyed
    osd = optim.state_dict() if live else osd
    # A named optimizer (torch's _NamedOptimizer, torchrec's KeyedOptimizer)
    # lists each group's parameters by their names in the wrapped model.
    by_name = dict(model.named_parameters()) if any(isinstance(k, str) for g in osd["param_groups"] for k in g["params"]) else {}
    states = optim.state if live else _states_of(osd, params, by_name)
    keep = not rank0_only or _is_rank0(group)
    mesh = device_mesh(units_of(model)[0]) if form == "rows" else None

    def finish(h):  # what each full per-element state of unit ``h`` becomes (None: nothing, off rank 0)
        # torch FSDP1 gives a NO_SHARD unit's states full (plain) with use_orig_params, and as rows without.
        if form == "full" or (not h.sharded and h.use_orig_params):
            return (lambda t: t.to("cpu", copy=True)) if keep else None
        if form == "rows":
            return lambda t: to_row_shard(t, mesh)
        return lambda t: to_chunk_sharded_tensor(t, h.group)

    # Every rank gathers every unit, in the same order, so the collectives match even where the optimizers
    # differ (e.g. built from each rank's non-empty use_orig_params shards): as in torch, every rank then
    # gets each state some rank's optimizer holds. A unit no optimizer holds gathers no state.
    per_unit = {id(h): _gather_unit(h, prefix, states, finish(h)) for h, prefix in _unit_prefixes(model)}
    if not keep:
        return OffRank0()
    plain = {}
    for p in params:
        kind, h, _, fqn = index.get(id(p), ("plain", None, None, None))
        if kind == "plain" and p in states:
            if fqn is None:
                raise ValueError(_NOT_IN_MODEL.format("optim_state_dict"))
            plain[fqn] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in states[p].items()}  # torch copies it
    # torch's order of the parameters. use_orig_params: it walks the sorted names,
    # taking unmanaged states at once and each unit's (names sorted) after all of
    # them, units in the order of their first name. Otherwise it walks the optimizer's parameters.
    if any(index.get(id(p), ("",))[0] == "orig" for p in params):
        state = dict(sorted(plain.items()))
        for unit in sorted((u for u in per_unit.values() if u), key=min):
            state.update(sorted(unit.items()))
    else:
        state = {}
        for p in params:
            kind, h, _, fqn = index.get(id(p), ("plain", None, None, None))
            state.update(per_unit.get(id(h), {}) if kind == "flat" else {fqn: plain[fqn]} if fqn in plain else {})
    groups = []
    for g in osd["param_groups"]:
        fqns = []
        for key in g["params"]:
            p = params[key] if not isinstance(key, str) else by_name.get(key)
            if p is None:
                raise ValueError(f"zeroshard: optim_state_dict: the optimizer's state dict names parameter '{key}', which "
                                 "model.named_parameters() does not have. Fix: build the named optimizer from this wrapped "
                                 "model's named_parameters().")
            fqns += _fqns(index, p, "optim_state_dict")
        # Copies: a tensor lr that a scheduler updates in place must not change the saved dict (torch deep-copies).
        groups.append({**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has not stepped yet, so that a
    SHARDED optimizer state dict has tensors for DCP to load into: one step
    with zero gradients at learning rate 0 (parameters stay bit-identical for
    AdamW, Adam and SGD). No-op once the optimizer has state or any gradient.
    Parameters with no element on this rank get no gradient, as in training.
    """
    params = _optim_params(optim)
    if optim.state or any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad and p.numel() > 0:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optim.param_groups]
    for g in optim.param_groups:
        g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
    try:
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs):
            g["lr"] = lr
        optim.zero_grad(set_to_none=True)
