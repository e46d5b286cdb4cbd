"""Mixed precision around the ZeRO lifecycle: what is cast, and when.

``MixedPrecision`` (options) names three dtypes. The FlatParameter's copies
are cast where they are made (``handle``: ``param_dtype`` for the gathered
buffer, ``reduce_dtype`` for the gradient before reduce-scatter); this module
holds the two casts that happen outside a FlatParameter, as torch FSDP1 does
them:

* buffers are cast once, at the root's lazy init, to the ``buffer_dtype`` of
  the innermost unit holding them (their original dtype is remembered so that
  state dicts can return it);
* forward inputs are cast to ``param_dtype`` (``cast_forward_inputs``, or
  ``cast_root_forward_inputs`` at the root) and moved to the compute device;
* modules kept out of mixed precision (``_module_classes_to_ignore``, e.g.
  BatchNorm, see ``wrap``) get their inputs cast to fp32 and their outputs
  back to the input's dtype.
"""
from __future__ import annotations

import dataclasses

import torch


def cast_buffers(states):
    """Cast floating buffers to their unit's ``buffer_dtype`` (innermost unit
    wins; ``states`` are the units in module order, root first)."""
    seen = set()
    for s in reversed(states):
        dtype = s.mixed_precision.buffer_dtype
        for buf in s.buffers():
            if id(buf) in seen:
                continue
            seen.add(id(buf))
            if dtype is not None and torch.is_floating_point(buf) and buf.dtype != dtype:
                buf._zeroshard_orig_dtype = buf.dtype
                buf.data = buf.to(dtype)


def _map_tensors(obj, fn):
    """Apply ``fn`` to every tensor in nested lists, tuples and dicts of forward inputs."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):  # OrderedDict stays an OrderedDict
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def cast_floats(obj, dtype: torch.dtype):
    """Forward inputs with every floating tensor cast to ``dtype``."""
    return _map_tensors(obj, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)


def to_device(obj, device: torch.device):
    """Forward inputs with every tensor moved to the compute device."""
    return _map_tensors(obj, lambda t: t.to(device, non_blocking=True))


def run_in_fp32(module) -> None:
    """Hooks that run ``module`` in fp32 inside a low-precision model: floating
    positional inputs are cast to fp32, and floating outputs back to the dtype
    the inputs had (remembered from the last call that cast one; torch FSDP1's
    rule). Appended after the module's other hooks."""

    def cast(dtype, t):
        if not torch.is_floating_point(t) or t.dtype == dtype:
            return t
        module._zeroshard_input_dtype = t.dtype
        return t.to(dtype)

    def pre(_, args):
        return _map_tensors(args, lambda t: cast(torch.float32, t))

    def post(_, args, output):
        dtype = getattr(module, "_zeroshard_input_dtype", None)
        return None if dtype is None else _map_tensors(output, lambda t: cast(dtype, t))

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
