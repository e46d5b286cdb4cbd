"""Where each DeepSpeed ZeRO stage runs in zeroshard, and the launcher facts the
engine needs before it builds anything (``engine.Engine``'s constructor).

* stages 2/3: ``wrap_fsdp`` turns the model into one ``FullyShardedDataParallel``
  (SHARD_GRAD_OP / FULL_SHARD, or their hybrid forms) and maps the config's
  precision, offload, bucket (``reduce_bucket_size``), persistence
  (``stage3_param_persistence_threshold``) and ZeRO++ (``zero_quantized_weights``,
  ``zero_hpz_partition_size``) knobs onto its keywords;
* ``param_groups``: ``model_parameters`` checked against the model, as the
  optimizer is built over the user's own parameter objects at every stage;
* ``local_rank`` / ``device_for``: which device this rank computes on.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from .fully_sharded import FullyShardedDataParallel
from .options import CPUOffload, MixedPrecision, ShardingStrategy
from .quantize import Int8BlockQuant

_STRATEGIES = {3: (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
               2: (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)}


def wrap_fsdp(model: nn.Module, stage: int, zero, dtype, device: torch.device, kw: dict) -> FullyShardedDataParallel:
    """Stage 2 or 3: the model as one FullyShardedDataParallel over ``use_orig_params=True``, with the
    config's precision, offload, bucket, persistence and ZeRO++ knobs mapped to their keywords (``kw``, the
    user's ``fsdp_kwargs``, wins where it sets one)."""
    allowed = _STRATEGIES[stage]
    strategy = kw.pop("sharding_strategy", None) or allowed[0]
    if strategy not in allowed:
        raise ValueError(f"zeroshard.initialize: fsdp_kwargs sharding_strategy={strategy} does not implement ZeRO "
                         f"stage {stage}. Fix: use {' or '.join(s.name for s in allowed)}, or drop it.")
    if kw.get("use_orig_params", True) is not True:
        raise ValueError("zeroshard.initialize: fsdp_kwargs use_orig_params=False: the engine's optimizer steps the "
                         "original parameters. Fix: use_orig_params=True (fsdp_use_orig_params: true).")
    kw["use_orig_params"] = True
    if dtype is not None:
        mp = kw.get("mixed_precision")
        if mp is not None and mp.param_dtype not in (None, dtype):
            raise ValueError(f"zeroshard.initialize: fsdp_kwargs mixed_precision param_dtype={mp.param_dtype} "
                             f"contradicts the config's {dtype}. Fix: drop one of them.")
        kw["mixed_precision"] = mp or MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    if zero.offload_param or zero.offload_optimizer:
        kw["cpu_offload"] = CPUOffload(offload_params=True)  # shards, grads and optimizer states stay on CPU
    kw.setdefault("sync_module_states", True)
    mapped = zero.mapped  # DeepSpeed's bucket and persistence knobs
    if "reduce_bucket_size" in mapped:
        elem = torch.finfo(dtype).bits // 8 if dtype is not None else 4
        kw.setdefault("bucket_cap_mb", mapped["reduce_bucket_size"] * elem / 2**20)
    if stage == 3 and "stage3_param_persistence_threshold" in mapped:
        kw.setdefault("param_persistence_threshold", int(mapped["stage3_param_persistence_threshold"]))
    if stage == 3 and mapped.get("zero_quantized_weights"):  # ZeRO++ qwZ
        kw.setdefault("quantized_all_gather", Int8BlockQuant())
    if stage == 3 and mapped.get("zero_hpz_partition_size", 1) > 1:  # ZeRO++ hpZ
        kw.setdefault("hpz_group_size", mapped["zero_hpz_partition_size"])
    if device.type != "cpu":
        kw.setdefault("device_id", device)
    return FullyShardedDataParallel(model, sharding_strategy=strategy, **kw)


def local_rank(args, global_rank: int) -> int:
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    local = getattr(args, "local_rank", None)
    return int(local) if local is not None and local >= 0 else global_rank  # no launcher said: one machine


def device_for(model: nn.Module, local_rank: int) -> torch.device:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    p = next(iter(model.parameters()), None)
    return p.device if p is not None and p.device.type != "meta" else torch.device("cpu")


def _listed(params) -> list:
    """A param group's ``params`` as a list: one tensor alone is allowed, as torch.optim allows it."""
    return [params] if torch.is_tensor(params) else list(params)


def param_groups(model: nn.Module, model_parameters) -> list:
    if model_parameters is None:
        return [p for p in model.parameters() if p.requires_grad]
    groups = [{**g, "params": _listed(g["params"])} if isinstance(g, dict) else g for g in model_parameters]
    owned = {id(p) for p in model.parameters()}
    for g in groups:
        for p in (g["params"] if isinstance(g, dict) else [g]):
            if id(p) not in owned:
                raise ValueError("zeroshard.initialize: model_parameters holds a tensor that is not a parameter of model. "
                                 "Fix: pass model.parameters() or param groups built from it.")
    return groups
