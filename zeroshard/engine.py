"""DeepSpeed's front end on zeroshard: ``initialize`` and the training ``Engine``
(``deepspeed.initialize`` and ``deepspeed/runtime/engine.py``), so a DeepSpeed
script runs by changing its import::

    engine, optimizer, _, scheduler = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for batch in loader:
        loss = engine(batch)          # forward
        engine.backward(loss)         # / gradient_accumulation_steps, x fp16 loss scale
        engine.step()                 # optimizer step only at accumulation boundaries

ZeRO stages (``zero_optimization.stage``) become:

* 0, data parallel: DeepSpeed's own ``allreduce_gradients`` at an
  accumulation boundary (``data_parallel``). The user's parameter objects stay
  the optimizer's, as at every stage.
* 1, optimizer states sharded: ``zero1.ZeroOneOptimizer`` (from scratch;
  torch FSDP has no ZeRO-1).
* 2: ``FullyShardedDataParallel(sharding_strategy=SHARD_GRAD_OP)``.
* 3: ``FullyShardedDataParallel(sharding_strategy=FULL_SHARD)``.

Stages 2/3 wrap with ``use_orig_params=True`` (the optimizer keeps stepping the
user's parameter objects, now views of the shards, so param groups survive)
and ``sync_module_states=True``; stages 0/1 broadcast rank 0's weights too, as
DeepSpeed does. ``initialize(fsdp_kwargs=...)`` adds FSDP keywords (an
``auto_wrap_policy``, ``from_accelerate_config(...)``'s output); without a wrap
policy the whole model is one unit.

Gradient accumulation follows DeepSpeed's ``allreduce_gradients``: stages 0/1
communicate only at the boundary (stage 0 in that micro-step's ``backward``,
ZeRO-1 in ``step()``); stages 2/3 reduce-scatter
every micro-step into the sharded gradient, because skipping it (FSDP's
``no_sync``) would keep full unsharded gradients and defeat their memory saving
(DeepSpeed refuses ``no_sync`` at stage 2/3 for that reason).

At a boundary ``step()`` runs: (fp16) overflow check across all ranks -> skip
or unscale -> clip to ``gradient_clipping`` -> optimizer step -> LR scheduler
step -> zero grads; a skipped step still counts in ``global_steps`` (and in
``skipped_steps``) but leaves parameters, optimizer state and scheduler as they were.

fp16/bf16 (stages 0/1): the model is cast and inputs' floating tensors too; an
fp32 master lives in ``ZeroOneOptimizer`` (one partition at stage 0). Stages
2/3: ``MixedPrecision(param, reduce, buffer dtype = fp16/bf16)`` over fp32 shards.

Checkpoints (``save_checkpoint`` / ``load_checkpoint``): DeepSpeed's model file
(each reads the other's weights), a world-size independent optimizer file,
written atomically; see ``ds_checkpoint``.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from . import agreement, comm, data_parallel, ds_checkpoint, ds_stages, grad_norm, materialize
from .ds_config import ConfigGetters, build_optimizer, load_config
from .loss_scale import DynamicLossScaler, StaticLossScaler, has_overflow, unscale_
from .lr_schedules import build_scheduler
from .mixed_precision import tensors_in
from .zero1 import ZeroOneOptimizer

_ENGINE_BACKWARDS = [0]  # engine.backward calls running now (any engine: one model's backward may cross another's)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
               config_params=None, *, fsdp_kwargs=None):
    """``deepspeed.initialize``, with its arguments in its order: returns
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``optimizer``/``lr_scheduler`` may be instances or callables (params ->
    optimizer, optimizer -> scheduler), or come from the config (not both).
    ``distributed_port`` is used by DeepSpeed only for MPI discovery, which
    zeroshard does not do (launch with torchrun): accepted, unused.
    ``fsdp_kwargs`` (zeroshard extension, keyword only): extra
    FullyShardedDataParallel keywords for stages 2/3.
    """
    if model is None:
        raise ValueError("zeroshard.initialize: model= is required.")
    if mpu is not None:
        raise ValueError("zeroshard.initialize: model parallelism (mpu=) is not supported. Fix: leave mpu=None.")
    if mesh_param is not None:
        raise ValueError("zeroshard.initialize: a data/sequence-parallel mesh (mesh_param=) is not supported: every rank "
                         "is one data-parallel replica. Fix: leave mesh_param=None.")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("zeroshard.initialize: no config. Fix: pass config={...} or config='ds_config.json'.")
    if not dist.is_initialized():
        if dist_init_required is False or not all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            raise RuntimeError("zeroshard.initialize: torch.distributed is not initialized. Fix: launch with torchrun "
                               "(which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or call init_process_group first.")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    engine = Engine(model, config, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                    training_data=training_data, collate_fn=collate_fn, fsdp_kwargs=fsdp_kwargs, args=args)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


class Engine(ConfigGetters, nn.Module):
    """DeepSpeedEngine's training surface over data parallelism / ZeRO-1 / zeroshard FSDP (see the module docstring)."""

    def __init__(self, model: nn.Module, config, optimizer=None, model_parameters=None, lr_scheduler=None,
                 training_data=None, collate_fn=None, fsdp_kwargs=None, args=None):
        super().__init__()
        self.world_size, self.global_rank = dist.get_world_size(), dist.get_rank()
        self.local_rank = ds_stages.local_rank(args, self.global_rank)
        self.config = cfg = load_config(config, self.world_size)
        self.stage, dtype = cfg.zero.stage, cfg.low_precision_dtype
        self.device = ds_stages.device_for(model, self.local_rank)  # before any collective: NCCL's device
        if self.world_size > 1:
            agreement.check_same_config(cfg)
        self.micro_steps = self.global_steps = self.global_samples = self.skipped_steps = 0
        self._global_grad_norm = None
        self._step_applied, self._boundary = False, None  # the last boundary's step taken; a set boundary
        self._no_sync = False
        self._backwards = 0  # engine.backward calls since the last optimizer step (see _check_backward)
        self._direct = False  # a backward outside any engine.backward changed this model's gradients
        self._unreduced = False  # stage 0: gradients from a backward that did not all-reduce them
        self._direct_task = None  # the autograd graph task _saw_backward last looked at
        self.dp_world_size = self.world_size
        self.zero1: ZeroOneOptimizer | None = None
        if optimizer is not None and cfg.optimizer is not None:
            raise ValueError("zeroshard.initialize: both optimizer= and a config 'optimizer' section were given. "
                             "Fix: drop one of them.")
        if lr_scheduler is not None and cfg.scheduler is not None:
            raise ValueError("zeroshard.initialize: both lr_scheduler= and a config 'scheduler' section were given. "
                             "Fix: drop one of them.")
        if fsdp_kwargs and self.stage < 2:
            raise ValueError(f"zeroshard.initialize: fsdp_kwargs apply to ZeRO stages 2 and 3, but the stage is {self.stage}. "
                             "Fix: drop fsdp_kwargs or set zero_optimization.stage to 2 or 3.")
        # Every stage keeps the original parameter objects, so the optimizer is
        # built over them before wrapping.
        groups = ds_stages.param_groups(model, model_parameters)
        if dtype is not None:  # DeepSpeed casts the model before its fp32 master copies it, so the master
            with torch.no_grad():  # starts from the fp16/bf16 values: so does ours, and stage 2/3's fp32 shards
                for p in model.parameters():
                    if p.is_floating_point():
                        p.copy_(p.to(dtype))
        if self.stage < 2:
            if self.world_size > 1:  # stages 2/3 compare each unit's layout instead
                agreement.check_same_model(model)
            model.to(self.device)
            materialize.sync_module_states(model, lambda m: False, [dist.group.WORLD])  # rank 0's weights
        if isinstance(optimizer, torch.optim.Optimizer):
            opt = optimizer
        elif callable(optimizer):
            opt = optimizer(groups)
        else:
            opt = build_optimizer(cfg.optimizer, groups) if cfg.optimizer is not None else None
        if self.stage >= 2:
            wrapped = ds_stages.wrap_fsdp(model, self.stage, cfg.zero, dtype, self.device, dict(fsdp_kwargs or {}))
        else:
            if dtype is not None:  # first: the master's dtype follows the parameters' (fp32 for bf16, not a float64 model's)
                model.to(dtype)
            if opt is not None and (self.stage == 1 or dtype is not None):
                master_device = torch.device("cpu") if cfg.zero.offload_optimizer else None
                self.zero1 = ZeroOneOptimizer(opt, dist.group.WORLD if self.stage == 1 else None, master_device, model)
            wrapped = model
        self.module = wrapped  # DeepSpeedEngine's name: engine.state_dict() keys read "module.<name>"
        self.optimizer = opt
        self._input_dtype = dtype if self.stage < 2 and (cfg.bf16 or cfg.fp16.auto_cast) else None
        f = cfg.fp16
        self.loss_scaler = None
        if f.enabled:
            self.loss_scaler = (StaticLossScaler(f.loss_scale) if f.loss_scale > 0 else DynamicLossScaler(
                2.0**f.initial_scale_power, f.loss_scale_window, f.min_loss_scale, f.hysteresis, f.consecutive_hysteresis))
        if cfg.scheduler is not None:
            if opt is None:
                raise ValueError("zeroshard.initialize: a 'scheduler' section needs an optimizer. Fix: add an 'optimizer' "
                                 "section or pass optimizer=.")
            lr_scheduler = build_scheduler(cfg.scheduler, opt)
        elif lr_scheduler is not None and not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
            lr_scheduler = lr_scheduler(opt)
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = None
        if training_data is not None:
            sampler = torch.utils.data.DistributedSampler(training_data, self.world_size, self.global_rank)
            self.training_dataloader = torch.utils.data.DataLoader(
                training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn)

    # -------------------------------------------------------------- the loop
    @property
    def wrapped(self) -> nn.Module:
        """``module``: the user's model at stages 0/1, the root FSDP unit at stages 2/3."""
        return self._modules["module"]

    def forward(self, *inputs, **kwargs):
        if self._input_dtype is not None:
            dtype = self._input_dtype
            inputs, kwargs = tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, (inputs, kwargs))
        out = self.wrapped(*inputs, **kwargs)
        if torch.is_grad_enabled() and self._backward_does_more():  # see _check_backward
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(self._saw_backward)
        return out

    def _saw_backward(self, grad):
        """A backward reached an output outside engine.backward: if it changes the gradients
        (``loss.backward()``; not ``autograd.grad`` for a penalty), its step would be wrong."""
        task = torch._C._current_graph_task_id()
        if _ENGINE_BACKWARDS[0] or self._direct or task == self._direct_task:  # any engine's (a GAN's G through D)
            return
        self._direct_task, before = task, self._grads_now()

        def at_end():  # queued after FSDP's own end-of-backward callback, so its reduced gradients are in
            self._direct = self._direct or self._grads_now() != before
        torch.autograd.Variable._execution_engine.queue_callback(at_end)

    def _grads_now(self):
        return [None if p.grad is None else (id(p.grad), p.grad._version) for p in self.module.parameters()]

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of loss / gradient_accumulation_steps (x the fp16 loss scale);
        returns loss / gradient_accumulation_steps, unscaled, as DeepSpeed does."""
        if not isinstance(loss, torch.Tensor):  # a float(loss) or loss.item(): no graph to go back through
            raise ValueError(f"zeroshard engine.backward: loss must be the tensor the model's output gave, got a "
                             f"{type(loss).__name__} ({loss!r:.40}). Fix: pass the loss before .item() or float().")
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        scaled = loss if self.loss_scaler is None else loss.float() * self.loss_scaler.loss_scale
        if self._direct and all(p.grad is None for p in self.module.parameters()):
            self._direct = False  # that backward's gradients were cleared (module or optimizer zero_grad)
        _ENGINE_BACKWARDS[0] += 1
        try:
            scaled.backward(retain_graph=retain_graph)
        finally:
            _ENGINE_BACKWARDS[0] -= 1
        self._backwards += 1
        if self.stage == 0 and self.is_gradient_accumulation_boundary() and not self._no_sync:
            data_parallel.allreduce_gradients(self.module.parameters(), self.world_size)
            self._unreduced = False
        elif self.stage == 0:
            self._unreduced = True  # until a boundary's backward outside no_sync() all-reduces the sum
        return loss

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's: a ``backward`` inside communicates nothing, even at a boundary;
        the gradients accumulate locally until the next boundary's ``backward`` outside
        (stage 0) or ``step()`` (ZeRO-1) reduces them all. ``step()`` inside raises, and so
        does a stage-0 ``step()`` after the block when no such backward followed it.
        Stages 0/1 only: at 2/3 every backward reduce-scatters into the sharded gradient."""
        if self.stage >= 2:
            raise ValueError(f"zeroshard engine: no_sync() at ZeRO stage {self.stage}, whose gradients are sharded as "
                             "they are produced (DeepSpeed refuses it too). Fix: accumulate with "
                             "gradient_accumulation_steps, or use stage 0 or 1.")
        if self._no_sync:
            raise RuntimeError("zeroshard engine: no_sync() entered again inside no_sync(). Fix: use one no_sync block.")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step (the one ``step()`` will close) ends an accumulation."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides the boundary (DeepSpeed's, for loops whose accumulation length varies):
        set it before each micro-step's forward/backward, True on the last one."""
        self._boundary = bool(is_boundary)

    def step(self, lr_kwargs=None) -> None:
        """At an accumulation boundary: the optimizer step, then ``lr_scheduler.step(**lr_kwargs)``."""
        if self._no_sync:
            raise RuntimeError("zeroshard engine: step() inside no_sync(), whose gradients are not reduced yet. "
                               "Fix: call step() after the block (at stage 0 after a backward outside it, "
                               "which reduces them).")
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1

    def _check_backward(self) -> None:
        """Refuse gradients from ``loss.backward()`` where ``engine.backward`` does more (DeepSpeed raises at
        stage 0): alone in the window, or beside ``engine.backward`` (seen by hooks on the forward's outputs)."""
        if not self._backward_does_more():
            return
        # Decided by every rank together, at every boundary (a rank may have had no batch): at stages 2/3 a
        # rank whose shard holds only frozen elements sees no gradient where the others do.
        direct = self._direct or not self._backwards and any(p.grad is not None for p in self.module.parameters())
        # Stage 0 all-reduces in a boundary's backward: one inside no_sync() left the step each rank's own gradients.
        unreduced = self._unreduced and self.world_size > 1 and any(p.grad is not None for p in self.module.parameters())
        got = torch.tensor([direct, unreduced], dtype=torch.int32, device=self.device)
        if self.world_size > 1:
            comm.all_reduce(got, dist.group.WORLD, op=dist.ReduceOp.MAX, what="step (gradients without engine.backward?)")
        if got[1]:
            raise RuntimeError("zeroshard engine: step() at stage 0 after the accumulation window's last backward ran inside "
                               "no_sync(): its gradients were never all-reduced, so each rank would step its own and the "
                               "replicas would diverge. Fix: run the boundary's backward outside no_sync() (it all-reduces "
                               "the accumulated gradients), or use ZeRO stage 1, which reduces them in step().")
        if not got[0]:
            return
        does = ("all-reduces them at stage 0" if self.stage == 0 else "scales the fp16 loss" if self.loss_scaler
                is not None else "divides the loss by gradient_accumulation_steps")
        raise RuntimeError(f"zeroshard engine: step() after gradients came from loss.backward() (alone, or beside engine.backward "
                           f"in this accumulation window); engine.backward(loss) "
                           f"{does}, so the step would be wrong (DeepSpeed: 'Direct calls to tensor.backward() are not "
                           "supported'). Fix: call engine.backward(loss).")

    def _backward_does_more(self) -> bool:
        return self.stage == 0 or self.gradient_accumulation_steps() > 1 or self.loss_scaler is not None

    def _take_model_step(self, lr_kwargs=None) -> None:
        if self.optimizer is None:
            raise RuntimeError("zeroshard engine: step() without an optimizer. Fix: pass optimizer= or add an 'optimizer' section.")
        self._check_backward()
        self._backwards, self._direct = 0, False
        if self.zero1 is not None:
            self.zero1.reduce_gradients()
            grads = self.zero1.master_grads()
        else:
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        overflow = False
        if self.loss_scaler is not None:
            overflow = has_overflow(grads, self.device)
            if not overflow:
                unscale_(grads, self.loss_scaler.loss_scale)
            self.loss_scaler.update_scale(overflow)
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
            self._global_grad_norm = float("inf")  # as DeepSpeed's ZeRO and fp16/bf16 optimizers report it
        else:
            # The pre-clip norm at every step (DeepSpeed's ZeRO optimizers compute it unasked); inf: no clipping.
            clip = self.config.gradient_clipping
            self._global_grad_norm = self._clip(clip if clip > 0 else math.inf)
            if self.zero1 is None:
                self.optimizer.step()
            elif self.zero1.any_grads:  # else no backward on any rank: the filled-in zeros would still decay weights
                self.zero1.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self._zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm, clipping to ``max_norm`` (inf: the norm alone, gradients untouched)."""
        if self.zero1 is not None:
            return self.zero1.clip_grad_norm_(max_norm)
        if max_norm == math.inf:
            return grad_norm.total_norm(self.wrapped) if self.stage >= 2 else grad_norm.local_total_norm(self.module.parameters())
        if self.stage >= 2:
            return self.wrapped.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def zero_grad(self) -> None:
        """DeepSpeed's: clears the parameters' gradients; at stages 2/3 the sharded gradients accumulated
        since the last step stay (they are DeepSpeed's partitioned accumulation, not the parameters')."""
        if self.stage >= 2 and self._backwards:
            return
        self._zero_grad()

    def _zero_grad(self) -> None:
        self._direct = self._unreduced = False  # the gradients it saw are gone
        if self.zero1 is not None:
            self.zero1.zero_grad()
        elif self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.stage < 2:
            self.module.zero_grad(set_to_none=True)

    # ------------------------------------------------------------ accessors
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last boundary's optimizer step ran (False after an fp16 overflow skipped it)."""
        return self._step_applied

    def get_mom(self) -> list:
        """Each param group's momentum (SGD, RMSprop) or betas (Adam family), as DeepSpeed's."""
        key = "momentum" if isinstance(self.optimizer, (torch.optim.SGD, torch.optim.RMSprop)) else "betas"
        return [g[key] for g in self.optimizer.param_groups]

    def module_state_dict(self) -> dict:
        """The plain model's full state dict (collective at stages 2/3)."""
        return ds_checkpoint.model_state_dict(self)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """Rank 0 saves the plain model's full state dict, floating tensors in the
        config's fp16/bf16 (as they are in fp32 training), as DeepSpeed's (collective)."""
        return ds_checkpoint.save_16bit(self, save_dir, save_filename)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "module" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self.module, name)  # DeepSpeed passes unknown attributes to the model

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save model, optimizer, scheduler, loss scaler, counters and ``client_state`` (collective;
        as in DeepSpeed, rank 0's ``client_state`` is the one stored, every rank's at stage 3). See ``ds_checkpoint``."""
        return ds_checkpoint.save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Returns ``(load_path, client_state)``, or ``(None, None)`` with a warning if there is no checkpoint."""
        return ds_checkpoint.load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                  load_lr_scheduler_states, load_module_only)
