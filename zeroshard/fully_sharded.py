"""FullyShardedDataParallel: the public wrapper, with torch FSDP1's constructor.

Construction is the *shard* step of ZeRO-3: auto-wrap submodules into units
(bottom-up), then flatten this unit's remaining parameters into one
FlatParameter and keep 1/N of it. The first forward makes the outermost
instance the root, which owns the execution order and the end-of-backward
callback shared by all units below it (see ``backward_pass``).
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from . import agreement, comm_hooks, forward_pass, groups, materialize, parent_load, prefetch, validation
from . import state_dict as sd
from .bucket import unit_strategy
from .flat_param import collect_params, kept_out
from .grad_norm import clip_grad_norm_
from .handle import FlatParamHandle, HandleState
from .hpz import SecondaryShards
from .mixed_precision import cast_buffers, cast_floats, root_inputs, tensors_in
from .options import (BackwardPrefetch, CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType,
                      as_member)
from .state_dict_api import StateDictMethods
from .wrap import wrap_submodules

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FLAT_PARAM = "_flat_param"


# What torch.compile(fullgraph=True) says where it meets a unit (its own hint would be
# "Remove the torch.compiler.disable call").
_EAGER_RUNTIME = ("zeroshard's sharding runtime (all-gathers, resharding, hooks) runs eagerly, as torch FSDP1's "
                  "does, so a graph breaks at every unit. Fix: compile without fullgraph=True, or compile the "
                  "modules inside the units (FSDP(torch.compile(model)) or torch.compile on each block)")


def _reentrant_first_forward(args, kwargs) -> bool:
    """Without grad mode but fed tensors that need grad: a reentrant checkpoint's first forward."""
    return not torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in((args, kwargs)))


def _unwrapped(module: nn.Module) -> nn.Module:
    """``module`` without torch's activation-checkpointing / offload wrapper (an ActivationWrapper)."""
    return module._checkpoint_wrapped_module if isinstance(module, ActivationWrapper) else module


class FullyShardedDataParallel(StateDictMethods, nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over ranks (ZeRO-3).

    Keywords are torch FSDP1's. Options whose feature zeroshard does not have
    yet raise ``ValueError`` rather than being ignored.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy=None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules=None,
        param_init_fn=None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states=None,
        device_mesh=None,
        fsdp_group_size: int | None = None,
        bucket_cap_mb: float | None = None,
        param_persistence_threshold: int | None = None,
        quantized_all_gather=None,
        hpz_group_size: int | None = None,
    ):
        super().__init__()
        sharding_strategy = as_member(sharding_strategy, ShardingStrategy, "sharding_strategy")
        backward_prefetch = as_member(backward_prefetch, BackwardPrefetch, "backward_prefetch")
        strategy = sharding_strategy or (ShardingStrategy.HYBRID_SHARD if fsdp_group_size else ShardingStrategy.FULL_SHARD)
        ignored_modules, ignored_params = validation.split_ignored(ignored_modules, ignored_states, module, _is_unit)
        validation.check_extensions(bucket_cap_mb, param_persistence_threshold, quantized_all_gather, hpz_group_size)
        validation.refuse_torch_fsdp_inside(module)
        validation.check_option_types(cpu_offload, mixed_precision, device_id)
        try:
            shard_group, replicate_group = groups.resolve(process_group, device_mesh, strategy, fsdp_group_size)
        except ValueError as e:  # named: under auto-wrapping the unit is not the module the user passed
            raise ValueError(f"{e} [unit: FullyShardedDataParallel({type(module).__name__})]") from None
        shard_group = shard_group or dist.group.WORLD
        self.process_group, self._replicate_group = shard_group, replicate_group
        self.rank, self.world_size = shard_group.rank(), shard_group.size()
        if self.world_size == 1 and replicate_group is None and strategy != ShardingStrategy.NO_SHARD:
            # One rank has nothing to shard over; torch FSDP1 switches too, and
            # matching it keeps use_orig_params shapes and grads identical.
            warnings.warn(f"zeroshard: world size is 1, using NO_SHARD instead of {strategy.name}.", stacklevel=2)
            strategy = ShardingStrategy.NO_SHARD
        self.sharding_strategy = strategy
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self.use_orig_params = use_orig_params
        self._use_full_prec_in_eval = os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1"  # read here, as torch
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.cpu_offload = cpu_offload or CPUOffload()
        # Beyond torch FSDP (all off by default): see bucket, quantize and hpz.
        self.bucket_cap_mb = bucket_cap_mb
        self.param_persistence_threshold = param_persistence_threshold
        self.quantized_all_gather = quantized_all_gather
        self.hpz_group_size = hpz_group_size
        hpz_group = groups.hpz_group(hpz_group_size, shard_group, strategy) if hpz_group_size and self.world_size > 1 else None
        self.compute_device = validation.compute_device(module, device_id, shard_group)
        ignored = {m for root in (ignored_modules or ()) for m in root.modules()}
        if auto_wrap_policy is not None:
            unit_kwargs = dict(
                process_group=(shard_group, replicate_group) if replicate_group is not None else shard_group,
                sharding_strategy=strategy, backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params, device_id=device_id,
                # As torch FSDP1: the parameters only. A unit around an ignored module then materializes
                # it (meta init) and casts its buffers, as torch's does; its parameters stay out of every unit.
                ignored_states=list(kept_out(ignored, ignored_params)) or None,
                mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                param_init_fn=param_init_fn, sync_module_states=sync_module_states,
                bucket_cap_mb=bucket_cap_mb, param_persistence_threshold=param_persistence_threshold,
                quantized_all_gather=quantized_all_gather, hpz_group_size=hpz_group_size,
                auto_wrap_policy=None, device_mesh=None,
            )
            wrap_submodules(module, auto_wrap_policy, unit_kwargs, FullyShardedDataParallel, ignored, _is_unit, ignored_params)
        self._fsdp_wrapped_module = module
        self._ignored_modules = ignored
        self._device_mesh = device_mesh  # auto-wrapped units get it too (below): LOCAL state dicts refuse it
        if device_mesh is not None:
            for m in module.modules():
                if _is_unit(m) and m._device_mesh is None:
                    m._device_mesh = device_mesh

        def outside_unit(m):
            return _is_unit(m) or m in ignored

        renewed = materialize.materialize(module, outside_unit, _is_unit, self.compute_device, param_init_fn,
                                          kept_out(ignored, ignored_params))
        ignored_params = frozenset(renewed.get(id(p), p) for p in ignored_params)
        if sync_module_states:  # not ignored modules' parameters either (a weight tied into one included)
            materialize.sync_module_states(module, outside_unit, [shard_group, replicate_group],
                                           kept_out(ignored, ignored_params))
        nested = {m for m in module.modules() if _is_unit(m)}
        # As torch FSDP1: what a nested unit ignores, this one ignores too (a weight it shares stays out of both).
        ignored |= {m for u in nested for m in u._ignored_modules}
        ignored_params = frozenset(ignored_params).union(*(u._ignored_params for u in nested))
        self._ignored_params = ignored_params
        ids = {id(p) for p in ignored_params}  # where they live: one the user replaces there stays ignored
        self._ignored_slots = frozenset((id(m), n) for m in module.modules() for n, p in m._parameters.items() if id(p) in ids)
        # FSDP(FSDP(m)), as torch allows: the outer unit owns nothing.
        entries, aliases = ([], []) if _is_unit(module) else collect_params(
            module, skip=nested | ignored, ignored_params=kept_out(ignored, ignored_params))
        validation.check_unowned(entries, type(module).__name__)
        self._handle = None
        if entries:
            numel = sum(e[3].numel() for e in entries)
            self._handle = FlatParamHandle(
                entries, aliases, group=shard_group, strategy=unit_strategy(strategy, numel, param_persistence_threshold),
                use_orig_params=use_orig_params, unit_name=type(module).__name__,
                param_dtype=self.mixed_precision.param_dtype, reduce_dtype=self.mixed_precision.reduce_dtype,
                replicate_group=replicate_group, compute_device=self.compute_device,
                offload_params=self.cpu_offload.offload_params,
                keep_low_precision_grads=self.mixed_precision.keep_low_precision_grads,
                # Ranks must agree on these too (their collectives), and on where the nested units are: two ranks
                # that ignored different blocks pair their units up by construction order, relative names equal.
                settings=dict(backward_prefetch=backward_prefetch, bucket_cap_mb=bucket_cap_mb,
                              FSDP_USE_FULL_PREC_IN_EVAL=self._use_full_prec_in_eval,  # set on one rank: gloo abort
                              quantized_all_gather=agreement.described(quantized_all_gather), hpz_group_size=hpz_group_size,
                              nested_units=[n for n, m in module.named_modules() if m in nested] or None),
            )
            self._handle.persistent = self._handle.strategy != strategy
            # Integer and complex units are gathered exactly: int8 blocks would round them (quantize).
            floating = self._handle.dtype.is_floating_point
            self._handle.quant = quantized_all_gather if self._handle.sharded and floating else None
            self._handle.hpz = SecondaryShards(hpz_group) if hpz_group is not None and self._handle.sharded else None
            flat = self._handle.flat_param
            # torch FSDP1 registers it on ``self.module``: inside an activation-checkpointing wrapper.
            host = self._handle.flat_param_host = _unwrapped(module)
            self._handle.compute_module, self._handle.full_prec_in_eval = module, self._use_full_prec_in_eval
            if not use_orig_params:
                host._parameters[FLAT_PARAM] = flat
        self._comm_hook = self._comm_hook_state = None
        self._summoning = 0  # > 0 inside summon_full_params
        self._plain_dicts = False  # inside summon_full_params(plain_dicts=True) (compat.hfai)
        self._is_root: bool | None = None
        self._runtime: prefetch.RootRuntime | None = None
        self._sync_gradients = True
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config = FullStateDictConfig()
        self.register_load_state_dict_post_hook(parent_load.after_parent_load)

    # ------------------------------------------------------------------ runtime
    @property
    def params(self) -> list:
        """torch FSDP1's: the unit's FlatParameters (one; none without parameters)."""
        return [self._handle.flat_param] if self._handle is not None else []

    @property
    def training_state(self):
        """torch FSDP1's ``TrainingState``: SUMMON_FULL_PARAMS inside summon_full_params,
        FORWARD_BACKWARD while the unit computes its forward or backward, else IDLE."""
        from torch.distributed.fsdp._common_utils import TrainingState

        if self._summoning:
            return TrainingState.SUMMON_FULL_PARAMS
        busy = self._handle is not None and self._handle.state != HandleState.IDLE
        return TrainingState.FORWARD_BACKWARD if busy else TrainingState.IDLE

    @property
    def module(self) -> nn.Module:
        """The wrapped module (inside an activation-checkpointing wrapper, as torch FSDP1 gives it)."""
        return _unwrapped(self._fsdp_wrapped_module)

    def _lazy_init(self):
        """On the first call, the instance it is called on becomes the root."""
        if self._is_root is not None:
            return
        states = [m for m in self.modules() if _is_unit(m)]
        validation.check_new_root(states)
        for s in states[1:]:
            s._is_root = False
        self._is_root = True
        cast_buffers(states)
        runtime = prefetch.RootRuntime(states)
        paths = {m: name for name, m in self.named_modules()}
        for s in states:
            s._runtime = runtime
            if s._handle is not None:
                s._handle.is_root = s is self
                # Errors name units by their path in the model from now on.
                s._handle.unit_name = (paths[s].replace("_fsdp_wrapped_module.", "") or "<root>") + f" ({s._handle.unit_name})"

    # torch.compile: the sharding runtime (all-gathers, resharding, hooks) runs
    # eagerly, as torch FSDP1's does, and the wrapped module's own forward is
    # compiled. (Traced, the runtime broke dynamo: flat-buffer swaps inside
    # graphs, views regenerated by the compiled graph, FreedView placeholders.)
    @torch.compiler.disable(recursive=False, reason=_EAGER_RUNTIME)
    def forward(self, *args, **kwargs):
        args, kwargs = self._before_forward(args, kwargs)
        if not self._is_root:
            return forward_pass.post_forward(self, self._fsdp_wrapped_module(*args, **kwargs))
        self._runtime.in_forward = True
        try:
            output = self._fsdp_wrapped_module(*args, **kwargs)
        except BaseException:  # (in_forward is read by backward hooks only; finally resets it)
            forward_pass.end_interrupted_forward(self._runtime)
            raise
        finally:
            self._runtime.in_forward = False
        return forward_pass.post_forward(self, output)

    @torch.compiler.disable(reason=_EAGER_RUNTIME)
    def _before_forward(self, args, kwargs):
        self._lazy_init()
        mp, h = self.mixed_precision, self._handle
        full_precision = h is not None and h.forced_full_precision  # FSDP_USE_FULL_PREC_IN_EVAL in eval mode
        if self._is_root:
            forward_pass.root_pre_forward(self)  # before the hook below: it settles which FlatParameters require grad
            if not forward_pass.in_backward():  # a reentrant checkpoint around the root: recomputed in its backward
                self._runtime.reentrant_forward = _reentrant_first_forward(args, kwargs)
            args, kwargs = root_inputs((args, kwargs), self.compute_device)
            if mp.cast_root_forward_inputs and not full_precision and (self.training or not self._use_full_prec_in_eval):
                args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
        if mp.cast_forward_inputs and h is not None and not full_precision:  # torch: only units with a FlatParameter
            args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
        if h is not None:
            h.recompute_ahead = _reentrant_first_forward(args, kwargs)
        forward_pass.pre_forward(self)
        return args, kwargs

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (unsharded, no communication) inside the block."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("zeroshard: no_sync() must be called on the root FullyShardedDataParallel instance.")
        states = [m for m in self.modules() if _is_unit(m)]
        previous = [s._sync_gradients for s in states]
        for s in states:
            s._sync_gradients = False
        try:
            yield
        finally:
            for s, prev in zip(states, previous):
                s._sync_gradients = prev

    def check_is_root(self) -> bool:
        """Whether this instance is the root (the first call makes the instance it is called on the root)."""
        self._lazy_init()
        return bool(self._is_root)

    def register_comm_hook(self, state: object, hook) -> None:
        """Replace every unit's gradient collective by ``hook`` (root only; see ``comm_hooks``):
        ``hook(state, grad, output)`` for sharded units, ``hook(state, grad)`` for NO_SHARD ones."""
        comm_hooks.register(self, self.fsdp_modules(self), state, hook)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all units by their global norm; returns that norm."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("zeroshard: clip_grad_norm_() must be called on the root FullyShardedDataParallel instance.")
        return clip_grad_norm_(self, max_norm, norm_type)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        units = [m for m in module.modules() if _is_unit(m)]
        if not root_only:
            return units
        for u in units:  # as torch: the roots are known once lazily initialized
            u._lazy_init()
        return [u for u in units if u._is_root]

    def apply(self, fn):
        """``nn.Module.apply`` with this unit's full parameters in place and
        written back to the shards (e.g. ``model.apply(init_weights)``), as in
        torch FSDP1; nested units summon their own as the recursion reaches them."""
        with sd.summon_full_params(self, recurse=False, writeback=True):
            return super().apply(fn)

    def named_parameters(self, *args, **kwargs):
        """``nn.Module``'s, but inside ``summon_full_params`` the names are the
        plain model's (no ``_fsdp_wrapped_module.``), as in torch FSDP1."""
        return self._summoned_names(super().named_parameters(*args, **kwargs))

    def named_buffers(self, *args, **kwargs):
        """As :meth:`named_parameters`, for buffers."""
        return self._summoned_names(super().named_buffers(*args, **kwargs))

    def _summoned_names(self, named):
        for name, t in named:
            yield (sd.clean_key(name) if self._summoning else name), t

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key):
        return self._fsdp_wrapped_module.__getitem__(key)


def _is_unit(m: nn.Module) -> bool:
    return isinstance(m, FullyShardedDataParallel)


FSDP = FullyShardedDataParallel
