"""Wrapping policies: which submodules become their own FSDP unit.

A unit is the granularity of ZeRO-3: its parameters are gathered together and
freed together, so smaller units mean a smaller working set and more, smaller
collectives. The policy protocol is torch FSDP1's: ``policy(module, recurse,
nonwrapped_numel)``; with ``recurse=True`` it answers "may I look inside
``module``?", with ``recurse=False`` "should ``module`` be a unit?", where
``nonwrapped_numel`` counts the parameters not already claimed by a unit below.
Units are created bottom-up (children before parents), like torch's
``_recursive_wrap``.

Policy *objects* (``ModuleWrapPolicy``, ``CustomPolicy``, and torch's own)
take torch's other path: ``_run_policy`` lists the modules to wrap, each with
its constructor keywords (the root's, or the root's updated by the policy), and
they are wrapped in post-order. Either way, with ``mixed_precision`` set, the
classes in its ``_module_classes_to_ignore`` (BatchNorm by default) become
units of their own that run in fp32, as torch FSDP1 does. ``enable_wrap`` /
``wrap`` are the manual form: modules passed to ``wrap`` inside the context
become units with the context's keywords.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable

import torch.nn as nn

from .flat_param import kept_out
from .mixed_precision import run_in_fp32


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
    large = nonwrapped_numel >= min_num_params  # a smaller subtree cannot hold a unit either
    return large and not isinstance(module, tuple(force_leaf if recurse else exclude))


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


def _module_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, module_classes) -> bool:
    """torch's private name for the function form of ModuleWrapPolicy."""
    return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel, module_classes)


def _wrap_module_cls_individually(module: nn.Module, module_classes, recurse: bool, *args, **kwargs) -> bool:
    """torch's private helper (Accelerate's FSDP plugin uses it): wrap each instance of ``module_classes``."""
    return True if recurse else isinstance(module, tuple(module_classes))


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies) -> bool:
    """Wrap where any of ``policies`` would (torch's private helper, which PEFT
    and Accelerate use to join a lambda policy and a transformer policy)."""
    return any(policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for policy in policies)


def always_wrap_policy(*args, **kwargs) -> bool:
    """Every submodule becomes its own unit."""
    return True


class _Policy:
    """torch's base of the policy objects (for ``isinstance`` checks); each one's
    ``_run_policy(root, ignored, root_kwargs)`` maps the modules to wrap to their
    units' keywords."""


class ModuleWrapPolicy(_Policy):
    """Wrap every instance of ``module_classes`` (the object form of the policy above)."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self._module_classes = tuple(module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int = 0, **kwargs) -> bool:
        return True if recurse else isinstance(module, self._module_classes)

    def _run_policy(self, root: nn.Module, ignored: set, root_kwargs: dict) -> dict[nn.Module, dict]:
        return {m: dict(root_kwargs) for m in root.modules() if m not in ignored and isinstance(m, self._module_classes)}

    def __repr__(self):
        return f"ModuleWrapPolicy({[c.__name__ for c in self._module_classes]})"


class CustomPolicy(_Policy):
    """Decide module by module with ``lambda_fn(module)``: ``False`` (or ``{}``)
    leaves it alone, ``True`` makes it a unit with the root's keywords, a dict
    makes it a unit whose keywords are the root's updated by the dict, e.g.
    ``{"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}`` for one layer."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]):
        self._lambda_fn = lambda_fn

    def _run_policy(self, root: nn.Module, ignored: set, root_kwargs: dict) -> dict[nn.Module, dict]:
        targets = {}
        for m in root.modules():
            if m in ignored:
                continue
            res = self._lambda_fn(m)
            if not isinstance(res, (bool, dict)):
                raise ValueError(
                    f"zeroshard: CustomPolicy's lambda_fn returned {res!r} for a {type(m).__name__}. "
                    "Fix: return True, False or a dict of FullyShardedDataParallel keywords for that unit."
                )
            if res:
                targets[m] = {**root_kwargs, **(res if isinstance(res, dict) else {})}
        return targets


def _nested_unit_error(m: nn.Module) -> ValueError:
    return ValueError(
        f"zeroshard: {type(m).__name__} is already an FSDP unit inside a module being auto-wrapped. "
        "Fix: use either manual nesting or auto_wrap_policy, not both on the same subtree."
    )


def wrap_submodules(module: nn.Module, policy, unit_kwargs: dict, make_unit: Callable[..., nn.Module], ignored: set,
                    is_unit, ignored_params=frozenset()) -> None:
    """The constructor's auto-wrap step: ``make_unit(child, **keywords)`` for
    each child the policy selects (the root is left to the caller).
    ``unit_kwargs`` are the root's keywords; policy objects may override them
    per unit."""
    bad = next((m for m in module.modules() if is_unit(m)), None)
    if bad is not None:  # checked before anything changes, ignored subtrees included (as torch)
        raise _nested_unit_error(bad)
    if isinstance(policy, (type, set, frozenset, list, tuple)):
        # else "'set' object is not callable", or the class called with module=... (torch's errors too)
        raise ValueError(f"zeroshard: auto_wrap_policy={policy!r} is not a policy. Fix: for module classes pass "
                         "ModuleWrapPolicy({Block, ...}); else a policy object, or a callable "
                         "(module, recurse, nonwrapped_numel) -> bool such as functools.partial(size_based_auto_wrap_policy, ...).")
    mp = unit_kwargs.get("mixed_precision")
    fp32_classes = tuple(getattr(mp, "_module_classes_to_ignore", ())) if mp is not None else ()
    fp32 = [m for m in module.modules() if isinstance(m, fp32_classes)]
    for m in fp32:  # torch hooks every instance, ignored ones and the root included, but wraps only the others
        run_in_fp32(m)
        m._wrap_overrides = {"mixed_precision": None}  # what wrap() then applies, as torch
    if fp32:
        warnings.warn(f"zeroshard: mixed precision with auto_wrap_policy: {sorted({type(m).__name__ for m in fp32})} "
                      "become units of their own with mixed precision disabled (MixedPrecision._module_classes_to_ignore), "
                      "as in torch FSDP1.", stacklevel=3)
    fp32 = [m for m in fp32 if m not in ignored and m is not module]

    def unit(m: nn.Module, kwargs: dict) -> nn.Module:
        unknown = sorted(set(kwargs) - set(unit_kwargs))
        if unknown:
            raise ValueError(f"zeroshard: auto_wrap_policy gave the {type(m).__name__} unit unknown keyword(s) {unknown}. "
                             f"Fix: use FullyShardedDataParallel keywords ({', '.join(sorted(unit_kwargs))}).")
        return make_unit(m, **(dict(kwargs, mixed_precision=None) if isinstance(m, fp32_classes) else kwargs))

    if hasattr(policy, "_run_policy"):  # policy objects, torch's included
        targets = policy._run_policy(module, ignored, dict(unit_kwargs))
        targets.update({m: dict(targets.get(m, unit_kwargs)) for m in fp32})
        _post_order_apply(module, lambda m: unit(m, targets[m]) if m in targets else None)
    else:
        def selected(module, recurse, nonwrapped_numel):  # the policy, or one of the fp32 classes
            return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) or recurse or \
                isinstance(module, fp32_classes)

        auto_wrap(module, selected if fp32_classes else policy, lambda m: unit(m, unit_kwargs), ignored, is_unit, ignored_params)


def _post_order_apply(root: nn.Module, fn: Callable[[nn.Module], nn.Module | None]) -> None:
    """Replace each module below ``root`` by ``fn(module)`` when that is not
    None, children before parents; a module reachable twice is visited once."""
    visited = {root}

    def visit(m: nn.Module) -> None:
        for name, child in list(m.named_children()):
            if child in visited:
                continue
            visited.add(child)
            visit(child)
            new = fn(child)
            if new is not None:
                setattr(m, name, new)

    visit(root)


def auto_wrap(module: nn.Module, policy: Callable, make_unit: Callable[[nn.Module], nn.Module], ignored: set, is_unit,
              ignored_params=frozenset()) -> None:
    """Replace, bottom-up, each child subtree the policy selects with ``make_unit(child)``.

    The root itself is not wrapped here: the caller makes it the outermost unit.
    Ignored modules and ``ignored_params`` do not count towards a subtree's size.
    """

    def numel_free(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters() if not hasattr(p, "_zeroshard_unit") and p not in ignored_params)

    ignored_params = kept_out(ignored, ignored_params)

    def visit(m: nn.Module, only_children: bool) -> tuple[nn.Module, int]:
        if m in ignored:
            return m, 0
        if is_unit(m):
            raise _nested_unit_error(m)
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


# ------------------------------------------------------------------ manual
_CONTEXT: list[tuple[Callable, dict]] = []  # (wrapper_cls, keywords) inside enable_wrap


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable, **wrapper_kwargs: Any):
    """Inside this context, ``wrap(module)`` returns ``wrapper_cls(module, **wrapper_kwargs)``."""
    if _CONTEXT:
        raise NotImplementedError("zeroshard: enable_wrap contexts do not nest. Fix: leave the outer one first.")
    _CONTEXT.append((wrapper_cls, wrapper_kwargs))
    try:
        yield
    finally:
        _CONTEXT.clear()


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Mark ``module`` as a unit: wrapped inside ``enable_wrap`` (its keywords
    updated by ``wrap_overrides``, then by ``module._wrap_overrides``), returned
    unchanged outside."""
    if not _CONTEXT:
        return module
    wrapper_cls, kwargs = _CONTEXT[0]
    return wrapper_cls(module, **{**kwargs, **wrap_overrides, **getattr(module, "_wrap_overrides", {})})


__all__ = ["always_wrap_policy", "size_based_auto_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
           "ModuleWrapPolicy", "CustomPolicy", "enable_wrap", "wrap"]
