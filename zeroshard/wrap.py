"""Wrapping policies: which submodules become their own FSDP unit.

A unit is the granularity of ZeRO-3: its parameters are gathered together and
freed together, so smaller units mean a smaller working set and more, smaller
collectives. The policy protocol is torch FSDP1's: ``policy(module, recurse,
nonwrapped_numel)``; with ``recurse=True`` it answers "may I look inside
``module``?", with ``recurse=False`` "should ``module`` be a unit?", where
``nonwrapped_numel`` counts the parameters not already claimed by a unit below.
Units are created bottom-up (children before parents), like torch's
``_recursive_wrap``.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once ``min_num_params`` parameters are left unwrapped in it."""
    force_leaf = size_based_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    exclude = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules
    if recurse:
        return not isinstance(module, tuple(force_leaf))
    return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(exclude))


# Containers have no forward of their own to hook; attention's parameters are
# read outside its submodules' forwards.
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable) -> bool:
    """Wrap every module for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: Iterable[type[nn.Module]]
) -> bool:
    """Wrap every instance of the given block classes (e.g. a transformer layer)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


class ModuleWrapPolicy:
    """Wrap every instance of ``module_classes`` (the object form of the policy above)."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self._module_classes = tuple(module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int = 0, **kwargs) -> bool:
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self):
        return f"ModuleWrapPolicy({[c.__name__ for c in self._module_classes]})"


def auto_wrap(module: nn.Module, policy: Callable, make_unit: Callable[[nn.Module], nn.Module], ignored: set, is_unit,
              ignored_params=frozenset()) -> None:
    """Replace, bottom-up, each child subtree the policy selects with ``make_unit(child)``.

    The root itself is not wrapped here: the caller makes it the outermost unit.
    Ignored modules and ``ignored_params`` do not count towards a subtree's size.
    """

    def numel_free(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters() if not hasattr(p, "_zeroshard_unit") and p not in ignored_params)

    ignored_params = set(ignored_params) | {p for m in ignored for p in m.parameters()}

    def visit(m: nn.Module, only_children: bool) -> tuple[nn.Module, int]:
        if m in ignored:
            return m, 0
        if is_unit(m):
            raise ValueError(
                f"zeroshard: {type(m).__name__} is already an FSDP unit inside a module being auto-wrapped. "
                "Fix: use either manual nesting or auto_wrap_policy, not both on the same subtree."
            )
        numel = numel_free(m)
        if not policy(module=m, recurse=True, nonwrapped_numel=numel):
            return m, 0
        wrapped = 0
        for name, child in list(m.named_children()):
            new_child, n = visit(child, False)
            if new_child is not child:
                setattr(m, name, new_child)
            wrapped += n
        if not only_children and policy(module=m, recurse=False, nonwrapped_numel=numel - wrapped):
            return make_unit(m), numel
        return m, wrapped

    visit(module, True)


__all__ = ["size_based_auto_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy", "ModuleWrapPolicy"]
