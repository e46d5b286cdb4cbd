"""The knobs of FSDP: sharding strategies (which ZeRO stage), backward prefetch
modes, and the configuration records other issues build on (mixed precision,
CPU offload, the model's and the optimizer's state dict configs).

Names and values follow ``torch.distributed.fsdp`` so that a script written for
torch FSDP1 reads the same with ``import zeroshard as fsdp``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer states are split over ranks.

    FULL_SHARD is ZeRO-3 (parameters freed after forward and re-gathered for
    backward), SHARD_GRAD_OP is ZeRO-2 (parameters stay gathered from forward
    until the unit's own backward), NO_SHARD is plain data parallelism (one
    all-reduce per unit). The hybrid strategies shard inside a group and
    replicate across groups.
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()


class BackwardPrefetch(enum.Enum):
    """When to issue the next unit's all-gather during backward.

    BACKWARD_PRE: as soon as the current unit's backward starts (more overlap,
    two units' parameters live). BACKWARD_POST: once the current unit's
    gradient is computed and its parameters are freed (less memory).
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


def as_member(value, enum_cls: type[enum.Enum], keyword: str):
    """``value`` as a member of ``enum_cls``: torch's own enums (same names)
    are accepted, so ``from torch.distributed.fsdp import ShardingStrategy``
    works with zeroshard; anything else is refused rather than misread."""
    if value is None or isinstance(value, enum_cls):
        return value
    name = getattr(value, "name", None)
    if name not in enum_cls.__members__:
        raise ValueError(f"zeroshard: {keyword}={value!r} is not a {enum_cls.__name__}. "
                         f"Fix: pass one of {', '.join(enum_cls.__members__)}.")
    return enum_cls[name]


@dataclass
class MixedPrecision:
    """Dtypes for the all-gathered parameters, the gradient reduction and buffers."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    # With an auto_wrap_policy, instances of these classes become units of
    # their own with mixed precision off (see wrap.wrap_submodules).
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    """Keep the sharded parameters (and their gradients) on CPU between uses."""

    offload_params: bool = False


class StateDictType(enum.Enum):
    """What ``state_dict()`` returns: the whole model (FULL), each rank's flat
    shards (LOCAL), or per-parameter shards (SHARDED)."""

    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass
class StateDictConfig:
    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only rank 0 materializes the full state dict (others get {})."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """``_use_dtensor``: torch's keyword, accepted; zeroshard's shards are always DTensors."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """``offload_to_cpu``: accepted for torch's signature; FULL states are always returned on CPU."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """``rank0_only``: only rank 0 gets the full dict (others ``{}``); loading
    then takes the dict from rank 0 only."""

    rank0_only: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """States as DTensors of this rank's rows (see ``sharded_state``); ``_use_dtensor``:
    torch's keyword, accepted (they are DTensors whatever it says)."""

    _use_dtensor: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """The optimizer config paired with LOCAL_STATE_DICT (torch's name; no options used)."""

    offload_to_cpu: bool = False


@dataclass
class StateDictSettings:
    """What ``state_dict_type`` set on a model's units (``FSDP.get_state_dict_type``)."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


DEFAULT_CONFIG = {StateDictType.FULL_STATE_DICT: FullStateDictConfig,
                  StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
                  StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig}
DEFAULT_OPTIM_CONFIG = {StateDictType.FULL_STATE_DICT: FullOptimStateDictConfig,
                         StateDictType.LOCAL_STATE_DICT: LocalOptimStateDictConfig,
                         StateDictType.SHARDED_STATE_DICT: ShardedOptimStateDictConfig}
