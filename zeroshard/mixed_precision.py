"""Mixed precision around the ZeRO lifecycle: what is cast, and when.

``MixedPrecision`` (options) names three dtypes. The FlatParameter's copies
are cast where they are made: ``handle.unshard`` casts the shard to
``param_dtype`` before the all-gather, ``reduce.start_reduction`` casts the
gradient to ``reduce_dtype`` before the collective and ``reduce._accumulate``
casts the reduced gradient back to the parameter dtype. This module holds the
two casts that happen outside a FlatParameter, as torch FSDP1 does them:

* buffers are cast once, at the root's lazy init, to the ``buffer_dtype`` of
  the innermost unit holding them (their original dtype is remembered so that
  state dicts can return it);
* forward inputs: the root's are moved to the compute device (their
  containers rebuilt as torch FSDP1 rebuilds them) and cast to ``param_dtype``
  with ``cast_root_forward_inputs``; a unit with parameters of its own casts
  its inputs with ``cast_forward_inputs``;
* ``FSDP_USE_FULL_PREC_IN_EVAL=1`` (read at wrap time, as torch FSDP1 does):
  a unit in eval mode drops mixed precision: it gathers, computes and reduces
  in the parameters' dtype, its inputs are not cast, and the buffers are back
  in their original dtype until the model trains again;
* modules kept out of mixed precision (``_module_classes_to_ignore``, e.g.
  BatchNorm, see ``wrap``) get their inputs cast to fp32 and their outputs
  back to the input's dtype.

``map_tensors`` and ``tensors_in`` walk forward inputs and outputs through the
containers torch FSDP1 looks into (the hooks find the outputs' tensors with it).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
from torch.nn.utils.rnn import PackedSequence


CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper; its hooks drop it from keys
ORIG_DTYPES = "_zeroshard_buffer_orig_dtypes"  # on a module: {buffer name: dtype before buffer_dtype}


def cast_buffers(states):
    """Cast floating buffers to their unit's ``buffer_dtype`` (innermost unit
    wins; ``states`` are the units in module order, root first). Buffers of a
    unit's ignored modules are left alone, by it and by the units around it.
    The original dtype is remembered by module and buffer name (torch FSDP1
    keeps it by name too), so a buffer the module reassigns in forward
    (``self.ema = self.ema * 0.9 + ...``) still gets it back."""
    ignored, done = set(), {}  # done: id(buffer) -> its original dtype if cast, else None
    for s in reversed(states):
        ignored |= {id(b) for m in s._ignored_modules for b in m.buffers(recurse=False)}
        dtype = s.mixed_precision.buffer_dtype
        for m in s.modules():
            for name, buf in m._buffers.items():
                if buf is None or id(buf) in ignored:
                    continue
                if id(buf) not in done:
                    cast = dtype is not None and torch.is_floating_point(buf) and buf.dtype != dtype
                    done[id(buf)] = buf.dtype if cast else None
                    if cast:
                        buf.data = buf.to(dtype)
                if done[id(buf)] is not None:  # also under a second name of a shared buffer
                    m.__dict__.setdefault(ORIG_DTYPES, {})[name] = done[id(buf)]


def remember_buffer_dtypes(root) -> None:
    """While the buffers are in their original dtypes (an eval under ``FSDP_USE_FULL_PREC_IN_EVAL``),
    a ``module.to(dtype)`` gave them new ones: remember those, for state dicts and the way back."""
    for m in root.modules():
        dtypes = m.__dict__.get(ORIG_DTYPES, {})
        for name in dtypes:
            buf = m._buffers.get(name)
            if buf is not None and torch.is_floating_point(buf):
                dtypes[name] = buf.dtype


def orig_buffer_dtypes(root, units, prefix: str = "") -> dict[str, torch.dtype]:
    """State-dict key (as ``nn.Module.state_dict(root, prefix=prefix)`` writes it)
    -> original dtype, for the buffers ``cast_buffers`` cast in ``units``' subtrees."""
    inside = {id(m) for u in units for m in u.modules()}
    out = {}
    for path, m in root.named_modules(remove_duplicate=False):
        if id(m) in inside:
            for name, dtype in m.__dict__.get(ORIG_DTYPES, {}).items():
                key = prefix + (path + "." if path else "") + name
                # An activation-checkpointing wrapper's state-dict hook drops its prefix from the keys.
                out[key.replace(CHECKPOINT_PREFIX, "")] = dtype
    return out


def buffers_for_mode(root, states):
    """``FSDP_USE_FULL_PREC_IN_EVAL=1``, at the root's pre-forward: while the
    root (or, if it has no parameters, any unit) computes in full precision,
    every buffer is back in its original dtype; on the way back to training
    they are cast down again (torch FSDP1's rule)."""
    # The root decides, unless it has no parameters or none in mixed precision (an integer root unit).
    mixed = root._handle is not None and root._handle.dtype.is_floating_point
    handles = [root._handle] if mixed else [s._handle for s in states if s._handle is not None]
    if any(h.forced_full_precision for h in handles):
        for m in root.modules():
            for name, orig in m.__dict__.get(ORIG_DTYPES, {}).items():
                buf = m._buffers.get(name)
                if buf is not None and torch.is_floating_point(buf) and buf.dtype != orig:
                    buf.data = buf.to(orig)
        root._buffers_in_full_precision = True
    elif root.__dict__.get("_buffers_in_full_precision"):
        cast_buffers(states)
        root._buffers_in_full_precision = False


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def map_tensors(fn, obj):
    """``fn`` applied to every tensor in forward inputs (or outputs), through the
    containers torch FSDP1 looks into and rebuilt as it rebuilds them:
    dataclasses (every field), OrderedDicts (their class), other dicts (plain
    dicts), namedtuples, and lists / tuples / sets (their class). A
    PackedSequence passes unchanged: ``fn`` sees its data, but torch does not
    cast it, so neither does zeroshard."""
    if torch.is_tensor(obj):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        frozen = [f.name for f in fields if not f.init]
        if frozen:
            raise ValueError(f"zeroshard: cannot cast the forward input {type(obj).__name__}: its field '{frozen[0]}' is "
                             "declared init=False, so dataclasses.replace cannot rebuild it (torch FSDP1 fails the "
                             "same way). Fix: make the field init=True, pass its tensors separately, or turn off "
                             "cast_forward_inputs / cast_root_forward_inputs in MixedPrecision.")
        return dataclasses.replace(obj, **{f.name: map_tensors(fn, getattr(obj, f.name)) for f in fields})
    if isinstance(obj, OrderedDict):
        out = type(obj)()
        for k, v in obj.items():
            out[k] = map_tensors(fn, v)
        return out
    if isinstance(obj, PackedSequence):
        map_tensors(fn, obj.data)
        return obj
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if _is_namedtuple(obj):
        return type(obj)(*(map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple, set)):
        return type(obj)(map_tensors(fn, o) for o in obj)
    return obj


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor in a forward output, looking where torch FSDP1 looks:
    dataclass fields, dict values (subclasses too), list / tuple / set items
    (namedtuples too) and a PackedSequence's data. Missing one would leave its
    unit without a pre-backward, so its gradients would silently not reduce."""
    if torch.is_tensor(obj):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, PackedSequence):
        items = [obj.data]
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    else:
        return []
    return [t for item in items for t in tensors_in(item)]


def cast_floats(obj, dtype: torch.dtype | None):
    """Forward inputs with every floating tensor cast to ``dtype`` (None: as they are)."""
    if dtype is None:
        return obj
    return map_tensors(lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t, obj)


def root_inputs(obj, device: torch.device):
    """The root's forward inputs as torch FSDP1 passes them on (its
    ``_to_kwargs``): tensors and PackedSequences moved to the compute device,
    and every non-empty tuple, list and dict rebuilt on the way, so the module
    never sees the caller's own list. A tuple or list subclass (torch.Size too)
    becomes a plain tuple or list; a namedtuple keeps its class, a dict its
    class too (rebuilt from its items, keys included). Sets, dataclasses and
    other objects pass as they are."""
    if isinstance(obj, PackedSequence) or torch.is_tensor(obj):
        here = obj.data.device if isinstance(obj, PackedSequence) else obj.device
        return obj if here == device else obj.to(device)
    if _is_namedtuple(obj):
        return type(obj)(*(root_inputs(o, device) for o in obj))
    if isinstance(obj, tuple) and obj:
        return tuple(root_inputs(o, device) for o in obj)
    if isinstance(obj, list) and obj:
        return [root_inputs(o, device) for o in obj]
    if isinstance(obj, dict) and obj:
        return type(obj)(tuple((root_inputs(k, device), root_inputs(v, device)) for k, v in obj.items()))
    return obj


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
        return map_tensors(lambda t: cast(torch.float32, t), args)

    def post(_, args, output):
        dtype = getattr(module, "_zeroshard_input_dtype", None)
        return None if dtype is None else map_tensors(lambda t: cast(dtype, t), output)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
