"""Which state dict each unit gives: torch FSDP1's ``state_dict_type``.

Every unit holds a ``StateDictType`` (FULL, LOCAL or SHARDED), its
``*StateDictConfig`` and an optional ``*OptimStateDictConfig``;
``FSDP.state_dict_type`` / ``set_state_dict_type`` set them on every unit of
a model, ``get_state_dict_type`` reads them back as ``StateDictSettings``.
``state_dict`` and ``optim_state`` read them when a state dict is made.
"""
from __future__ import annotations

import contextlib

import torch.nn as nn

from .options import DEFAULT_CONFIG, DEFAULT_OPTIM_CONFIG, StateDictSettings, StateDictType, as_member
from .summon import units_of


def _kinds(s: StateDictSettings) -> tuple:
    return s.state_dict_type, type(s.state_dict_config), type(s.optim_state_dict_config)


def state_dict_settings(module: nn.Module, strict: bool = True) -> StateDictSettings | None:
    """The units' common settings (an unset optimizer config reads as the
    default for the type, as torch reports it); None without units. Raises if
    the units disagree, since a state dict would then mix forms; with
    ``strict=False`` (what torch's set_state_dict_type checks) only the types
    and config classes must agree, and the first unit's settings are returned."""
    found = None
    for u in units_of(module):
        optim_cfg = u.__dict__.get("_optim_state_dict_config") or DEFAULT_OPTIM_CONFIG[u._state_dict_type]()
        settings = StateDictSettings(u._state_dict_type, u._state_dict_config, optim_cfg)
        if found is None:
            found = settings
        elif settings != found and (strict or _kinds(settings) != _kinds(found)):
            raise RuntimeError(f"zeroshard: the units of {type(module).__name__} have different state dict settings "
                               f"({found} and {settings}). Fix: set them for the whole model with "
                               "FSDP.set_state_dict_type(model, ...) on the root.")
    return found


@contextlib.contextmanager
def state_dict_type(module, kind: StateDictType, config=None, optim_config=None):
    """Inside, every unit of ``module`` uses ``kind`` for state dicts and
    ``optim_config`` (see ``optim_state``) for optimizer state dicts."""
    previous = set_state_dict_type(module, kind, config, optim_config)
    try:
        yield
    finally:
        for u, (k, c, oc) in previous.items():
            u._state_dict_type, u._state_dict_config, u.__dict__["_optim_state_dict_config"] = k, c, oc


def set_state_dict_type(module, kind: StateDictType, config=None, optim_config=None):
    """Set every unit's state dict type and configs; returns the previous ones.

    ``optim_config`` None means the default for ``kind`` (resolved by
    ``optim_state``: full on every rank, or sharded under SHARDED_STATE_DICT)."""
    kind = as_member(kind, StateDictType, "state_dict_type")
    if config is None and kind in DEFAULT_CONFIG:
        config = DEFAULT_CONFIG[kind]()
    prefix = {StateDictType.FULL_STATE_DICT: "Full", StateDictType.LOCAL_STATE_DICT: "Local",
              StateDictType.SHARDED_STATE_DICT: "Sharded"}.get(kind)
    for cfg, suffix in ((config, "StateDictConfig"), (optim_config, "OptimStateDictConfig")):
        # Matched by class name, so torch's config classes work as well as zeroshard's.
        if cfg is not None and prefix is not None and type(cfg).__name__ != prefix + suffix:
            raise RuntimeError(f"zeroshard: set_state_dict_type({kind.name}) got a {type(cfg).__name__}. "
                             f"Fix: pass a {prefix}{suffix} (or None for the default).")
    previous = {}
    for u in units_of(module):
        previous[u] = (u._state_dict_type, u._state_dict_config, u.__dict__.get("_optim_state_dict_config"))
        u._state_dict_type, u._state_dict_config = kind, config
        u.__dict__["_optim_state_dict_config"] = optim_config
    return previous
