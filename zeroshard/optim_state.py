"""Optimizer state dicts: ZeRO-1's sharded optimizer state, gathered and
scattered for checkpoints.

Under ZeRO every rank's optimizer only ever sees this rank's shard: with
``use_orig_params=False`` one state per FlatParameter (1-D, ``shard_numel``
elements, tail padding included), with ``use_orig_params=True`` one 1-D state
per original parameter slice that falls in this rank's shard (none where the
shard holds no element of it). A checkpoint must not depend on that layout, so

* :func:`optim_state_dict` all-gathers each unit's per-element states (one
  all-gather per unit and state name, the same shard layout as the parameters)
  and returns torch FSDP1's FULL format: ``state`` keyed by the plain model's
  parameter FQNs with full-shape tensors (``exp_avg``...) and scalars
  (``step``), and ``param_groups`` whose ``params`` are FQN lists;
* :func:`optim_state_dict_to_load` cuts a FULL optimizer state dict back into
  what ``optim.load_state_dict`` expects on this rank: the flattened and
  sharded concatenation of the per-parameter states (zeros in the padding)
  for a FlatParameter, or the 1-D slice for each original parameter.

As in torch, a state counts as per-element when it is a tensor with at least
one dimension; zero-dimensional tensors and non-tensors are scalars (``step``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .state_dict import clean_key, units_of


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
        fqns = [prefix + info.fqn for info in h.layout.params]
        if h.use_orig_params:
            for i, p in enumerate(h.orig_params):
                index[id(p)] = ("orig", h, i, fqns[i])
        else:
            index[id(h.flat_param)] = ("flat", h, None, fqns)
    for name, p in model.named_parameters():
        index.setdefault(id(p), ("plain", None, None, clean_key(name)))
    return index


def _optim_params(optim: torch.optim.Optimizer):
    return [p for group in optim.param_groups for p in group["params"]]


def _is_elem(v) -> bool:
    return torch.is_tensor(v) and v.dim() > 0


def _ordered(state: dict) -> dict:
    """torch's order inside one parameter's state: per-element tensors, then
    zero-dim tensors, then the rest, each sorted by name."""
    rank = lambda kv: (0 if _is_elem(kv[1]) else 1 if torch.is_tensor(kv[1]) else 2, kv[0])  # noqa: E731
    return dict(sorted(state.items(), key=rank))


def _local_spec(states: list[dict | None]) -> dict:
    """What this rank knows of one unit's state: index -> {name: dtype | scalar}."""
    spec = {}
    for i, st in enumerate(states):
        if st is not None:
            spec[i] = {k: ("elem", v.dtype) if _is_elem(v) else ("scalar", v) for k, v in st.items()}
    return spec


def _gather_unit(h, prefix: str, optim) -> dict[str, dict]:
    """Full (unsharded) states of one unit's parameters, keyed by FQN."""
    n = len(h.layout.params)
    if h.use_orig_params:
        states = [optim.state.get(p) or None for p in h.orig_params]
    else:
        states = [optim.state.get(h.flat_param) or None] * n  # one state for the whole FlatParameter
    # Ranks holding no element of a parameter have no state for it (and a
    # rank cannot know its dtype or step): exchange what each rank has.
    spec = _local_spec(states)
    if h.sharded and h.world_size > 1:
        specs = [None] * h.world_size
        dist.all_gather_object(specs, spec, group=h.group)
    else:
        specs = [spec]
    merged: dict[int, dict] = {}
    for s in specs:
        for i, names in s.items():
            for k, v in names.items():
                merged.setdefault(i, {}).setdefault(k, v)
    out = {prefix + h.layout.params[i].fqn: {} for i in sorted(merged)}
    elem_names = sorted({k: v[1] for names in merged.values() for k, v in names.items() if v[0] == "elem"}.items())
    device = h.local_shard.device
    for name, dtype in elem_names:
        full = _full_flat(h, states, name, dtype, device, flat=not h.use_orig_params)
        for i, info in enumerate(h.layout.params):
            if name in merged.get(i, {}):
                # A copy, not a view of the gathered buffer: each state must
                # own its memory (torch FSDP1 on CPU returns views of one
                # buffer it reuses for every state name, see the tests).
                out[prefix + info.fqn][name] = full[info.offset : info.offset + info.numel].view(info.shape).to("cpu", copy=True)
    for i, names in merged.items():
        for k, (kind, v) in names.items():
            if kind == "scalar":
                out[prefix + h.layout.params[i].fqn][k] = v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
    return {k: _ordered(v) for k, v in out.items()}


def _full_flat(h, states, name, dtype, device, flat: bool) -> torch.Tensor:
    """The unsharded flat buffer of state ``name``: this rank's shard is
    assembled from its states (zeros where it has none), then all-gathered."""
    layout = h.layout
    if flat:  # the FlatParameter's state is already this rank's shard (or full with NO_SHARD)
        st = states[0]
        shard = st[name] if st is not None and name in st else torch.zeros(h.local_shard.numel(), dtype=dtype, device=device)
    else:
        shard = torch.zeros(h.local_shard.numel(), dtype=dtype, device=device)
        for st, info, sl in zip(states, layout.params, layout.shard_slices):
            if st is None or name not in st:
                continue
            if not h.sharded:
                shard[info.offset : info.offset + info.numel].copy_(st[name].reshape(-1))
            elif sl is not None:
                shard[sl.offset_in_shard : sl.offset_in_shard + sl.numel_in_shard].copy_(st[name])
    if not h.sharded or h.world_size == 1:
        return shard
    full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
    comm.all_gather(full, shard.to(device).contiguous(), h.group, async_op=False)
    return full


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None, group=None) -> dict:
    """torch FSDP1's FULL optimizer state dict of ``optim`` (collective: call on every rank).

    ``optim_state_dict`` (default ``optim.state_dict()``) only supplies the
    ``param_groups`` hyperparameters; states are read from ``optim`` itself.
    ``group`` is accepted for torch's signature: each unit gathers over its own
    process group.
    """
    osd = optim_state_dict if optim_state_dict is not None else optim.state_dict()
    index = _param_index(model)
    params = _optim_params(optim)
    state: dict[str, dict] = {}
    gathered = set()
    # Every rank walks the units in the same order, so the collectives match.
    for h, prefix in _unit_prefixes(model):
        in_optim = [p for p in ([h.flat_param] if not h.use_orig_params else h.orig_params) if any(p is q for q in params)]
        if in_optim:
            state.update(_gather_unit(h, prefix, optim))
            gathered.add(id(h))
    for p in params:
        kind, h, _, fqn = index.get(id(p), ("plain", None, None, None))
        if kind == "plain" and p in optim.state:
            if fqn is None:
                raise ValueError("zeroshard: optim_state_dict: the optimizer holds a parameter that is not in the model. "
                                 "Fix: pass the model whose parameters the optimizer was built from.")
            state[fqn] = _ordered({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in optim.state[p].items()})
    if any(index.get(id(p), ("",))[0] == "orig" for p in params):
        state = dict(sorted(state.items()))  # torch merges the ranks' keys and sorts them with use_orig_params
    groups = []
    for g in osd["param_groups"]:
        fqns = []
        for pid in g["params"]:
            kind, _, _, names = index.get(id(params[pid]), ("plain", None, None, None))
            fqns += names if kind == "flat" else [names]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict, group=None) -> dict:
    """Turn a FULL optimizer state dict into ``optim.load_state_dict``'s input for this rank.

    Local: no communication, since every rank holds the full states.
    """
    full = optim_state_dict["state"]
    index = _param_index(model)
    params = _optim_params(optim)
    state, fqn_groups = {}, []
    for pid, p in enumerate(params):
        kind, h, i, names = index.get(id(p), ("plain", None, None, None))
        if names is None:
            raise ValueError("zeroshard: optim_state_dict_to_load: the optimizer holds a parameter that is not in the model. "
                             "Fix: pass the model whose parameters the optimizer was built from.")
        fqn_groups.append(names if kind == "flat" else [names])
        if kind == "flat":
            st = _flatten_shard(h, names, full)
        elif kind == "orig":
            st = _orig_shard(h, i, full.get(names))
        else:
            st = {k: v.clone() if torch.is_tensor(v) else v for k, v in full[names].items()} if names in full else None
        if st:
            state[pid] = st
    groups, pos = [], 0
    saved_groups = optim_state_dict["param_groups"]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(f"zeroshard: the optimizer state dict has {len(saved_groups)} param groups but the optimizer has "
                         f"{len(optim.param_groups)}. Fix: build the optimizer with the same param groups as when saving.")
    for gi, (saved, ours) in enumerate(zip(saved_groups, optim.param_groups)):
        ids = list(range(pos, pos + len(ours["params"])))
        pos += len(ours["params"])
        expected = [f for pid in ids for f in fqn_groups[pid]]
        if set(saved["params"]) != set(expected):
            missing = sorted(set(expected) - set(saved["params"]))[:3]
            extra = sorted(set(saved["params"]) - set(expected))[:3]
            raise ValueError(f"zeroshard: param group {gi} of the optimizer state dict does not hold this optimizer's "
                             f"parameters (missing e.g. {missing}, unexpected e.g. {extra}). Fix: load a state dict "
                             "saved from the same model and param groups.")
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _flatten_shard(h, fqns: list[str], full: dict) -> dict | None:
    """This rank's FlatParameter state: the per-parameter states flattened,
    concatenated at the parameters' offsets (zeros in padding), then sharded."""
    present = [f for f in fqns if f in full]
    if not present:
        return None
    layout, device = h.layout, h.local_shard.device
    out = {}
    names = {k for f in present for k in full[f]}
    for name in sorted(names):
        values = [full[f].get(name) for f in present]
        sample = next(v for v in values if v is not None)
        if not _is_elem(sample):
            # One FlatParameter has one scalar (e.g. step): its parameters must agree.
            if any(v is None or (torch.is_tensor(v) and not torch.equal(v, sample)) or (not torch.is_tensor(v) and v != sample) for v in values):
                raise ValueError(f"zeroshard: optimizer state '{name}' differs between parameters of unit '{h.unit_name}' "
                                 f"({present}); with use_orig_params=False they share one FlatParameter and one '{name}'. "
                                 "Fix: load with use_orig_params=True, or make the values equal.")
            out[name] = sample.clone() if torch.is_tensor(sample) else sample
            continue
        shard = torch.zeros(h.local_shard.numel(), dtype=sample.dtype, device=device)
        start = layout.shard_start if h.sharded else 0
        end = layout.shard_end if h.sharded else layout.numel
        for fqn, info in zip(fqns, layout.params):
            v = full.get(fqn, {}).get(name)
            if v is None:
                continue
            _check_shape(v, info, name, fqn)
            lo, hi = max(info.offset, start), min(info.offset + info.numel, end)
            if lo < hi:
                shard[lo - start : hi - start].copy_(v.reshape(-1)[lo - info.offset : hi - info.offset])
        out[name] = shard
    return out


def _orig_shard(h, i: int, st: dict | None) -> dict | None:
    """This rank's state of original parameter ``i``: its 1-D slice, or none
    when the shard holds no element of it (the optimizer never steps it)."""
    if st is None:
        return None
    info, sl = h.layout.params[i], h.layout.shard_slices[i]
    if h.sharded and sl is None:
        return None
    out = {}
    for name, v in st.items():
        if not _is_elem(v):
            out[name] = v.clone() if torch.is_tensor(v) else v
            continue
        _check_shape(v, info, name, info.fqn)
        if not h.sharded:
            out[name] = v.reshape(info.shape).to(h.local_shard.device, copy=True)
        else:
            out[name] = v.reshape(-1)[sl.offset_in_param : sl.offset_in_param + sl.numel_in_shard].to(h.local_shard.device, copy=True)
    return out


def _check_shape(v: torch.Tensor, info, name: str, fqn: str):
    if v.numel() != info.numel:
        raise ValueError(f"zeroshard: optimizer state '{name}' of '{fqn}' has shape {tuple(v.shape)} but the parameter has "
                         f"shape {tuple(info.shape)}. Fix: load an optimizer state dict saved from the same model.")
