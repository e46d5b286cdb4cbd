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

Checkpoints (:meth:`state_dict`) gather each group's master and per-element
optimizer states into full flat tensors, so they reload at any world size.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm, ext
from .flat_param import FlatLayout, build_layout, shard_of


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
        flat = ext.flatten([p.detach().float() for p in params], self.offsets, self.layout.numel)
        device = master_device or params[0].device
        self.master = nn.Parameter(shard_of(flat, self.layout).to(device), requires_grad=True)

    def padded(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (layout.numel elements) zero-padded to layout.padded_numel."""
        out = full.new_zeros(self.layout.padded_numel)
        out[: full.numel()].copy_(full)
        return out


class ZeroOneOptimizer:
    """Shard ``optimizer``'s state over ``process_group`` (ZeRO-1).

    ``optimizer`` is a ``torch.optim`` optimizer built over the model's
    parameters and not stepped yet; its param groups are re-pointed, in
    place, at the fp32 master chunks (one per group), so the object, its
    hyperparameters and any LR scheduler bound to it stay valid. Call
    :meth:`reduce_gradients`, then :meth:`step`, then :meth:`zero_grad`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, process_group="WORLD", master_device=None):
        # "WORLD" is resolved now, not as a default argument at import time: importing
        # after init_process_group would pin that group object (and keep it alive forever).
        process_group = dist.group.WORLD if process_group == "WORLD" else process_group
        if any(optimizer.state.values()):
            raise ValueError("zeroshard: ZeRO-1 needs an optimizer that has not stepped yet (its state would be "
                             "replicated, not sharded). Fix: pass a freshly built optimizer.")
        self.optimizer = optimizer
        self.group, self.master_device = process_group, master_device
        self.world = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        # Whether this rank / any rank had a gradient at the last reduce (see clip_grad_norm_).
        self.had_grads = self.any_grads = True
        self.partitions: list[_Partition | None] = []
        self._left_out: list[nn.Parameter] = []  # frozen when given: never stepped (warned if they get a .grad)
        for group in optimizer.param_groups:
            group["params"] = self._partition(group["params"])
        # A group added later (``optimizer.add_param_group``, e.g. layers unfrozen mid-run, as torch's
        # ZeroRedundancyOptimizer allows) is partitioned too: added plainly, it would step each rank's
        # own unreduced gradients and the replicas would drift apart.
        self._add_to_inner = optimizer.add_param_group
        optimizer.add_param_group = self.add_param_group

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
        masters = self._partition(params)
        try:
            self._add_to_inner({**group, "params": masters})
        except BaseException:  # refused by torch: no partition without its group
            self.partitions.pop()
            raise

    def _partition(self, params) -> list:
        """One group's partition (None without trainable parameters): the group's new ``params``."""
        trainable = [p for p in params if p.requires_grad]
        self._left_out += [p for p in params if not p.requires_grad]
        part = _Partition(trainable, self.world, self.rank, self.master_device) if trainable else None
        self.partitions.append(part)
        return [part.master] if part is not None else []

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
        pending = []
        self.had_grads = any(p.grad is not None for p in self.model_params())
        for part in self.parts:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in part.params]
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
            part.master.grad = out.to(part.master.device, torch.float32)
            for p in part.params:
                p.grad = None

    def master_grads(self) -> list[torch.Tensor]:
        return [part.master.grad for part in self.parts if part.master.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the master chunks' gradients by the global norm (padding holds zeros, so it adds nothing).
        The same all-reduce tells every rank whether any rank had a gradient before
        :meth:`reduce_gradients` filled in zeros (``any_grads``: else nothing to step)."""
        grads = self.master_grads()
        device = self.parts[0].master.device if self.parts else torch.device("cpu")
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
        local = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=device)
        inf = norm_type == float("inf")
        both = torch.stack([local if inf else local**norm_type, torch.tensor(float(self.had_grads), device=device)])
        if self.world > 1:
            comm.all_reduce(both, self.group, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            what=f"ZeRO-1 clip_grad_norm_ ({'max norm' if inf else 'sum of squares'})")
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
        self.optimizer.step()
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
        part.write_back.unflatten_into(full.to(part.params[0].dtype))

    def zero_grad(self) -> None:
        for part in self.parts:
            part.master.grad = None
            for p in part.params:
                p.grad = None

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Rebuild the master chunks from the parameters (after loading model weights only)."""
        for part in self.parts:
            flat = ext.flatten([p.detach().float() for p in part.params], part.offsets, part.layout.numel)
            part.master.data.copy_(shard_of(flat, part.layout).to(part.master.device))

    # ------------------------------------------------------------ checkpoints
    def _full(self, part: _Partition, shard: torch.Tensor) -> torch.Tensor:
        """The whole flat tensor (padding dropped) from every rank's chunk (collective)."""
        if self.world == 1:
            return shard.detach().clone()[: part.layout.numel]
        full = torch.empty(part.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather(full, shard.detach().contiguous(), self.group, async_op=False, what="ZeRO-1 checkpoint gather")
        return full[: part.layout.numel].clone()

    def state_dict(self) -> dict:
        """World-size independent: full flat masters and states per group (collective: call on every rank)."""
        inner = self.optimizer.state_dict()
        groups = []
        for part in self.partitions:
            if part is None:
                groups.append(None)
                continue
            st = self.optimizer.state.get(part.master, {})
            state = {k: self._full(part, v) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in st.items()}
            groups.append({"numel": part.layout.numel, "master": self._full(part, part.master), "state": state})
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        return {"groups": groups, "param_groups": hparams}

    def check_state_dict(self, sd: dict) -> None:
        """Raise, changing nothing, if :meth:`load_state_dict` could not take ``sd``."""
        if len(sd["groups"]) != len(self.partitions):
            raise ValueError(f"zeroshard: the ZeRO-1 checkpoint has {len(sd['groups'])} param groups but the optimizer has "
                             f"{len(self.partitions)}. Fix: build the optimizer with the param groups used when saving.")
        for gi, (part, saved) in enumerate(zip(self.partitions, sd["groups"])):
            if part is not None and (saved is None or saved["numel"] != part.layout.numel):
                got = None if saved is None else saved["numel"]
                raise ValueError(f"zeroshard: param group {gi} of the ZeRO-1 checkpoint holds {got} elements but this "
                                 f"model's group has {part.layout.numel}. Fix: load a checkpoint of the same model.")

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Cut a :meth:`state_dict` (saved at any world size) into this rank's chunks."""
        self.check_state_dict(sd)  # before the first group is written
        state, param_groups, index = {}, [], 0
        for part, saved, hp in zip(self.partitions, sd["groups"], sd["param_groups"]):
            if part is None:
                param_groups.append({**hp, "params": []})
                continue
            master = saved["master"].to(part.master.device, torch.float32)
            part.master.data.copy_(shard_of(part.padded(master), part.layout))
            state[index] = {k: shard_of(part.padded(v), part.layout) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in saved["state"].items()}
            param_groups.append({**hp, "params": [index]})
            index += 1
            self._write_params(part, master)
        self.optimizer.load_state_dict({"state": {k: v for k, v in state.items() if v}, "param_groups": param_groups})
