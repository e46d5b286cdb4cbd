"""Batched flatten/unflatten copies: optional C++/CUDA extension plus a pure-torch fallback.

ZeRO-3/FSDP role: ``flatten`` builds the FlatParameter from a unit's parameters
(``flat_param.flatten_params``) and the per-dtype buffers that ``sync_module_states``
broadcasts; ``unflatten_into`` copies those broadcast values back into the module, and
``unflatten`` gives the independent per-parameter copies of FULL and SHARDED state
dicts. The FSDP flat gradient needs none of them: autograd writes it through the
parameters' views. ZeRO-1 (``zero1``) flattens its fp32 master and each step's
gradients with ``flatten`` and writes the gathered parameters back with a
:class:`CopyPlan`. Both backends write identical bytes; the extension only makes
many-tensor copies fast (one parallel pass on CPU, one kernel launch on CUDA).

All four functions are raw data movement: no autograd history is recorded, whatever
``requires_grad`` says. Overlapping destination ranges give unspecified results, and so
does a source that views another member's range of flat (the backends copy in different
orders; ``torch.cat(out=flat)`` refuses such aliasing); a
member that partly overlaps its own range of flat raises, as ``copy_`` does (exactly its
own range, a parameter viewing the FlatParameter, is a no-op copy). What the raw copy
cannot take (a conj/neg or zero-tensor flat, subclasses, functorch and functionalize
wrappers, nested or quantized tensors) goes to the pure-torch path whole.

This module is the bottom of zeroshard's import graph: it imports nothing from zeroshard
except the compiled ``zeroshard._C``.
"""

from __future__ import annotations

import importlib.util
import math
import operator
import os
import warnings
from typing import Sequence

import torch
from torch import Tensor

# Not built (ZEROSHARD_NO_BUILD_EXT=1, no compiler, a failed build): the fallback, silently. Asked
# first: `from . import _C` says a missing module as a plain ImportError ("cannot import name
# '_C' from partially initialized module ... circular import"), which read as a broken build.
if importlib.util.find_spec(f"{__package__}._C") is None:
    _C = None
else:
    try:
        from . import _C
    except ImportError as e:  # built but unloadable, e.g. against another torch: rebuild it
        warnings.warn(f"zeroshard._C failed to load ({e}); using the pure-torch fallback")
        _C = None

__all__ = ["ext_backend", "flatten_into", "flatten", "unflatten_into", "unflatten", "CopyPlan"]


def ext_backend(device: torch.device | str | None = None) -> str:
    """Backend used for tensors on ``device`` (default: CPU).

    "cuda" if the CUDA extension is loaded and device is cuda, "cpp" if the C++ extension
    is loaded and device is cpu, else "python" (including devices the extension does not
    serve, e.g. meta). ZEROSHARD_DISABLE_EXT=1 forces "python"; it is read on every call
    so tests can toggle it.
    """
    if _C is None or _disabled():
        return "python"
    if device is None:
        kind = "cpu"
    else:
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return "cpp"
    if kind == "cuda" and _C.has_cuda:
        return "cuda"
    return "python"


# os.environ.get costs ~1.4 us for an absent key (a KeyError raised and caught inside),
# 2% of a CopyPlan replay of 1000 tensors; the encoded dict behind os.environ (which
# setenv/delenv/monkeypatch keep in step) answers the same in a plain lookup.
_ENV = getattr(os.environ, "_data", None)
_DISABLE = "ZEROSHARD_DISABLE_EXT"
if _ENV is not None:
    _DISABLE_KEY, _ONE = os.environ.encodekey(_DISABLE), os.environ.encodevalue("1")


def _disabled() -> bool:
    """ZEROSHARD_DISABLE_EXT=1, read on every call so tests can toggle it."""
    if _ENV is None:
        return os.environ.get(_DISABLE) == "1"
    return _ENV.get(_DISABLE_KEY) == _ONE


def flatten_into(tensors: Sequence[Tensor], offsets: Sequence[int], flat: Tensor) -> Tensor:
    """Copy each tensor (any shape/strides, read in its logical row-major order) into
    ``flat[off:off+numel]``; elements of flat not covered are left untouched. flat is 1-D
    contiguous; all tensors have flat's dtype and device. Returns flat."""
    _check_lengths(tensors, offsets, "tensors")
    # The extension validates in C++: a Python loop over 1000 tensors would cost more
    # than copying them. It declines (False) for tensor subclasses.
    if ext_backend(flat.device) != "python" and _C.flatten_into(tensors, offsets, flat):
        return flat
    _check_flat(flat)
    _check_members(tensors, offsets, flat, "tensors")
    with torch.no_grad():
        _py_scatter(tensors, offsets, flat)
    return flat


def flatten(tensors: Sequence[Tensor], offsets: Sequence[int], total_numel: int) -> Tensor:
    """New 1-D contiguous tensor of ``total_numel`` elements (dtype/device of tensors[0])
    holding each tensor at its offset and zeros everywhere else (padding). With no
    tensors, returns zeros of the default dtype on CPU."""
    _check_lengths(tensors, offsets, "tensors")
    if total_numel < 0:
        raise ValueError(f"zeroshard: total_numel must be >= 0, got {total_numel}")
    if not tensors:
        return torch.zeros(total_numel)
    if ext_backend(tensors[0].device) != "python":
        flat = _C.flatten(tensors, offsets, total_numel)
        if flat is not None:
            return flat
    flat = torch.empty(total_numel, dtype=tensors[0].dtype, device=tensors[0].device)
    _check_members(tensors, offsets, flat, "tensors")
    numels = [t.numel() for t in tensors]
    with torch.no_grad():
        # Only the gaps are zeroed: the copies overwrite everything else anyway.
        covered = 0
        for lo, hi in sorted((o, o + n) for o, n in zip(offsets, numels) if n > 0):
            if lo > covered:
                flat[covered:lo].zero_()
            covered = max(covered, hi)
        if covered < total_numel:
            flat[covered:].zero_()
        start = _packed_start(offsets, numels)
        if start is None:
            _py_scatter(tensors, offsets, flat)
        else:  # back-to-back in list order: one cat (flat is new, so nothing aliases it)
            torch.cat([t.reshape(-1) for t in tensors], out=flat.narrow(0, start, sum(numels)))
    return flat


def unflatten_into(flat: Tensor, offsets: Sequence[int], outs: Sequence[Tensor]) -> None:
    """Copy ``flat[off:off+outs[i].numel()]`` into ``outs[i]`` (which may be
    non-contiguous), filling it in row-major order."""
    _check_lengths(outs, offsets, "outs")
    if ext_backend(flat.device) != "python" and _C.unflatten_into(flat, offsets, outs):
        return
    _check_flat(flat)
    _check_members(outs, offsets, flat, "outs")
    if outs:
        srcs = [flat.narrow(0, o, t.numel()).view(t.shape) for t, o in zip(outs, offsets)]
        with torch.no_grad():
            _copy_all(list(outs), srcs)


def unflatten(flat: Tensor, offsets: Sequence[int], shapes: Sequence[torch.Size]) -> list[Tensor]:
    """New contiguous tensors (copies, never views of flat) of the given shapes, read from
    flat at offsets."""
    _check_lengths(shapes, offsets, "shapes")
    if ext_backend(flat.device) != "python":
        outs = _C.unflatten(flat, offsets, shapes)
        if outs is not None:
            return outs
    _check_flat(flat)
    shapes = [torch.Size(s) for s in shapes]
    numels = []
    for i, (s, o) in enumerate(zip(shapes, offsets)):  # each shape whole before the next, as the extension
        if any(d < 0 for d in s):
            raise ValueError(f"zeroshard: shapes[{i}] has a negative size: {tuple(s)}")
        numels.append(math.prod(s))
        _check_range(i, o, numels[-1], flat.numel(), "shapes")
    start = _packed_start(offsets, numels)
    with torch.no_grad():
        if start is not None:
            parts = torch.split_with_sizes_copy(flat.narrow(0, start, sum(numels)), numels)
            return [p.view(s) for p, s in zip(parts, shapes)]
        return [flat.narrow(0, o, n).view(s).clone() for o, n, s in zip(offsets, numels, shapes)]


class CopyPlan:
    """``flatten_into``/``unflatten_into`` for a FIXED list of tensors, validated once and
    replayed: the copies a caller repeats every step (ZeRO-1's partitions write the
    gathered parameters back with one).

    The one-shot functions pay per tensor and per call to unpack the Python list and to
    check dtype, device, bounds and storage (~30-100 ns a tensor: more than copying a
    4 KB parameter on a GPU). A plan keeps the checked run table (on CUDA: uploaded
    once) and a snapshot of each tensor's storage; a replay only compares the snapshot
    and checks ``flat`` in O(1). A tensor re-pointed (``.data =``, ``set_``), a storage
    resized or freed, or a flat of another dtype/device rebuilds the table with the full
    checks, so a plan is a cache and never copies stale addresses. ``rebuilds`` counts
    the table builds. On CPU each tensor is checked just before it is copied, so a
    replay that finds a change may already have copied the tensors before it; it then
    rebuilds and copies everything, or raises the one-shot call's error. The plan
    holds references to its tensors. One thread at a time.
    """

    def __init__(self, tensors: Sequence[Tensor], offsets: Sequence[int]):
        _check_lengths(tensors, offsets, "tensors")
        self.tensors, self.offsets = list(tensors), [_index(o) for o in offsets]
        self._plan = _C.Plan(self.tensors, self.offsets) if _C is not None else None

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def rebuilds(self) -> int:
        return 0 if self._plan is None else self._plan.rebuilds

    def flatten_into(self, flat: Tensor) -> Tensor:
        """``flatten_into(self.tensors, self.offsets, flat)``."""
        # The plan declines (False) devices the extension does not serve.
        if self._plan is not None and not _disabled() and self._plan.flatten_into(flat):
            return flat
        return flatten_into(self.tensors, self.offsets, flat)

    def unflatten_into(self, flat: Tensor) -> None:
        """``unflatten_into(flat, self.offsets, self.tensors)``."""
        if self._plan is not None and not _disabled() and self._plan.unflatten_into(flat):
            return
        unflatten_into(flat, self.offsets, self.tensors)


# --- pure-torch helpers ------------------------------------------------------------


def _py_scatter(tensors: Sequence[Tensor], offsets: Sequence[int], flat: Tensor) -> None:
    # copy_ (under _foreach_copy_) tolerates a source that already is its destination
    # (params viewing the FlatParameter); cat(out=) would reject that aliasing.
    if tensors:
        dsts = [flat.narrow(0, o, t.numel()).view(t.shape) for t, o in zip(tensors, offsets)]
        _copy_all(dsts, list(tensors))


def _copy_all(dsts: list[Tensor], srcs: list[Tensor]) -> None:
    # _foreach_copy_ is one dispatch for the whole list but rejects conj/neg views.
    if any(t.is_conj() or t.is_neg() for t in dsts + srcs):
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    else:
        if dsts and dsts[0].device.type != "cpu" and dsts[0].is_floating_point():
            # CUDA's foreach copy computes bf16/fp16 in float, which rewrites NaN
            # payloads: copy the same bits as integers so the result is bytewise.
            bits = _SAME_WIDTH_INT[dsts[0].element_size()]
            dsts, srcs = [d.view(bits) for d in dsts], [s.view(bits) for s in srcs]
        torch._foreach_copy_(dsts, srcs)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _packed_start(offsets: Sequence[int], numels: Sequence[int]) -> int | None:
    """offsets[0] if the ranges sit back-to-back in list order, else None."""
    if not offsets:
        return None
    nxt = offsets[0]
    for o, n in zip(offsets, numels):
        if o != nxt:
            return None
        nxt = o + n
    return offsets[0]


def _index(offset) -> int:
    """An offset as the one-shot calls take it: an int or anything with __index__, not a bool."""
    if isinstance(offset, bool):
        raise TypeError(f"zeroshard: offsets must be ints, got {offset!r}")
    return operator.index(offset)


def _check_lengths(items: Sequence, offsets: Sequence[int], what: str) -> None:
    if len(items) != len(offsets):
        raise ValueError(f"zeroshard: got {len(items)} {what} but {len(offsets)} offsets")


def _check_flat(flat: Tensor) -> None:
    if flat.layout != torch.strided or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"zeroshard: flat must be a 1-D contiguous tensor, got sizes {list(flat.shape)} "
            f"strides {list(flat.stride()) if flat.layout == torch.strided else None}"
        )


def _check_members(tensors: Sequence[Tensor], offsets: Sequence[int], flat: Tensor, what: str):
    """Each member in turn, in the extension's order (the first bad member's error, whatever its kind)."""
    for i, (t, o) in enumerate(zip(tensors, offsets)):
        if t.layout != torch.strided:
            raise ValueError(f"zeroshard: {what}[{i}] must be a strided tensor, got {t.layout}")
        if t.dtype != flat.dtype:
            raise ValueError(
                f"zeroshard: {what}[{i}] has dtype {t.dtype} but flat has dtype {flat.dtype}"
            )
        if t.device != flat.device:
            raise ValueError(f"zeroshard: {what}[{i}] is on {t.device} but flat is on {flat.device}")
        _check_range(i, o, t.numel(), flat.numel(), what)
        _check_storage(t, what, i)
        _check_overlap(t, o, flat, what, i)


def _check_storage(t: Tensor, what: str, i: int) -> None:
    """torch's copy_ reads and writes a storage freed with resize_(0) (FSDP's reshard) and
    segfaults: raise the extension's error instead."""
    if not t.numel() or t.device.type == "meta":
        return
    try:
        have = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # no storage of its own (functorch, subclasses)
        return
    reach = (t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
    if reach > have:
        raise RuntimeError(f"zeroshard: {what}[{i}] reaches byte {reach} of a storage of {have} bytes "
                           "(was its storage freed?)")


def _check_overlap(t: Tensor, o: int, flat: Tensor, what: str, i: int) -> None:
    """A dense member in flat's storage is exactly its own range there (a parameter viewing the
    FlatParameter) or apart from it; copy_ refuses a partial overlap only once the copies have
    begun, so it is raised here, in member order, with the extension's words."""
    if not t.numel() or t.device.type == "meta":
        return
    try:
        same = t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage of its own (functorch, subclasses)
        return
    if not same or not _dense(t):
        return
    at, lo, n = flat.storage_offset() + o, t.storage_offset(), t.numel()
    if not (lo >= at + n or at >= lo + n or (lo == at and t.is_contiguous())):
        raise RuntimeError(f"zeroshard: {what}[{i}]: unsupported operation: some elements of the input tensor and the "
                           "written-to tensor refer to a single memory location (it overlaps its own range of flat). "
                           "Fix: clone() it first.")


def _dense(t: Tensor) -> bool:
    """Non-overlapping and dense in some order of its dimensions (ATen's is_non_overlapping_and_dense)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _check_range(i: int, o: int, n: int, flat_numel: int, what: str) -> None:
    if o < 0 or o + n > flat_numel:
        end = o + n if n < 2**63 and o + n < 2**63 else "beyond int64"  # as the extension says it
        raise ValueError(f"zeroshard: {what}[{i}] range [{o}, {end}) is out of bounds for flat of numel {flat_numel}")
