"""zeroshard: a from-scratch ZeRO-3 sharding engine with torch FSDP1's API.

``import zeroshard as fsdp`` then ``fsdp.FullyShardedDataParallel(model, ...)``.
The package reads in lifecycle order:

  options     -> ShardingStrategy, BackwardPrefetch, MixedPrecision, CPUOffload, StateDictType + configs
  materialize -> meta-device init unit by unit, sync_module_states
  groups      -> shard / replicate process groups for hybrid sharding
  flat_param  -> a unit's parameters as one padded 1-D buffer (+ layout math)
  handle      -> shard / unshard (all-gather) / reshard (free) of that buffer
  orig_params -> use_orig_params: original parameters as views of the shard, user changes written back
  reduce      -> reduce-scatter of the flat gradient, torch's divide factors
  comm_hooks  -> register_comm_hook: replace the gradient collective (compression hooks)
  bucket      -> small units: bucketed reductions (bucket_cap_mb), persistent units
  quantize    -> ZeRO++ qwZ: int8 block-quantized all-gather (Int8BlockQuant)
  hpz         -> ZeRO++ hpZ: secondary shards, backward all-gather within a group
  working_set -> which units are gathered right now (unsharded_tracker)
  prefetch    -> execution order, forward / backward prefetch, limit_all_gathers (RootRuntime)
  forward_pass -> the hooks around each unit's forward: gather, free, hook the backward
  backward_pass -> pre-backward gather, post-backward free + reduce-scatter, end of backward
  wrap        -> which submodules become units (auto-wrap policies)
  fully_sharded -> the FullyShardedDataParallel module itself
  state_dict_api -> its state-dict methods (state_dict, optim_state_dict, summon_full_params, ...)
  mixed_precision -> buffer and forward-input casts (param_dtype: handle; reduce_dtype: reduce)
  validation  -> checks before sharding (dtype, requires_grad, owners) and at optimizer steps
  agreement   -> ranks compared: same layout and settings per unit, same units run (DETAIL)
  grad_norm   -> clip_grad_norm_ over shards
  full_params -> one unit's summon_full_params: its full parameters under their original names
  state_dict  -> summon_full_params over the units, full and sharded (DCP) state dicts
  local_state -> LOCAL_STATE_DICT: each rank's flat shards, in torch FSDP1's format
  sharded_state -> SHARDED tensors: this rank's rows as DTensors (1-D, or 2-D for hybrid) for DCP
  optim_state -> optimizer state dicts: each unit's sharded states gathered (FULL) or cut into rows (SHARDED)
  optim_load  -> the inverse: a checkpoint's optimizer state cut back to this rank's shards
  optim_legacy -> torch's older optimizer-state calls (shard_full_, scatter_full_, rekey_...)
  checkpoint  -> atomic checkpoint files and DCP directories; consolidate: DCP dir -> one file
  comm        -> the collectives, with byte accounting
  ext         -> optional C++/CUDA flatten/unflatten kernels
  trace       -> opt-in timeline of the lifecycle (Chrome trace, PNG)
  estimate    -> ZeRO memory model (python -m zeroshard.estimate)
  simulate    -> alpha-beta step-time model at scale (python -m zeroshard.simulate)
  zero1       -> ZeRO-1: flat fp32 master sharded, gradients reduce-scattered, parameters all-gathered
  loss_scale  -> fp16 static / dynamic loss scaling (DeepSpeed's rules)
  ds_config   -> DeepSpeed JSON config subset: validation, optimizer
  ds_schema   -> the keys DeepSpeed accepts in the sections it validates (the rest are typos)
  lr_schedules -> DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR
  engine      -> zeroshard.initialize: a DeepSpeed-style engine over DDP / ZeRO-1 / FSDP
  ds_checkpoint -> the engine's save_checkpoint / load_checkpoint directories (DeepSpeed layout)
  accelerate_config -> Accelerate fsdp_config -> FullyShardedDataParallel keywords
  compat.hfai -> hfai-style front end
  demo        -> the main job: a character-level GPT, zeroshard vs torch FSDP1 (python -m zeroshard demo)
  testing     -> rank pools, assert_parity vs torch FSDP1 (python -m zeroshard.testing), hypothesis strategies
  examples    -> runnable tutorials (python -m zeroshard.examples.<name>); docs/walkthrough.md
"""
from . import bucket, checkpoint, comm_hooks, hpz, quantize, trace, wrap
from .accelerate_config import from_accelerate_config
from .comm import comm_stats
from .engine import Engine, initialize
from .ext import ext_backend
from .quantize import Int8BlockQuant
from .fully_sharded import FSDP, FullyShardedDataParallel
from .flat_param import FlatParameter
from .handle import unsharded_tracker
from .optim_legacy import OptimStateKeyType
from .options import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = [
    "FullyShardedDataParallel",
    "FSDP",
    "FlatParameter",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "wrap",
    "comm_hooks",
    "comm_stats",
    "ext_backend",
    "unsharded_tracker",
    "Int8BlockQuant",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
    "initialize",
    "Engine",
    "from_accelerate_config",
]
