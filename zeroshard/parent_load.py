"""Loading a state dict through a plain parent module (FULL, SHARDED or LOCAL).

nn.Module.load_state_dict never calls a child's load_state_dict: it calls
``_load_from_state_dict`` on every module of the tree, top down. A unit that a
plain parent's load reaches that way (a ModuleDict holding a GAN's two wrapped
models, a model whose blocks alone are wrapped) loads its whole subtree there,
as its own ``load_state_dict`` does (gathering each unit, writing the shards).
The walk then goes on into the subtree, where the unit's descendants see an
empty share of the dict and report their keys missing under the wrapped names,
so the unit's load post-hook replaces every key under its prefix by the ones
its own load reported. torch FSDP1 reaches the same result through its
state-dict hooks.
"""
from __future__ import annotations

import contextlib

from .summon import units_of

_own_loads = [0]  # > 0 inside a unit's own load_state_dict, whose walk is nn.Module's
_from_parent: list = [None]  # (unit, prefix, missing, unexpected) while a parent's walk is in its subtree


@contextlib.contextmanager
def own_load():
    _own_loads[0] += 1
    try:
        yield
    finally:
        _own_loads[0] -= 1


def own_load_active() -> bool:
    return _own_loads[0] > 0


def load_from_parent(unit, state_dict, prefix: str, local_metadata: dict) -> None:
    """``unit._load_from_state_dict`` when a plain parent's load_state_dict reaches it."""
    outer = _from_parent[0]
    if outer is not None and outer[0] is not unit and unit in units_of(outer[0]):
        return  # loaded with the unit whose subtree this is
    sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    result = unit.load_state_dict(sub, strict=False, assign=local_metadata.get("assign_to_params_buffers", False))
    _from_parent[0] = (unit, prefix, [prefix + k for k in result.missing_keys],
                       [prefix + k for k in result.unexpected_keys])


def after_parent_load(unit, incompatible_keys) -> None:
    """Load post-hook of every unit: the keys its subtree reports are its own load's."""
    outer = _from_parent[0]
    if outer is None or outer[0] is not unit:
        return
    _from_parent[0] = None
    _, prefix, missing, unexpected = outer
    for keys, ours in ((incompatible_keys.missing_keys, missing), (incompatible_keys.unexpected_keys, unexpected)):
        keys[:] = [k for k in keys if not k.startswith(prefix)] + ours
