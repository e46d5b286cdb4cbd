"""The FlatParameter: one wrapped unit's parameters as a single 1-D buffer.

ZeRO-3 shards each unit's parameters as *one* flat buffer so that a unit costs
one all-gather and one reduce-scatter, whatever its number of tensors. This
module computes the layout of that buffer, exactly as torch FSDP1 does so that
shards, gradients and optimizer states line up element for element:

* Parameters are laid out in ``module.named_modules()`` order; a parameter
  reached twice (tied weights) is stored once and the second name becomes an
  alias of the first.
* With ``use_orig_params=True`` every parameter starts on a 16-byte boundary
  (padding holding torch's marker value 42 is inserted between parameters, and
  the total is padded with it to a multiple of the world size), because the original parameters become views
  into the buffer and the optimizer must be able to step them in place.
* With ``use_orig_params=False`` there is no alignment padding; only the last
  shard is padded (see :class:`FlatLayout`).
* A parameter stored in a permuted order (a transposed matrix, a channels_last
  convolution weight) is flattened in its memory order and its views keep its
  strides (``as_strided``), so kernels see the layout they would see unwrapped.

Rank r keeps the r-th contiguous chunk of ``ceil(numel / N)`` elements.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import ext


@dataclass(frozen=True)
class ParamInfo:
    """Where one original parameter lives: its module, attribute and flat slice."""

    module: nn.Module
    name: str
    fqn: str  # relative to the wrapped module
    shape: torch.Size
    offset: int  # first element in the unsharded flat buffer
    numel: int
    stride: tuple | None = None  # a permuted-dense parameter's stride (transposed, channels_last); None: contiguous

    def unflat(self, segment: torch.Tensor) -> torch.Tensor:
        """The parameter's view of its 1-D ``segment`` of a flat buffer, with its own memory layout."""
        return segment.view(self.shape) if self.stride is None else segment.as_strided(self.shape, self.stride)

    def flat_of(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (this parameter's shape) as the 1-D segment its flat buffer holds."""
        if self.stride is None:
            return value.reshape(-1)
        segment = value.new_empty(self.numel)
        self.unflat(segment).copy_(value)
        return segment


@dataclass(frozen=True)
class SharedParamInfo:
    """A second name for a parameter already stored (tied weights)."""

    module: nn.Module
    name: str
    fqn: str
    prim_index: int  # index into FlatLayout.params


@dataclass(frozen=True)
class ShardSlice:
    """The part of one parameter that falls inside this rank's shard."""

    offset_in_shard: int
    numel_in_shard: int
    offset_in_param: int


class FlatLayout:
    """Layout of one unit's flat buffer and of this rank's shard of it."""

    def __init__(self, params, shared, numel: int, world_size: int, rank: int):
        self.params: list[ParamInfo] = params
        self.shared: list[SharedParamInfo] = shared
        self.numel = numel  # unsharded flat numel, alignment padding included
        self.world_size = world_size
        self.rank = rank
        # torch.chunk semantics: every shard has ceil(numel / N) elements; the
        # tail is zero-padded so all ranks all-gather equal-sized chunks.
        self.shard_numel = -(-numel // world_size)
        self.padded_numel = self.shard_numel * world_size
        self.shard_start = min(rank * self.shard_numel, numel)
        self.shard_end = min((rank + 1) * self.shard_numel, numel)
        self.shard_slices: list[ShardSlice | None] = [self.slice_on(p, rank) for p in params]

    def slice_on(self, p: ParamInfo, rank: int) -> ShardSlice | None:
        """The part of ``p`` in ``rank``'s shard (None: none of it)."""
        if p.numel == 0:
            # torch's rule (inclusive ranges): in the one shard that holds elements on both sides of its offset, where
            # it gets an empty .grad (and so optimizer state); padding counts, the shard is not clipped to numel.
            start = rank * self.shard_numel
            inside = start <= p.offset - 1 and start + self.shard_numel - 1 >= p.offset
            return ShardSlice(p.offset - start, 0, 0) if inside else None
        start = min(rank * self.shard_numel, self.numel)
        lo, hi = max(p.offset, start), min(p.offset + p.numel, (rank + 1) * self.shard_numel, self.numel)
        if lo >= hi:
            return None
        return ShardSlice(lo - start, hi - lo, lo - p.offset)

    def shard_padding(self) -> list[tuple[int, int]]:
        """(start, end) ranges of this rank's shard that hold no parameter (gaps and tail)."""
        spans = sorted((sl.offset_in_shard, sl.offset_in_shard + sl.numel_in_shard) for sl in self.shard_slices if sl)
        gaps, pos = [], 0
        for start, end in [*spans, (self.shard_numel, self.shard_numel)]:
            if start > pos:
                gaps.append((pos, start))
            pos = max(pos, end)
        return gaps

    @property
    def split_sizes(self) -> list[int]:
        """Sizes that split the flat buffer into [pad, param, pad, param, ..., pad]."""
        sizes, pos = [], 0
        for p in self.params:
            sizes += [p.offset - pos, p.numel]
            pos = p.offset + p.numel
        return sizes + [self.numel - pos]

    @property
    def fqns(self) -> list[str]:
        return [p.fqn for p in self.params]


class FreedView(torch.Tensor):
    """What a module's parameter attribute holds while its unit is sharded
    (``use_orig_params=False``): between steps, and between forward and
    backward under FULL_SHARD / HYBRID_SHARD. torch FSDP1 leaves a view of the
    freed full buffer there, so reading it reads freed memory (a segfault on
    CPU, garbage on GPU). This placeholder answers every question about the
    parameter's layout as that view would (shape, strides, dtype, device,
    requires_grad, ...), so the module still prints and introspects, but
    computing with it raises, naming the parameter and the fix. No memory is
    held: its data lives on the meta device."""

    # Answered by the meta-device data: layout only, never values.
    _LAYOUT = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,
               torch.Tensor.layout.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad.__get__,
               torch.Tensor.grad_fn.__get__, torch.Tensor.is_nested.__get__, torch.Tensor.is_sparse.__get__,
               torch.Tensor.is_quantized.__get__, torch.Tensor.nbytes.__get__, torch.Tensor.itemsize.__get__,
               torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim, torch.Tensor.numel,
               torch.Tensor.element_size, torch.Tensor.is_contiguous, torch.Tensor.is_floating_point,
               torch.Tensor.is_complex, torch.Tensor.storage_offset, torch.Tensor.__len__, torch.Tensor.__hash__}
    # Answered for the parameter's real device, and its unit's current requires_grad.
    _ANSWERS = {torch.Tensor.device.__get__: lambda t: t._device,
                torch.Tensor.is_meta.__get__: lambda t: False,
                torch.Tensor.is_cpu.__get__: lambda t: t._device.type == "cpu",
                torch.Tensor.is_cuda.__get__: lambda t: t._device.type == "cuda",
                torch.Tensor.requires_grad.__get__: lambda t: t._handle().flat_param.requires_grad}

    @staticmethod
    def __new__(cls, shape, stride, dtype: torch.dtype, device, fqn: str, handle):
        stride = stride or torch.empty(shape, device="meta").stride()
        t = torch.Tensor._make_subclass(cls, torch.empty_strided(shape, stride, dtype=dtype, device="meta"))
        t._device, t._fqn, t._handle = torch.device(device), fqn, weakref.ref(handle)  # unit names settle at lazy init
        return t

    @property
    def _where(self) -> str:
        handle = self._handle()
        return f"'{self._fqn}' of unit '{getattr(handle, 'unit_name', '?')}'"

    def __init__(self, *args):
        pass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._ANSWERS:
            return cls._ANSWERS[func](args[0])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # its name (a cast, given a dtype, raises)
            name, device = torch.empty(0, dtype=args[0].dtype).type(), args[0]._device.type
            return name if device == "cpu" else name.replace("torch.", f"torch.{device}.", 1)
        if func in cls._LAYOUT:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        freed = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, FreedView))
        if torch._C._current_graph_task_id() != -1:  # read during backward: a recomputation after the reshard
            raise RuntimeError(
                f"zeroshard: {freed._where} was read during backward, after its unit resharded (use_orig_params=False): "
                "a reentrant activation checkpoint recomputed after the unit's own backward was done (a region around "
                "part of a unit, or a checkpointed unit run twice before one backward; torch FSDP1 fails here too). "
                "Fix: checkpoint with use_reentrant=False, or checkpoint each whole unit once per backward "
                "(checkpoint_wrapper around or inside it).")
        raise RuntimeError(
            f"zeroshard: {freed._where} holds only this rank's shard right now (use_orig_params=False "
            "frees the full parameters outside the unit's forward and backward, and off rank 0 inside "
            "summon_full_params(rank0_only=True)); its values cannot be read or written here (torch FSDP1 "
            "would read freed memory). Fix: use it inside `with FullyShardedDataParallel.summon_full_params(model):` "
            "(on rank 0 only with rank0_only=True), or wrap with use_orig_params=True.")

    def __repr__(self, **kwargs):
        return f"FreedView({tuple(self.shape)}, dtype={self.dtype}: {self._where}, sharded)"

    def __deepcopy__(self, memo):
        return FreedView(self.shape, self.stride(), self.dtype, self._device, self._fqn, self._handle())

    def __reduce_ex__(self, protocol):  # torch.save(model) / pickle of a wrapped model reaches it first
        raise TypeError(f"zeroshard: {self._where} is part of a wrapped model, which cannot be pickled or saved whole "
                        "(it holds a process group and this rank's shards; torch FSDP1's cannot be either). Fix: save "
                        "its state_dict() (FULL_STATE_DICT, or SHARDED with zeroshard.checkpoint.save_sharded), or "
                        "pickle / deep-copy the module before wrapping it.")


def kept_out(ignored_modules, ignored_params) -> set:
    """The parameters no FlatParameter may take: ``ignored_params`` plus every
    parameter of an ignored module, by identity (also where a managed module
    uses it too), as torch FSDP1 decides."""
    return set(ignored_params) | {p for m in ignored_modules for p in m.parameters()}


def collect_params(root: nn.Module, skip: set[nn.Module], ignored_params=frozenset()):
    """The (module, name, fqn, param) entries a unit rooted at ``root`` owns.

    Modules in ``skip`` (nested units, ignored modules) are not entered: their
    parameters belong elsewhere; ``ignored_params`` (``ignored_states``) stay
    ordinary parameters of their modules. Order is ``named_modules()`` order, which is
    the order torch FSDP1 flattens in. Returns (entries, aliases) where an
    alias is a repeated reference to an entry's parameter.
    """
    entries, aliases, seen, visited = [], [], {}, set()

    def visit(module: nn.Module, prefix: str):
        if module in visited:  # one module object under two names: its first path owns it (named_modules' rule)
            return
        visited.add(module)
        for name, param in module._parameters.items():
            if param is None or param in ignored_params:
                continue
            fqn = prefix + name
            if param in seen:
                aliases.append((module, name, fqn, seen[param]))
            else:
                seen[param] = len(entries)
                entries.append((module, name, fqn, param))
        for cname, child in module._modules.items():
            if child is not None and child not in skip:
                visit(child, f"{prefix}{cname}.")

    visit(root, "")
    return entries, aliases


def build_layout(entries, aliases, world_size: int, rank: int, align_numel: int) -> FlatLayout:
    """Place ``entries`` in a flat buffer; ``align_numel`` > 0 aligns each start."""
    params, pos = [], 0
    for module, name, fqn, param in entries:
        if align_numel and pos % align_numel:
            pos += align_numel - pos % align_numel
        params.append(ParamInfo(module, name, fqn, param.shape, pos, param.numel(), dense_stride(param)))
        pos += param.numel()
    if align_numel and pos % world_size:
        pos += world_size - pos % world_size
    shared = [SharedParamInfo(m, n, f, i) for m, n, f, i in aliases]
    return FlatLayout(params, shared, pos, world_size, rank)


def dense_stride(t: torch.Tensor) -> tuple | None:
    """``t``'s strides when it is dense but not contiguous (a permutation of a
    contiguous layout), else None: a contiguous tensor, or one with gaps or
    overlaps, whose values are then laid out (and viewed) in logical order."""
    if t.dim() == 0 or (t.is_contiguous() and t.stride(-1) == 1):
        return None
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return None
        expected *= size
    return tuple(t.stride())


PADDING_VALUE = 42  # torch FSDP1's marker in alignment padding: never computed with, seen in LOCAL state dicts


def flatten_params(layout: FlatLayout, tensors, padding_value: float = 0) -> torch.Tensor:
    """The unsharded flat buffer holding ``tensors`` at their offsets (each in its memory
    order: see ``dense_stride``), ``padding_value`` between them and after the last."""
    flat = [t.detach() if p.stride is None else t.detach().as_strided((p.numel,), (1,)) for p, t in zip(layout.params, tensors)]
    out = ext.flatten(flat, [p.offset for p in layout.params], layout.numel)
    if padding_value:
        for gap in out.split(layout.split_sizes)[::2]:  # [pad, param, pad, ..., pad]
            gap.fill_(padding_value)
    return out


def changed_elements(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Where ``new`` differs from ``old`` (same dtype), NaN counting as equal to NaN: the
    elements an edit of a parameter wrote, to be taken into the higher-precision copy
    behind it (the FlatParameter's shard, ZeRO-1's master) without touching the rest."""
    return (new != old) & ~(new.isnan() & old.isnan())


def shard_of(flat: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
    """A fresh copy of this rank's chunk of ``flat``, zero-padded to ``shard_numel``."""
    shard = flat.new_zeros(layout.shard_numel)
    n = layout.shard_end - layout.shard_start
    if n > 0:
        shard[:n].copy_(flat[layout.shard_start : layout.shard_end])
    return shard


class FlatParameter(nn.Parameter):
    """The parameter the optimizer sees for a unit when ``use_orig_params=False``.

    Between uses its data is this rank's shard; while the unit runs it is the
    unsharded buffer (``.data`` is swapped, the Python object stays, so the
    optimizer and autograd keep one identity).
    """

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True):
        return torch.Tensor._make_subclass(cls, data, requires_grad)
