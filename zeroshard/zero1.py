"""ZeRO stage 1: optimizer states sharded; parameters and gradients replicated.

This is the ZeRO paper's P_os (section 5.1) and DeepSpeed's
``zero_optimization.stage = 1``; torch FSDP has no such strategy (its
SHARD_GRAD_OP is stage 2). The model stays an ordinary module on every rank;
what is split is the optimizer:

* per parameter group, one flat fp32 *master* of the group's parameters, laid
  out by ``flat_param.build_layout`` (no alignment padding; the tail padded to
  a multiple of N so that every rank owns an equal chunk); rank r keeps only
  chunk r and the inner ``torch.optim`` optimizer is rebuilt over those chunks,
  so Adam's two moments (8 bytes per parameter) and the fp32 master (4 more
  under fp16/bf16) cost 1/N per rank: 16Ψ -> 4Ψ + 12Ψ/N in mixed precision.

One step at a gradient-accumulation boundary:

1. **reduce** — each rank flattens its locally accumulated ``.grad``s,
   divides by N (DDP's pre-divide, so the sum is the mean) and
   reduce-scatters: rank r receives the summed chunk r. Reduce-scatter rather
   than all-reduce-then-slice: an all-reduce moves 2Ψ(N-1)/N bytes per rank
   and the slice would discard (N-1)/N of what it produced, whereas
   reduce-scatter (Ψ(N-1)/N) plus the parameter all-gather of step 4
   (Ψ(N-1)/N) cost exactly one all-reduce: ZeRO-1 communicates as much as DDP,
   which is the paper's claim.
2. (the engine checks overflow, unscales and clips over the chunks:
   :meth:`clip_grad_norm_` sums squares locally and all-reduces one scalar)
3. **step** — the inner optimizer updates the fp32 master chunk only.
4. **all-gather** — the updated chunks, cast to the model's dtype, are
   gathered into every rank's parameters.

Between boundaries nothing is communicated: gradients accumulate in ``.grad``
as DeepSpeed stage 0/1 do (they are replicated anyway in ZeRO-1, so deferring
the reduction costs no memory).

``process_group=None`` means a single partition: no communication, the whole
fp32 master on this rank. The engine uses that for stage 0 in fp16/bf16 (its
all-reduce sums the low-precision gradients, this keeps the fp32 master weights,
the role of DeepSpeed's FP16_Optimizer).

Checkpoints are in ``zero1_state``.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm, ext
from .agreement import first_mismatch
from .flat_param import FlatLayout, build_layout, changed_elements, shard_of
from .zero1_state import Zero1Checkpoints


class _Partition:
    """One parameter group: its parameters, their flat layout and this rank's master chunk."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int, master_device):
        self.params = params
        entries = [(None, "", str(i), p) for i, p in enumerate(params)]
        self.layout: FlatLayout = build_layout(entries, [], world, rank, align_numel=0)
        self.offsets = [info.offset for info in self.layout.params]
        # Every step writes the updated parameters back from the gathered flat
        # buffer: the same tensors each time, so the copy table is checked once.
        # The plan holds the Parameters themselves (not .detach() aliases), so
        # a later `p.data = ...` is seen and rebuilds it.
        self.write_back = ext.CopyPlan(params, self.offsets)
        # fp32 for fp16/bf16/fp32 parameters (DeepSpeed's master); a float64 or complex
        # group keeps its own dtype: a float32 master would round every step, drop imaginary parts.
        self.dtype = torch.promote_types(params[0].dtype, torch.float32)
        device = master_device or params[0].device
        self.master = nn.Parameter(self.from_params().to(device), requires_grad=True)
        self.note_written()

    def from_params(self) -> torch.Tensor:
        """This rank's chunk of the parameters' current values, in the master's dtype."""
        flat = ext.flatten([p.detach().to(self.dtype) for p in self.params], self.offsets, self.layout.numel)
        return shard_of(flat, self.layout)

    def seen(self) -> list[tuple[int, int]]:
        """Each parameter's version and address: an in-place edit moves the one, ``p.data =`` the other."""
        return [(p._version, p.data_ptr()) for p in self.params]

    def note_written(self) -> None:
        self.written = self.seen()

    def padded(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (layout.numel elements) zero-padded to layout.padded_numel."""
        out = full.new_zeros(self.layout.padded_numel)
        out[: full.numel()].copy_(full)
        return out


def _value_sum(p: torch.Tensor) -> int:
    """A checksum of a parameter's bits: their words summed as integers (modulo 2**64), exact in
    any order, so the same on every rank whatever its thread count (a float sum is not)."""
    b = p.detach().contiguous().reshape(-1).view(torch.uint8)
    word = next(d for n, d in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)) if b.numel() % n == 0)
    return int(b.view(word).sum(dtype=torch.int64))


_SHAPE_AWARE = ("Adafactor", "Muon")  # torch.optim classes whose update depends on a parameter's shape


class ZeroOneOptimizer(Zero1Checkpoints):
    """Shard ``optimizer``'s state over ``process_group`` (ZeRO-1); the master is fp32 for
    fp16/bf16/fp32 parameters, a float64 or complex group's own dtype otherwise.

    ``optimizer`` is a ``torch.optim`` optimizer built over the model's
    parameters and not stepped yet; its param groups are re-pointed, in
    place, at the fp32 master chunks (one per group), so the object, its
    hyperparameters and any LR scheduler bound to it stay valid. Call
    :meth:`reduce_gradients`, then :meth:`step`, then :meth:`zero_grad`
    (the inner optimizer's own ``step()`` raises: its masters have no
    gradient until :meth:`reduce_gradients`); its ``zero_grad()`` clears the model's
    gradients too, and its ``state_dict()`` holds this rank's chunks (see
    ``zero1_state``). ``model`` (optional) names the
    parameters when the ranks' param groups are compared at construction.
    Parameters edited between steps are taken into the master at the next
    :meth:`reduce_gradients` (see :meth:`_take_edits`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, process_group="WORLD", master_device=None, model=None):
        # "WORLD" is resolved now, not as a default argument at import time: importing
        # after init_process_group would pin that group object (and keep it alive forever).
        process_group = dist.group.WORLD if process_group == "WORLD" else process_group
        shaped = [n for n in _SHAPE_AWARE if isinstance(optimizer, getattr(torch.optim, n, ()))]
        if shaped:
            raise ValueError(f"zeroshard: ZeRO-1 steps 1-D chunks of a flat fp32 master, but torch.optim.{shaped[0]} "
                             "depends on each parameter's shape (it would silently change its update, or fail at the "
                             "first step). Fix: use an elementwise optimizer (Adam, AdamW, SGD, ...) or ZeRO stage 0 in fp32.")
        # Adagrad builds its state in __init__ (step 0): made anew below for the masters.
        if any(st.get("step") is None or float(st["step"]) != 0 for st in optimizer.state.values() if st):
            raise ValueError("zeroshard: ZeRO-1 needs an optimizer that has not stepped yet (its state would be "
                             "replicated, not sharded). Fix: pass a freshly built optimizer.")
        prebuilt = bool(optimizer.state)
        self.optimizer = optimizer
        self.group, self.master_device = process_group, master_device
        self.world = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self._model = model
        self._stepping = False
        self._reduced = False  # reduce_gradients() ran since the last step()
        # Whether this rank / any rank had a gradient at the last reduce (see clip_grad_norm_).
        self.had_grads = self.any_grads = True
        self.partitions: list[_Partition | None] = []
        self._left_out: list[nn.Parameter] = []  # frozen when given: never stepped (warned if they get a .grad)
        self._check_same_groups([g["params"] for g in optimizer.param_groups])
        for group in optimizer.param_groups:
            group["params"] = self._partition(group["params"])
        if prebuilt:  # the state of an optimizer that builds it in __init__, made anew for the masters
            optimizer.state.clear()
            try:
                fresh = type(optimizer)([dict(g) for g in optimizer.param_groups], **optimizer.defaults)
            except Exception as e:
                raise ValueError(f"zeroshard: ZeRO-1 could not rebuild the state {type(optimizer).__name__} made in its "
                                 f"__init__ for the fp32 master chunks ({e}). Fix: use an optimizer that builds its "
                                 "state at its first step (Adam, AdamW, SGD, ...).") from e
            optimizer.state.update(fresh.state)
        # optimizer.step() alone would step masters without gradients, a silent no-op (see _only_inside_step).
        optimizer.register_step_pre_hook(self._only_inside_step)
        # A group added later (``optimizer.add_param_group``, e.g. layers unfrozen mid-run, as torch's
        # ZeroRedundancyOptimizer allows) is partitioned too: added plainly, it would step each rank's
        # own unreduced gradients and the replicas would drift apart.
        self._add_to_inner = optimizer.add_param_group
        optimizer.add_param_group = self.add_param_group
        # Its zero_grad() cleared only the masters, so a batch thrown away with it was still trained on.
        optimizer.zero_grad = self.zero_grad
        # Its state_dict() is this rank's chunks only: tagged, so another rank's (a DDP habit: save on
        # rank 0, load everywhere) is refused instead of silently stepping other elements' moments.
        self._inner_state_dict, self._inner_load = optimizer.state_dict, optimizer.load_state_dict
        optimizer.state_dict, optimizer.load_state_dict = self._rank_state_dict, self._load_rank_state_dict

    def add_param_group(self, group: dict) -> None:
        """Add a param group (collective in effect: every rank must add the same one)."""
        params = group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        held = {id(p) for p in self.model_params()}
        if any(id(p) in held for p in params):
            raise ValueError("zeroshard: ZeRO-1 add_param_group: some parameters are already in a param group. "
                             "Fix: add only parameters the optimizer does not hold yet.")
        if any(not p.requires_grad for p in params):
            warnings.warn(f"zeroshard: ZeRO-1 add_param_group: {sum(not p.requires_grad for p in params)} of the group's "
                          "parameters do not require grad and are left out (as at construction): unfrozen later, they "
                          "will not train. Fix: call requires_grad_(True) before add_param_group.", stacklevel=2)
        self._check_same_groups([params], first=len(self.partitions))
        readded = {id(p) for p in params if p.requires_grad}  # unfrozen since construction, as the warning advised
        left_out = [p for p in self._left_out if id(p) not in readded]
        masters = self._partition(params)
        try:
            self._add_to_inner({**group, "params": masters})
        except BaseException:  # refused by torch: no partition without its group
            self.partitions.pop()
            raise
        self._left_out = left_out

    def _only_inside_step(self, optimizer, args, kwargs) -> None:
        if not self._stepping:
            raise RuntimeError("zeroshard: this optimizer's parameters are ZeRO-1's fp32 master chunks, whose gradients "
                               "are filled only by reducing the model's; optimizer.step() alone would step nothing and "
                               "the model's gradients would pile up. Fix: call engine.step() (zeroshard.initialize), or "
                               "ZeroOneOptimizer.reduce_gradients() then .step().")

    def _partition(self, params) -> list:
        """One group's partition (None without trainable parameters): the group's new ``params``."""
        trainable = [p for p in params if p.requires_grad]
        dtypes = sorted({str(p.dtype) for p in trainable})
        if len(dtypes) > 1:
            raise ValueError(f"zeroshard: ZeRO-1 param group {len(self.partitions)} mixes dtypes {dtypes}; its one flat buffer holds one "
                             "dtype. Fix: put the parameters of each dtype in a param group of their own.")
        self._left_out += [p for p in params if not p.requires_grad]
        part = _Partition(trainable, self.world, self.rank, self.master_device) if trainable else None
        self.partitions.append(part)
        return [part.master] if part is not None else []

    def _check_same_groups(self, groups: list, first: int = 0) -> None:
        """Rank r steps chunk r of each group's flat buffer, laid out in the group's order on each rank:
        ranks listing the parameters in other orders (a set's order differs between processes) would
        write each other's values into the wrong parameters. Compares the trainable parameters' names
        (with ``model``), shapes and dtypes, group by group (collective). A parameter without a name
        (no ``model``, or not in it) is compared by a checksum of its values too: same-shape parameters
        (a LayerNorm's weight and bias) swapped would pass a comparison of shapes."""
        if self.world == 1:
            return
        names = {id(p): n for n, p in self._model.named_parameters()} if self._model is not None else {}
        mine = [[(names[id(p)], tuple(p.shape), str(p.dtype)) if id(p) in names
                 else (f"#{i}", tuple(p.shape), str(p.dtype), _value_sum(p))
                 for i, p in enumerate(q for q in params if q.requires_grad)] for params in groups]
        differs = comm.first_difference(mine, self.group, "ZeRO-1 construction (comparing the param groups across ranks)")
        if differs is None:
            return
        r, ours, theirs = differs
        r0 = dist.get_global_rank(self.group, 0)
        if len(ours) != len(theirs):
            raise ValueError(f"zeroshard: ZeRO-1: the optimizer has {len(ours)} param groups on rank {r0} but {len(theirs)} "
                             f"on rank {r}. Fix: build the same optimizer on every rank.")
        gi, a, b = next((gi, a, b) for gi, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        i, x, y = first_mismatch(a, b)
        same_shape = all(isinstance(v, (tuple, list)) and len(v) == 4 for v in (x, y)) and list(x[:3]) == list(y[:3])
        values = "" if not same_shape else (
            " (the same shape, other values: listed in another order, or the ranks' weights differ; build the "
            "optimizer after making them the same, and pass model= to compare names instead)")
        raise ValueError(f"zeroshard: ZeRO-1 param group {first + gi} lists different parameters on different ranks (at "
                         f"position {i}: rank {r0} has {x}, rank {r} has {y}){values}; each rank's chunk of the flat master "
                         "would update other parameters. Fix: build the same model and list each group's parameters in "
                         "the same order on every rank (e.g. from model.named_parameters(), not from a set).")

    def _check_groups(self) -> None:
        if len(self.optimizer.param_groups) != len(self.partitions):
            raise RuntimeError(f"zeroshard: the ZeRO-1 optimizer has {len(self.optimizer.param_groups)} param groups but "
                               f"{len(self.partitions)} were partitioned: a group was added past add_param_group, so its "
                               "gradients would not be reduced across ranks. Fix: call optimizer.add_param_group(...).")

    @property
    def parts(self) -> list[_Partition]:
        return [p for p in self.partitions if p is not None]

    def model_params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.params]

    # ---------------------------------------------------------------- reduce
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum (mean) the accumulated ``.grad``s over ranks into the master chunks' ``.grad``.
        A parameter without ``.grad`` contributes zeros: its elements are still
        stepped with the chunk (as in DeepSpeed; DDP would skip the parameter)."""
        self._check_groups()
        unfrozen = [p for p in self._left_out if p.grad is not None]
        if unfrozen:
            warnings.warn(f"zeroshard: ZeRO-1: {len(unfrozen)} parameter(s) frozen when given to the optimizer now have "
                          "gradients (unfrozen since); they are not in any partition and are not trained (DeepSpeed "
                          "skips them too). Fix: pass them with optimizer.add_param_group(...) after unfreezing.",
                          stacklevel=3)
            self._left_out = [p for p in self._left_out if p.grad is None]  # warned once for these
        self._take_edits()
        pending = []
        self.had_grads = any(p.grad is not None for p in self.model_params())
        for part in self.parts:
            # A sparse gradient (Embedding(sparse=True)) is reduced dense, as at stage 0.
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad
                     for p in part.params]
            flat = ext.flatten(grads, part.offsets, part.layout.padded_numel)
            if self.world > 1:
                flat.div_(self.world)  # as DeepSpeed (x * (1/3) rounds differently from x / 3)
                out = flat.new_empty(part.layout.shard_numel)
                work = comm.reduce_scatter(out, flat, self.group, what="ZeRO-1 gradients")
                pending.append((part, out, work))
            else:
                pending.append((part, flat, None))
        for part, out, work in pending:
            if work is not None:
                work.wait()
            out = out.to(part.master.device, part.dtype)
            # Added, as .grad accumulates: a second reduce before step() (one per micro-batch) kept only the last.
            part.master.grad = out if part.master.grad is None else part.master.grad.add_(out)
            for p in part.params:
                p.grad = None
        self._reduced = True

    def wire_device(self) -> torch.device:
        """Where this optimizer's collectives take their tensors: the parameters' device,
        which the group's backend serves (NCCL: the GPU), not the masters' (the CPU under
        offload_optimizer, which NCCL refuses)."""
        return self.parts[0].params[0].device if self.parts else torch.device("cpu")

    def master_grads(self) -> list[torch.Tensor]:
        return [part.master.grad for part in self.parts if part.master.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the master chunks' gradients by the global norm (padding holds zeros, so it adds nothing).
        The same all-reduce tells every rank whether any rank had a gradient before
        :meth:`reduce_gradients` filled in zeros (``any_grads``: else nothing to step)."""
        grads = self.master_grads()
        device = self.parts[0].master.device if self.parts else torch.device("cpu")
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]  # real, in the masters' precision
        acc = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
        local = (torch.linalg.vector_norm(torch.stack([n.to(acc) for n in norms]), norm_type) if norms
                 else torch.zeros((), device=device))
        inf = norm_type == float("inf")
        had = torch.tensor(float(self.had_grads), dtype=local.dtype, device=device)
        both = torch.stack([local if inf else local**norm_type, had])
        if self.world > 1:
            wire = self.wire_device()
            both = both.to(wire)
            comm.all_reduce(both, self.group, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            what=f"ZeRO-1 clip_grad_norm_ ({'max norm' if inf else 'sum of squares'})")
            both = both.to(device)
        total = both[0] if inf else both[0] ** (1.0 / norm_type)
        self.any_grads = bool(both[1] > 0)
        if max_norm == float("inf"):  # the norm alone
            return total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
        return total

    # ------------------------------------------------------------ step/gather
    @torch.no_grad()
    def step(self) -> None:
        """Step the master chunks, then all-gather them into the parameters."""
        if any(p.grad is not None for p in self.model_params()) and not self._reduced:
            # (master gradients kept from the last step, without zero_grad, would be stepped again)
            raise RuntimeError("zeroshard: ZeRO-1 step() before reduce_gradients(): the model's gradients are not in "
                               "the master chunks, so nothing would be stepped. Fix: call reduce_gradients() first.")
        self._stepping = True
        try:
            self.optimizer.step()
        finally:
            self._stepping = False
        self._reduced = False
        pending = []
        for part in self.parts:
            dtype, device = part.params[0].dtype, part.params[0].device
            src = part.master.detach().to(device, dtype)
            if self.world > 1:
                full = torch.empty(part.layout.padded_numel, dtype=dtype, device=device)
                pending.append((part, full, comm.all_gather(full, src.contiguous(), self.group, what="ZeRO-1 updated parameters")))
            else:
                pending.append((part, src, None))
        for part, full, work in pending:
            if work is not None:
                work.wait()
            self._write_params(part, full)

    @staticmethod
    def _write_params(part: _Partition, full: torch.Tensor) -> None:
        part.write_back.unflatten_into(full.to(part.params[0].device, part.params[0].dtype))  # offload: a CPU master
        part.note_written()

    @torch.no_grad()
    def _take_edits(self) -> None:
        """Edits made to the parameters since the last write-back (pruning, clamping, a load of
        model weights) reach this rank's master chunk, else the next step would overwrite them.
        Only the elements that differ from the master in the parameters' dtype are taken, so a
        bf16 model's untouched weights keep their fp32 master bits. Every rank must make the same
        edit: each takes it into its own chunk only."""
        for part in self.parts:
            if part.written == part.seen():
                continue
            now = shard_of(ext.flatten([p.detach() for p in part.params], part.offsets, part.layout.numel), part.layout)
            now, master = now.to(part.master.device), part.master.detach()
            changed = changed_elements(now, master.to(now.dtype))
            master.copy_(torch.where(changed, now.to(master.dtype), master))
            part.note_written()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = False  # what a reduce put in the masters is gone: step() needs another
        for part in self.parts:
            part.master.grad = None
            for p in part.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Rebuild the master chunks from the parameters (after loading model weights only)."""
        for part in self.parts:
            part.master.data.copy_(part.from_params())
            part.note_written()
