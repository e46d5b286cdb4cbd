"""Accelerate's FSDP config as zeroshard ``FullyShardedDataParallel`` keywords
(the fields of ``accelerate config``'s YAML that Accelerate's
``FullyShardedDataParallelPlugin`` reads), so a script configured for
``accelerate launch`` with FSDP can wrap its model with zeroshard::

    kw = zeroshard.from_accelerate_config("fsdp.yaml", model=model)
    model = zeroshard.FullyShardedDataParallel(model, **kw)
    zeroshard.FullyShardedDataParallel.set_state_dict_type(
        model, kw.state_dict_type, kw.state_dict_config, kw.optim_state_dict_config)

Accepted: the ``fsdp_config`` mapping itself, or a whole Accelerate config
(``{"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config":
{...}}``; its launcher keys such as ``num_processes`` are ignored, a key Accelerate's
config file does not have is refused as there), as a dict
or a path to a YAML (needs PyYAML) or JSON file; or nothing, inside ``accelerate launch``: then
the ``FSDP_*`` environment variables it exports are read (the same fields, upper-cased;
``FSDP_TRANSFORMER_CLS_TO_WRAP``, ``ACCELERATE_MIXED_PRECISION``), as Accelerate's
``FullyShardedDataParallelPlugin`` reads them, its defaults for unset variables included
(``use_orig_params``, ``sync_module_states`` and ``cpu_ram_efficient_loading`` false, no
size-based wrapping; ``FSDP_RESHARD_AFTER_FORWARD`` is not read: FSDP1's plugin takes the
strategy from ``FSDP_SHARDING_STRATEGY``).

| field | values | keyword |
|---|---|---|
| fsdp_sharding_strategy | FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, or Accelerate's 1-based int | sharding_strategy |
| fsdp_reshard_after_forward | true (FULL_SHARD) / false (SHARD_GRAD_OP), or a strategy name | sharding_strategy |
| fsdp_backward_prefetch (older: fsdp_backward_prefetch_policy) | BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH (or 1-based int) | backward_prefetch |
| fsdp_forward_prefetch | bool | forward_prefetch |
| fsdp_auto_wrap_policy | TRANSFORMER_BASED_WRAP (+ fsdp_transformer_layer_cls_to_wrap, class names looked up in ``model``; default ``model._no_split_modules``), SIZE_BASED_WRAP (+ fsdp_min_num_params; 0 means no wrapping, as in Accelerate), NO_WRAP | auto_wrap_policy |
| fsdp_use_orig_params | bool | use_orig_params |
| fsdp_sync_module_states | bool | sync_module_states |
| fsdp_cpu_ram_efficient_loading | bool; forces sync_module_states (Accelerate warns and does the same) | ``kw.cpu_ram_efficient_loading`` |
| fsdp_offload_params | bool | cpu_offload=CPUOffload(offload_params=...) |
| fsdp_state_dict_type | FULL_STATE_DICT, LOCAL_STATE_DICT, SHARDED_STATE_DICT (or 1-based int) | ``kw.state_dict_type`` (not a constructor keyword), with ``kw.state_dict_config`` / ``kw.optim_state_dict_config`` as Accelerate pairs them (full: ``offload_to_cpu=True, rank0_only=True``; sharded: ``offload_to_cpu=True``) |
| mixed_precision (top level or in fsdp_config) | bf16, fp16, no | mixed_precision=MixedPrecision(d, d, d), as Accelerate |

Keys are read as ``accelerate launch`` reads them: one without ``fsdp`` in its
name gets the ``fsdp_`` prefix (``sharding_strategy`` is ``fsdp_sharding_strategy``),
a ``null`` value counts as left out, and ``mixed_precision`` is read in any case.
A field left out takes ``accelerate launch``'s default: FULL_SHARD, no prefetch,
no forward prefetch, NO_WRAP (SIZE_BASED_WRAP: 1e8 parameters), use_orig_params
true, sync_module_states true, cpu_ram_efficient_loading true, no offload,
FULL_STATE_DICT, no mixed precision. ``fsdp_version: 2``,
``fsdp_activation_checkpointing: true`` (or its ``_offload``) and ``fsdp_ignored_modules`` are refused
(pass ``ignored_modules=`` to the constructor yourself), as are two keys that say
different things (``fsdp_sharding_strategy`` / ``fsdp_reshard_after_forward``,
``fsdp_backward_prefetch`` / ``fsdp_backward_prefetch_policy``) and a config whose
``distributed_type`` is not FSDP; a field Accelerate does not know (a typo such as
``fsdp_sharding_stratgy``) raises naming it and the closest known one (Accelerate's launcher
would drop it silently); bad values raise ``ValueError`` naming the field, the value and the fix.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import warnings

import torch
import torch.nn as nn

from . import wrap
from .options import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                      ShardedOptimStateDictConfig, ShardedStateDictConfig, ShardingStrategy, StateDictType)

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
STATE_DICT_TYPES = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
WRAP_POLICIES = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
KNOWN = {"fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_backward_prefetch", "fsdp_backward_prefetch_policy",
         "fsdp_forward_prefetch", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params",
         "fsdp_use_orig_params", "fsdp_sync_module_states", "fsdp_cpu_ram_efficient_loading", "fsdp_offload_params",
         "fsdp_state_dict_type", "mixed_precision", "fsdp_version", "fsdp_activation_checkpointing",
         "fsdp_activation_checkpointing_offload", "fsdp_ignored_modules"}
# The keys of a whole Accelerate config file (its ClusterConfig in accelerate 1.x: 1.15's, with ipex_config and
# tp_config of earlier 1.x releases, and the legacy `fp16` and `dynamo_backend` it converts); it refuses any other.
CONFIG_FILE_KEYS = {"command_file", "commands", "compute_environment", "debug", "deepspeed_config", "distributed_type",
                    "downcast_bf16", "dynamo_backend", "dynamo_config", "enable_cpu_affinity", "fp16", "fp8_config",
                    "fsdp_config", "gpu_ids", "ipex_config", "machine_rank", "main_process_ip", "main_process_port",
                    "main_training_function", "megatron_lm_config", "mixed_precision", "mpirun_config", "num_machines",
                    "num_processes", "parallelism_config", "rdzv_backend", "same_network", "tpu_env", "tpu_name",
                    "tp_config", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_zone", "use_cpu"}


class FSDPKwargs(dict):
    """Keyword arguments for FullyShardedDataParallel, plus the settings that are not constructor keywords:
    the state dict type with the configs Accelerate pairs it with (``set_state_dict_type(model,
    kw.state_dict_type, kw.state_dict_config, kw.optim_state_dict_config)``), and cpu_ram_efficient_loading."""

    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    state_dict_config = None
    optim_state_dict_config = None
    cpu_ram_efficient_loading: bool = True


def _bad(key, value, expected: str) -> ValueError:
    return ValueError(f"zeroshard accelerate config: {key} = {value!r} is not valid. Fix: use {expected}.")


def _bool(key, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "y", "on", "1"):
        return True
    if text in ("false", "no", "n", "off", "0"):
        return False
    raise _bad(key, value, "true or false")


def _choice(key, value, names: list[str]) -> str:
    """A name from ``names`` given as a name (any case) or Accelerate's 1-based index."""
    if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, str) and value.strip().isdigit():
        i = int(value)
        if 1 <= i <= len(names):
            return names[i - 1]
    elif isinstance(value, str) and value.strip().upper() in names:
        return value.strip().upper()
    raise _bad(key, value, f"one of {', '.join(names)} (or 1-{len(names)})")


def _read(config):
    if not isinstance(config, (str, os.PathLike)):
        return config
    path = os.fspath(config)
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        return json.loads(text)
    try:
        import yaml
    except ImportError:
        raise ValueError(f"zeroshard accelerate config: reading {path} needs PyYAML, which is not installed. Fix: "
                         "pip install pyyaml, or pass the config as a dict or a .json file.") from None
    return yaml.safe_load(text)


# What `accelerate launch` exports for FSDP (and scripts set by hand): the variable for each field.
ENVIRONMENT = {"fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
               "mixed_precision": "ACCELERATE_MIXED_PRECISION",
               **{k: k.upper() for k in KNOWN if k.startswith("fsdp_") and k != "fsdp_transformer_layer_cls_to_wrap"}}
# Accelerate's FullyShardedDataParallelPlugin where a variable is unset (the launcher sets them all).
ENVIRONMENT_DEFAULTS = {"fsdp_use_orig_params": False, "fsdp_cpu_ram_efficient_loading": False, "fsdp_min_num_params": 0,
                        "fsdp_sync_module_states": False}


def _from_environment(environ) -> dict:
    """The ``FSDP_*`` variables ``accelerate launch`` exports, as fsdp_config fields."""
    if not _bool("ACCELERATE_USE_FSDP", environ.get("ACCELERATE_USE_FSDP", "false")):
        raise ValueError("zeroshard accelerate config: no config was given and ACCELERATE_USE_FSDP is not true in the "
                         "environment (the script was not started by `accelerate launch` with FSDP). Fix: pass the "
                         "config (a dict or a YAML/JSON path), or launch with `accelerate launch --use_fsdp ...`.")
    fsdp = {k: environ[v] for k, v in ENVIRONMENT.items() if environ.get(v, "").strip()}
    # FSDP1's plugin reads FSDP_SHARDING_STRATEGY (FULL_SHARD when unset) and never FSDP_RESHARD_AFTER_FORWARD,
    # which the launcher always exports too ("true" by default, whatever the strategy).
    fsdp.pop("fsdp_reshard_after_forward", None)
    return {**ENVIRONMENT_DEFAULTS, **fsdp}


def from_accelerate_config(config=None, model: nn.Module | None = None) -> FSDPKwargs:
    """Keyword arguments for ``zeroshard.FullyShardedDataParallel`` from an Accelerate FSDP config.

    ``config=None`` reads the environment ``accelerate launch`` sets up (``ACCELERATE_USE_FSDP``,
    ``FSDP_SHARDING_STRATEGY``, ``FSDP_TRANSFORMER_CLS_TO_WRAP``, ``ACCELERATE_MIXED_PRECISION``, ...),
    with the defaults of Accelerate's ``FullyShardedDataParallelPlugin`` for unset variables.
    ``model`` is needed to resolve ``fsdp_transformer_layer_cls_to_wrap`` class names.
    """
    config = _from_environment(os.environ) if config is None else _read(config)
    if not isinstance(config, dict):
        raise ValueError(f"zeroshard accelerate config: expected a mapping, got {type(config).__name__}. "
                         "Fix: pass the fsdp_config dict, a whole accelerate config dict, or a YAML/JSON path.")
    if "fsdp_config" not in config and "distributed_type" not in config:
        fsdp = _prefixed(config)
    else:  # a whole accelerate config file
        _refuse_unknown(config, CONFIG_FILE_KEYS, "top-level key (Accelerate's config files have none such)")
        kind = config.get("distributed_type", "FSDP")
        if str(kind).upper() != "FSDP":
            raise _bad("distributed_type", kind, '"FSDP" (this config is for another backend)')
        section = config.get("fsdp_config") or {}
        if not isinstance(section, dict):
            raise _bad("fsdp_config", section, "a mapping of fsdp_* fields (fsdp_sharding_strategy: FULL_SHARD, ...)")
        fsdp = _prefixed(section)
        mp = config.get("mixed_precision")
        if mp is None and "mixed_precision" not in config and config.get("fp16"):
            mp = "fp16"  # the legacy top-level `fp16: true`, which Accelerate reads as mixed_precision: fp16
        if mp is not None:
            fsdp.setdefault("mixed_precision", mp)
    if str(fsdp.get("fsdp_version", 1)) != "1":
        raise _bad("fsdp_version", fsdp["fsdp_version"], "1 (zeroshard implements FSDP1's API; FSDP2 is not supported)")
    if _bool("fsdp_activation_checkpointing_offload", fsdp.get("fsdp_activation_checkpointing_offload", False)):
        raise _bad("fsdp_activation_checkpointing_offload", fsdp["fsdp_activation_checkpointing_offload"],
                   "false (Accelerate allows it with fsdp_version 2 and activation checkpointing only, neither here)")
    if _bool("fsdp_activation_checkpointing", fsdp.get("fsdp_activation_checkpointing", False)):
        raise _bad("fsdp_activation_checkpointing", fsdp["fsdp_activation_checkpointing"],
                   "false (activation checkpointing is not implemented; apply torch.utils.checkpoint in the model)")
    if "fsdp_ignored_modules" in fsdp:
        raise _bad("fsdp_ignored_modules", fsdp["fsdp_ignored_modules"], "no such field here: pass ignored_modules=[...] "
                   "to FullyShardedDataParallel yourself (left out, those modules would be sharded and averaged)")
    kw = FSDPKwargs()
    kw["sharding_strategy"] = _strategy(fsdp)
    prefetch = _one_of(fsdp, "fsdp_backward_prefetch", "fsdp_backward_prefetch_policy", "NO_PREFETCH",
                       lambda key, value: _choice(key, value, PREFETCH))
    kw["backward_prefetch"] = None if prefetch == "NO_PREFETCH" else BackwardPrefetch[prefetch]
    kw["forward_prefetch"] = _bool("fsdp_forward_prefetch", fsdp.get("fsdp_forward_prefetch", False))
    kw["auto_wrap_policy"] = _wrap_policy(fsdp, model)
    kw["use_orig_params"] = _bool("fsdp_use_orig_params", fsdp.get("fsdp_use_orig_params", True))
    kw["sync_module_states"] = _bool("fsdp_sync_module_states", fsdp.get("fsdp_sync_module_states", True))
    kw.cpu_ram_efficient_loading = _bool("fsdp_cpu_ram_efficient_loading", fsdp.get("fsdp_cpu_ram_efficient_loading", True))
    if kw.cpu_ram_efficient_loading and not kw["sync_module_states"]:
        warnings.warn("zeroshard accelerate config: fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states "
                      "(ranks other than 0 load no weights); setting sync_module_states=True, as Accelerate does.", stacklevel=2)
        kw["sync_module_states"] = True
    kw["cpu_offload"] = CPUOffload(offload_params=_bool("fsdp_offload_params", fsdp.get("fsdp_offload_params", False)))
    kw.state_dict_type = StateDictType[_choice("fsdp_state_dict_type", fsdp.get("fsdp_state_dict_type", "FULL_STATE_DICT"), STATE_DICT_TYPES)]
    # As Accelerate's plugin pairs them: full dicts on rank 0 only, in CPU memory; sharded ones in CPU memory.
    if kw.state_dict_type == StateDictType.FULL_STATE_DICT:
        kw.state_dict_config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        kw.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    elif kw.state_dict_type == StateDictType.SHARDED_STATE_DICT:
        kw.state_dict_config = ShardedStateDictConfig(offload_to_cpu=True)
        kw.optim_state_dict_config = ShardedOptimStateDictConfig(offload_to_cpu=True)
    mp = fsdp.get("mixed_precision", "no")
    mp = "no" if mp is False else str(mp).strip().lower()  # YAML reads an unquoted `no` as false (Accelerate maps it back)
    dtypes = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if mp not in dtypes:
        raise _bad("mixed_precision", mp, "bf16, fp16 or no")
    if dtypes[mp] is not None:
        d = dtypes[mp]
        kw["mixed_precision"] = MixedPrecision(param_dtype=d, reduce_dtype=d, buffer_dtype=d)
    return kw


def _refuse_unknown(config: dict, known: set, what: str, read=str) -> None:
    """A key that means nothing (a typo) would be dropped without a word: name it as written, and the closest known
    one. ``read`` gives the name a key is read as (fsdp_config's ``fsdp_`` prefix)."""
    for key in sorted(config, key=str):
        if read(key) not in known:
            close = difflib.get_close_matches(read(key), sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"zeroshard accelerate config: unknown {what} {key!r}. Fix: {hint}correct or remove it "
                             f"(known: {', '.join(sorted(known))}).")


def _prefixed(fsdp: dict) -> dict:
    """``accelerate launch``'s reading of fsdp_config keys: ``fsdp_`` is added where a key lacks ``fsdp``; nulls are dropped."""
    _refuse_unknown(fsdp, KNOWN, "fsdp_config field", _field)
    out = {}
    for key, value in fsdp.items():
        name = _field(key)
        if name in out:
            raise ValueError(f"zeroshard accelerate config: both {key} and {name} are given. Fix: keep one of them.")
        if value is not None:
            out[name] = value
    return out


def _field(key) -> str:
    return str(key) if "fsdp" in str(key) or key == "mixed_precision" else "fsdp_" + str(key)


def _one_of(fsdp: dict, key: str, older: str, default, read):
    """The value of ``key``, else of ``older`` (a second name for it), read by ``read``; the two must agree."""
    values = {k: read(k, fsdp[k]) for k in (key, older) if k in fsdp}
    if len(set(values.values())) > 1:
        raise ValueError(f"zeroshard accelerate config: {key} = {fsdp[key]!r} and {older} = {fsdp[older]!r} say different "
                         f"things. Fix: keep only {key}.")
    return next(iter(values.values()), default)


def _strategy(fsdp: dict) -> ShardingStrategy:
    def read(key, value):
        if key == "fsdp_sharding_strategy" or isinstance(value, str) and value.strip().upper() in STRATEGIES:
            return _choice(key, value, STRATEGIES)
        return "FULL_SHARD" if _bool(key, value) else "SHARD_GRAD_OP"
    names = {k: read(k, fsdp[k]) for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward") if k in fsdp}
    # Both given: they must agree on resharding after forward (HYBRID_SHARD with true is one setup).
    if len({name in ("FULL_SHARD", "HYBRID_SHARD") for name in names.values()}) > 1:
        raise ValueError(f"zeroshard accelerate config: fsdp_sharding_strategy = {fsdp['fsdp_sharding_strategy']!r} and "
                         f"fsdp_reshard_after_forward = {fsdp['fsdp_reshard_after_forward']!r} say different things. "
                         "Fix: keep only fsdp_sharding_strategy.")
    name = names.get("fsdp_sharding_strategy", names.get("fsdp_reshard_after_forward", "FULL_SHARD"))
    return ShardingStrategy["_HYBRID_SHARD_ZERO2" if name == "HYBRID_SHARD_ZERO2" else name]


def _wrap_policy(fsdp: dict, model: nn.Module | None):
    policy = _choice("fsdp_auto_wrap_policy", fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP"), WRAP_POLICIES)
    if policy == "NO_WRAP":
        return None
    if policy == "SIZE_BASED_WRAP":
        n = fsdp.get("fsdp_min_num_params", int(1e8))
        if isinstance(n, bool) or not isinstance(n, int) and not (isinstance(n, str) and n.strip().isdigit()) or int(n) < 0:
            raise _bad("fsdp_min_num_params", n, "an integer >= 0")
        n = int(n)
        return functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=n) if n > 0 else None
    names = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if model is None:
        raise ValueError("zeroshard accelerate config: fsdp_auto_wrap_policy = TRANSFORMER_BASED_WRAP names classes "
                         "that are looked up in the model. Fix: pass model= to from_accelerate_config.")
    if names is None:
        names = getattr(model, "_no_split_modules", None)
        if not names:
            raise _bad("fsdp_transformer_layer_cls_to_wrap", None, "the block class names to wrap, e.g. 'GPT2Block,LlamaDecoderLayer'")
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:  # what `accelerate config` writes when the question is left blank; Accelerate fails on it too
        raise _bad("fsdp_transformer_layer_cls_to_wrap", fsdp["fsdp_transformer_layer_cls_to_wrap"],
                   "the block class names to wrap, e.g. 'GPT2Block,LlamaDecoderLayer' (or leave the field out to "
                   "wrap the model's _no_split_modules)")
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"zeroshard accelerate config: fsdp_transformer_layer_cls_to_wrap names {missing}, which the model "
                         f"does not contain (its module classes: {', '.join(sorted(by_name))}). Fix: use those class names.")
    return functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={by_name[n] for n in names})
