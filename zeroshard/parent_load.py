"""Loading a state dict through a plain parent module (FULL, SHARDED or LOCAL).

nn.Module.load_state_dict never calls a child's load_state_dict: it calls
``_load_from_state_dict`` on every module of the tree, top down, and then
walks into the module's children. A unit that a plain parent's load reaches
that way (a ModuleDict holding a GAN's two wrapped models, a model whose
blocks alone are wrapped) loads its whole subtree there, as its own
``load_state_dict`` does: every rank checks the keys and shapes first, then
each unit is gathered, written and freed in turn. The unit then hides its
children from the parent's walk until its own load post-hook, the next thing
that walk runs on it: the modules inside are loaded once, by the unit's load,
and report no keys of their own. The post-hook adds the unit's missing and
unexpected keys under its prefix. torch FSDP1 reaches the same result
through its state-dict hooks.
"""
from __future__ import annotations

import contextlib

_own_loads = [0]  # > 0 inside a unit's own load_state_dict, whose walk is nn.Module's
_loading: set = set()  # units whose load load_from_parent is running
_HIDDEN = "_zeroshard_parent_load"  # the unit's children and keys, between load_from_parent and its post-hook


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
    if unit in _loading:  # its load_state_dict went back to nn.Module's, which would come here again, forever
        raise RuntimeError(f"zeroshard: the load_state_dict of unit {type(unit).__name__} calls nn.Module.load_state_dict "
                           "on itself. Fix: call super().load_state_dict(...), or wrap that call in "
                           "zeroshard.parent_load.own_load().")
    sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    _loading.add(unit)
    try:
        result = unit.load_state_dict(sub, strict=False, assign=local_metadata.get("assign_to_params_buffers", False))
    except (RuntimeError, ValueError) as e:  # its keys are relative to the unit: say which one
        if type(e) not in (RuntimeError, ValueError):  # e.g. a CollectiveError: its own words
            raise
        raise type(e)(f"{e} (loading unit '{prefix[:-1]}' through its parent module)") from e
    finally:
        _loading.discard(unit)
    unit.__dict__[_HIDDEN] = (unit._modules, [prefix + k for k in result.missing_keys],
                              [prefix + k for k in result.unexpected_keys])
    unit._modules = {}  # nn.Module's walk goes on into these next; nothing runs before the post-hook


def after_parent_load(unit, incompatible_keys) -> None:
    """Load post-hook of every unit (registered first): gives back the children
    that :func:`load_from_parent` hid and adds its load's keys."""
    hidden = unit.__dict__.pop(_HIDDEN, None)
    if hidden is None:
        return
    unit._modules, missing, unexpected = hidden
    incompatible_keys.missing_keys.extend(missing)
    incompatible_keys.unexpected_keys.extend(unexpected)
