"""torch FSDP1's older optimizer-state API, expressed through ``optim_state``
(gather) and ``optim_load`` (cut back to this rank's shards).

torch deprecated these in favour of ``optim_state_dict`` /
``optim_state_dict_to_load`` but scripts still call them; each one here is
the new API with the form named in the call instead of taken from
``state_dict_type``:

  sharded_optim_state_dict          optim_state_dict, SHARDED rows
  shard_full_optim_state_dict       optim_state_dict_to_load of a FULL dict held by every rank
  scatter_full_optim_state_dict     ... of a FULL dict held by rank 0 only (broadcast)
  flatten_sharded_optim_state_dict  ... of a SHARDED dict (rows all-gathered)

``rekey_optim_state_dict`` converts between the two key types of optimizer
state dicts: parameter names (FQNs, what FSDP saves) and parameter IDs (what
``torch.optim.Optimizer.state_dict`` of an unwrapped model uses).
"""
from __future__ import annotations

import copy
import enum
import warnings
from types import SimpleNamespace

import torch
import torch.nn as nn

from . import optim_load, optim_state


class OptimStateKeyType(enum.Enum):
    """The keys of an optimizer state dict's ``state``: parameter FQNs or IDs."""

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


def _optim_or_params(model: nn.Module, optim_input, optim):
    """What numbers the parameters: the optimizer; else torch's deprecated
    ``optim_input`` (the parameters or param groups the optimizer was built
    from); else (both None, as torch allows) ``model.parameters()``."""
    if optim_input is not None:
        warnings.warn("zeroshard: optim_input is deprecated (as in torch FSDP1); pass optim=the optimizer.",
                      FutureWarning, stacklevel=3)
        items = list(optim_input)
        groups = [dict(g, params=list(g["params"])) for g in items] if items and isinstance(items[0], dict) \
            else [{"params": items}]
        stand_in = SimpleNamespace(param_groups=groups)
        if optim is not None and list(map(id, optim_state._optim_params(stand_in))) != list(map(id, optim_state._optim_params(optim))):
            raise ValueError("zeroshard: optim_input and optim list different parameters. Fix: pass optim only.")
        return stand_in
    if optim is not None:
        return optim
    return SimpleNamespace(param_groups=[{"params": list(model.parameters())}])


def _saved_groups_unless(model: nn.Module, optim_input, optim):
    """For a load: None (the saved dict's param groups, over the model's parameters: see
    ``optim_load``) unless the optimizer or its ``optim_input`` is given."""
    return None if optim is None and optim_input is None else _optim_or_params(model, optim_input, optim)


def check_optim_input(model: nn.Module, optim_input, optim) -> None:
    """``full_optim_state_dict``'s deprecated ``optim_input``: accepted (with
    torch's warning) when it lists the optimizer's own parameters."""
    if optim_input is not None:
        _optim_or_params(model, optim_input, optim)


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group=None) -> dict:
    """The optimizer state dict as this rank's rows (DTensors), whatever the state dict type."""
    return optim_state._optim_state_dict(model, optim, None, group, rank0_only=False, form="rows")


def shard_full_optim_state_dict(full_optim_state_dict: dict, model: nn.Module, optim_input=None, optim=None) -> dict:
    """A FULL optimizer state dict (held by every rank) cut to this rank's shards; no communication.
    Without ``optim`` / ``optim_input`` the dict's own param groups number the parameters, in
    their saved order (torch numbers them in ``model.parameters()`` order instead, which gives
    an optimizer listing them in another order the wrong states)."""
    target = _saved_groups_unless(model, optim_input, optim)
    return optim_load.optim_state_dict_to_load(model, target, full_optim_state_dict, rank0_only=False, agree=False)


def scatter_full_optim_state_dict(full_optim_state_dict: dict | None, model: nn.Module, optim_input=None, optim=None,
                                  group=None) -> dict:
    """Like :func:`shard_full_optim_state_dict`, but only rank 0 holds the dict
    (others pass None or {}): its states are broadcast one at a time."""
    target = _saved_groups_unless(model, optim_input, optim)
    return optim_load.optim_state_dict_to_load(model, target, full_optim_state_dict, group, rank0_only=True)


def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict, model: nn.Module, optim) -> dict:
    """A SHARDED optimizer state dict (zeroshard's DTensor rows or torch's
    ShardedTensors) cut to this rank's shards (collective: rows are all-gathered)."""
    return optim_load.optim_state_dict_to_load(model, optim, sharded_optim_state_dict, rank0_only=False)


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> FQN in the plain model. A FlatParameter standing for
    several parameters has no one name to key its state: refused, as torch;
    one standing for a single parameter takes its name, as torch's does."""
    index = optim_state._param_index(model)
    for kind, _, _, names in index.values():
        if kind == "flat" and len(names) > 1:
            raise RuntimeError(
                f"zeroshard: rekey_optim_state_dict: the model holds a FlatParameter (use_orig_params=False) "
                f"standing for {len(names)} parameters ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
                "a state keyed by its ID has no single name. Fix: rekey a dict from FSDP.full_optim_state_dict / "
                "optim_state_dict (keyed by names already), or wrap with use_orig_params=True.")
    return {pid: names[0] if kind == "flat" else names for pid, (kind, _, _, names) in index.items()}


def rekey_optim_state_dict(optim_state_dict: dict, optim_state_key_type: OptimStateKeyType, model: nn.Module,
                           optim_input=None, optim=None) -> dict:
    """``optim_state_dict`` with its parameter keys turned into names or IDs.

    IDs number the optimizer's parameters across its param groups (or
    ``model.parameters()`` when ``optim`` is None); names are the plain
    model's FQNs. A dict already keyed that way is returned as is.
    """
    kind = getattr(optim_state_key_type, "name", None)  # torch's OptimStateKeyType works too
    if kind not in ("PARAM_NAME", "PARAM_ID"):
        raise ValueError(f"zeroshard: optim_state_key_type must be OptimStateKeyType.PARAM_NAME or PARAM_ID, "
                         f"got {optim_state_key_type!r}.")
    keys = list(optim_state_dict["state"])
    if not (all(type(k) is str for k in keys) or all(type(k) is int for k in keys)):
        raise ValueError(f"zeroshard: rekey_optim_state_dict: the state keys mix names and IDs: {keys[:6]}. "
                         "Fix: pass a dict from one optimizer or one FSDP optim_state_dict call.")
    want_names = kind == "PARAM_NAME"
    if all(type(k) is (str if want_names else int) for k in keys):
        return optim_state_dict
    params = optim_state._optim_params(_optim_or_params(model, optim_input, optim))
    names = _param_names(model)
    id_to_name = []
    for pid, p in enumerate(params):
        if id(p) not in names:
            raise ValueError(f"zeroshard: rekey_optim_state_dict: parameter {pid} of the optimizer is not in the model. "
                             "Fix: pass the model the optimizer was built over.")
        id_to_name.append(names[id(p)])
    mapping = dict(enumerate(id_to_name)) if want_names else {n: i for i, n in enumerate(id_to_name)}
    missing = [k for k in keys + [k for g in optim_state_dict["param_groups"] for k in g["params"]] if k not in mapping]
    if missing:
        raise ValueError(f"zeroshard: rekey_optim_state_dict: keys {missing[:3]} name no parameter of this "
                         "model/optimizer. Fix: pass the model (and optimizer) the dict was saved from.")
    groups = copy.deepcopy(optim_state_dict["param_groups"])
    for g in groups:
        g["params"] = sorted(mapping[k] for k in g["params"])
    return {"state": {mapping[k]: v for k, v in optim_state_dict["state"].items()}, "param_groups": groups}
