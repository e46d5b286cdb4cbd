"""DeepSpeed's JSON config, the subset people use: parsed, validated, and turned
into an optimizer and an LR scheduler (``deepspeed/runtime/config.py``,
``deepspeed/runtime/lr_schedules.py``).

Honored keys:

* ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``: train_batch = micro x accumulation x world
  size; any two determine the third (as DeepSpeed), one of the first two alone
  implies accumulation 1; values that do not fit raise naming all three.
* ``gradient_clipping`` (0 = off; absent = 1.0, DeepSpeed's default): global
  L2 norm, after unscaling.
* ``optimizer`` {type Adam | AdamW | SGD, params}. As in DeepSpeed, ``Adam``
  is AdamW (decoupled weight decay) unless ``"adam_w_mode": false``, and the
  default ``weight_decay`` is 0 (FusedAdam's), not torch AdamW's 0.01, unless
  ``"torch_adam": true`` asks for torch's optimizer and so its defaults.
* ``scheduler`` {type WarmupLR | WarmupDecayLR | WarmupCosineLR, params}: see
  ``lr_schedules`` (DeepSpeed's formulas, defaults and step counting).
* ``fp16`` {enabled, loss_scale (0 = dynamic), initial_scale_power,
  loss_scale_window, hysteresis, min_loss_scale, consecutive_hysteresis}: see
  ``loss_scale``; ``auto_cast`` (cast floating inputs to fp16 at stages 0/1)
  defaults to true here, false in DeepSpeed (whose users cast inputs
  themselves). ``bf16`` (or ``bfloat16``) {enabled}.
* ``zero_optimization`` {stage 0-3, offload_param / offload_optimizer
  {device: cpu | none}}: see ``engine``. DeepSpeed's older names are read as it
  reads them: ``cpu_offload: true`` / ``cpu_offload_param: true`` are those
  sections with ``device: cpu``, ``param_persistence_threshold`` is
  ``stage3_param_persistence_threshold``.

Mapped onto zeroshard's own knobs at stages 2/3 (``engine``):
``zero_optimization.reduce_bucket_size`` (elements) -> FSDP ``bucket_cap_mb``
(one reduce-scatter for many small units), ``stage3_param_persistence_threshold``
-> ``param_persistence_threshold`` (stage 3; zeroshard applies it per unit, where
DeepSpeed decides per parameter); ZeRO++ at stage 3: ``zero_quantized_weights``
-> ``quantized_all_gather=Int8BlockQuant()`` (qwZ, 256-element blocks),
``zero_hpz_partition_size`` -> ``hpz_group_size`` (hpZ; 1: off).

Accepted, validated, but **not acted on**: ``stage3_prefetch_bucket_size``,
``stage3_max_live_parameters`` (zeroshard prefetches one unit ahead and limits live
units with ``limit_all_gathers``), and ``pin_memory`` inside the offload sections.

``steps_per_print`` and ``wall_clock_breakdown`` are read for their getters
(nothing is printed). torch's own optimizer keywords (``fused``, ``foreach``,
``maximize``...) are handed to the torch optimizer. Any other DeepSpeed key,
and any unknown top-level key (DeepSpeed ignores those), draws one
``warnings.warn`` listing them all (they are ignored); a key DeepSpeed itself
refuses inside ``zero_optimization`` (offload sections included), ``fp16``, ``bf16`` (its pydantic
models), ``optimizer.params`` or ``scheduler.params`` (its constructors'
signatures) is a typo and raises, as there. A wrong type or value raises
``ValueError`` naming the key, the value and the fix. ``"auto"`` values (filled in by the HF Trainer) are
rejected with that explanation.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field

import torch

from .ds_schema import (DS_BF16_KEYS, DS_FP16_EXTRA, DS_OFFLOAD_KEYS, DS_OPTIMIZER_EXTRA, DS_RENAMED,
                        DS_SCHEDULER_EXTRA, DS_ZERO_KEYS)

TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
            "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization", "steps_per_print",
            "wall_clock_breakdown"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
             "consecutive_hysteresis", "auto_cast"}
ZERO_KEYS = {"stage", "offload_param", "offload_optimizer"}
ZERO_MAPPED = {"reduce_bucket_size", "stage3_param_persistence_threshold", "zero_quantized_weights", "zero_hpz_partition_size"}
STAGE3_ONLY = ZERO_MAPPED - {"reduce_bucket_size"}
ZERO_NOT_ACTED_ON = {"stage3_prefetch_bucket_size", "stage3_max_live_parameters"}
OPTIMIZER_PARAMS = {"adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam"},
                    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov"}}
# torch's own keywords, handed to the torch optimizer as given (DeepSpeed's torch_adam / SGD do the same).
OPTIMIZER_TORCH = {"adam": {"maximize", "foreach", "capturable", "differentiable", "fused"},
                   "sgd": {"maximize", "foreach", "differentiable", "fused"}}
SCHEDULER_PARAMS = {"WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
                    "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"},
                    "WarmupCosineLR": {"warmup_min_ratio", "cos_min_ratio", "warmup_num_steps", "warmup_type", "total_num_steps"}}


def _bad(key: str, value, why: str, fix: str) -> ValueError:
    if value == "auto":
        why, fix = "'auto' is filled in by the HF Trainer / Accelerate integration, which zeroshard does not run", "write the value itself"
    return ValueError(f"zeroshard config: {key} = {value!r}: {why}. Fix: {fix}.")


def _int(key, value, minimum=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(key, value, f"expected an integer >= {minimum}", f"write an integer >= {minimum} (a JSON number, not a string)")
    return value


def _number(key, value, minimum=0.0):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise _bad(key, value, f"expected a number >= {minimum}", f"write a number >= {minimum} (a JSON number, not a string)")
    return float(value)


def _bool(key, value):
    if not isinstance(value, bool):
        raise _bad(key, value, "expected true or false", "write true or false (a JSON boolean, not a string)")
    return value


def _section(key, value) -> dict:
    if not isinstance(value, dict):
        raise _bad(key, value, "expected an object", f'write "{key}": {{...}}')
    return value


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False
    auto_cast: bool = True


@dataclass
class ZeroConfig:
    stage: int = 0
    offload_param: bool = False
    offload_optimizer: bool = False
    mapped: dict = field(default_factory=dict)  # reduce_bucket_size etc.: become FSDP keywords (engine)
    not_acted_on: dict = field(default_factory=dict)  # present keys zeroshard accepts but ignores


@dataclass
class DeepSpeedConfig:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 1.0  # DeepSpeed's GRADIENT_CLIPPING_DEFAULT
    optimizer: dict | None = None  # {"type": "adam"|"sgd", "adamw": bool, "params": {...}}
    scheduler: dict | None = None  # {"type": "WarmupLR"|"WarmupDecayLR", "params": {...}}
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: bool = False
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    raw: dict = field(default_factory=dict)
    steps_per_print: int = 10  # DeepSpeed's default; zeroshard prints nothing per step
    wall_clock_breakdown: bool = False

    @property
    def low_precision_dtype(self) -> torch.dtype | None:
        return torch.float16 if self.fp16.enabled else torch.bfloat16 if self.bf16 else None


class ConfigGetters:
    """DeepSpeedEngine's getters of its config (mixed into ``engine.Engine``, whose
    ``config`` is a :class:`DeepSpeedConfig`)."""

    config: DeepSpeedConfig

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        """Read and reported; zeroshard prints no timing breakdown (see ``zeroshard.trace``)."""
        return self.config.wall_clock_breakdown

    def loss_scale(self) -> float:
        """The config's static fp16 loss scale, 0 for dynamic (DeepSpeed's; the
        running scale is ``engine.loss_scaler.loss_scale``)."""
        return self.config.fp16.loss_scale


def load_config(config, world_size: int) -> DeepSpeedConfig:
    """Parse a config dict or a JSON file path and validate it for ``world_size`` ranks."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"zeroshard config: expected a dict or a path to a JSON file, got {type(config).__name__}. "
                         "Fix: pass config={...} or config='ds_config.json'.")
    unknown = [k for k in config if k not in TOP_KEYS]  # DeepSpeed ignores unknown top-level keys: a warning
    micro, accum, train = _batch_sizes(config, world_size)
    cfg = DeepSpeedConfig(train, micro, accum, raw=dict(config))
    cfg.steps_per_print = _int("steps_per_print", config.get("steps_per_print", 10), 1)
    cfg.wall_clock_breakdown = _bool("wall_clock_breakdown", config.get("wall_clock_breakdown", False))
    cfg.gradient_clipping = _number("gradient_clipping", config.get("gradient_clipping", 1.0))
    if config.get("optimizer") is not None:
        cfg.optimizer = _optimizer(_section("optimizer", config["optimizer"]), unknown)
    if config.get("scheduler") is not None:
        cfg.scheduler = _scheduler(_section("scheduler", config["scheduler"]), unknown)
    fp16 = _section("fp16", config.get("fp16", {}))
    _sort_out("fp16", [k for k in fp16 if k not in FP16_KEYS], FP16_KEYS | DS_FP16_EXTRA, unknown)
    cfg.fp16 = FP16Config(
        enabled=_bool("fp16.enabled", fp16.get("enabled", False)),
        loss_scale=_number("fp16.loss_scale", fp16.get("loss_scale", 0.0)),
        initial_scale_power=_int("fp16.initial_scale_power", fp16.get("initial_scale_power", 16)),
        loss_scale_window=_int("fp16.loss_scale_window", fp16.get("loss_scale_window", 1000), 1),
        hysteresis=_int("fp16.hysteresis", fp16.get("hysteresis", 2), 1),
        min_loss_scale=_number("fp16.min_loss_scale", fp16.get("min_loss_scale", 1.0)),
        consecutive_hysteresis=_bool("fp16.consecutive_hysteresis", fp16.get("consecutive_hysteresis", False)),
        auto_cast=_bool("fp16.auto_cast", fp16.get("auto_cast", True)),
    )
    if cfg.fp16.initial_scale_power > 127:  # the loss is scaled in fp32, where 2**128 is inf
        raise _bad("fp16.initial_scale_power", fp16["initial_scale_power"], "2**power must be a finite fp32 number "
                   "(the loss is scaled in fp32; 2**128 and up are inf, every step would be skipped)",
                   "write at most 127 (DeepSpeed's default is 16)")
    if cfg.fp16.min_loss_scale <= 0:
        raise _bad("fp16.min_loss_scale", fp16["min_loss_scale"], "the scale must stay positive", "use e.g. 1")
    if "bf16" in config and "bfloat16" in config:
        raise _bad("bfloat16", config["bfloat16"], '"bf16" and its alias "bfloat16" are both given', "keep one of them")
    bf16_key = "bfloat16" if "bfloat16" in config else "bf16"
    bf16 = _section(bf16_key, config.get(bf16_key, {}))
    _sort_out(bf16_key, [k for k in bf16 if k != "enabled"], DS_BF16_KEYS, unknown)
    cfg.bf16 = _bool(f"{bf16_key}.enabled", bf16.get("enabled", False))
    if cfg.bf16 and cfg.fp16.enabled:
        raise _bad("fp16.enabled", True, f'"fp16" and "{bf16_key}" cannot both be enabled', "enable one of them")
    cfg.zero = _zero(_section("zero_optimization", config.get("zero_optimization", {})), unknown)
    if unknown:
        warnings.warn(f"zeroshard config: keys ignored: {', '.join(repr(k) for k in unknown)}. zeroshard reads only "
                      "the DeepSpeed keys listed in zeroshard/ds_config.py (top-level keys DeepSpeed does not know "
                      "either may be typos).", stacklevel=3)
    return cfg


def _sort_out(section: str, keys: list, deepspeed_keys: set, unknown: list) -> list:
    """``keys`` of ``section`` that zeroshard does not read: any that is not
    DeepSpeed's own is a typo, refused as DeepSpeed refuses it; the others go
    on ``unknown`` (ignored with a warning) and are returned."""
    typos = [k for k in keys if k not in deepspeed_keys]
    if typos:
        raise ValueError(f"zeroshard config: unknown key(s) {', '.join(repr(f'{section}.{k}') for k in typos)}: DeepSpeed "
                         f"refuses them too. Fix: check the spelling; the keys zeroshard reads there are listed in "
                         "zeroshard/ds_config.py.")
    unknown += [f"{section}.{k}" for k in keys]
    return keys


def _batch_sizes(config: dict, world: int) -> tuple[int, int, int]:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train, micro, accum = (None if config.get(k) is None else _int(k, config[k], 1) for k in names)
    given = f"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, gradient_accumulation_steps={accum}"
    if train is None and micro is None:
        raise ValueError(f"zeroshard config: {given}: one of train_batch_size and train_micro_batch_size_per_gpu is "
                         "required. Fix: give train_micro_batch_size_per_gpu (and gradient_accumulation_steps).")
    if train is not None and micro is None:
        accum = accum or 1
        micro = train // (accum * world)
    elif train is not None and accum is None:
        accum = train // (micro * world)
    accum = accum or 1
    if train is None:
        train = micro * accum * world
    if micro < 1 or accum < 1 or train != micro * accum * world:
        raise ValueError(
            f"zeroshard config: {given} do not fit {world} ranks: train_batch_size must equal "
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size "
            f"({micro} x {accum} x {world} = {micro * accum * world}). Fix: give two of the three and let zeroshard "
            "derive the third, or make the product exact.")
    return micro, accum, train


def _optimizer(sec: dict, unknown: list) -> dict:
    unknown += [f"optimizer.{k}" for k in sec if k not in ("type", "params")]
    name = sec.get("type")
    kind = name.lower() if isinstance(name, str) else None
    if kind not in ("adam", "adamw", "sgd"):
        raise _bad("optimizer.type", name, "zeroshard builds Adam, AdamW and SGD", 'use "Adam", "AdamW" or "SGD" (or pass optimizer=... to initialize)')
    params = dict(_section("optimizer.params", sec.get("params", {})))
    family = "sgd" if kind == "sgd" else "adam"
    allowed = OPTIMIZER_PARAMS[family] | OPTIMIZER_TORCH[family]
    ignored = _sort_out("optimizer.params", [k for k in params if k not in allowed], allowed | DS_OPTIMIZER_EXTRA[family],
                        unknown)
    if params.get("bias_correction", True) is not True:
        raise _bad("optimizer.params.bias_correction", params["bias_correction"], "zeroshard's Adam always corrects the "
                   "bias (torch's Adam/AdamW)", "drop the key")
    for k in ignored:
        del params[k]
    for k in ("lr", "eps", "weight_decay", "momentum", "dampening"):
        if k in params:
            params[k] = _number(f"optimizer.params.{k}", params[k])
    if "betas" in params:
        b = params["betas"]
        if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(isinstance(x, (int, float)) and 0 <= x < 1 for x in b)):
            raise _bad("optimizer.params.betas", b, "expected two numbers in [0, 1)", "write e.g. [0.9, 0.999]")
        params["betas"] = tuple(float(x) for x in b)
    for k in ("amsgrad", "adam_w_mode", "torch_adam", "nesterov"):
        if k in params:
            _bool(f"optimizer.params.{k}", params[k])
    adamw = kind == "adamw" or (kind == "adam" and params.pop("adam_w_mode", True))
    params.pop("adam_w_mode", None)
    torch_adam = bool(params.pop("torch_adam", False))
    if kind == "sgd" and "lr" not in params:
        raise _bad("optimizer.params.lr", None, "SGD needs a learning rate", 'add "lr" to optimizer.params')
    return {"type": "sgd" if kind == "sgd" else "adam", "adamw": adamw, "torch_adam": torch_adam, "params": params}


def build_optimizer(spec: dict, param_groups) -> torch.optim.Optimizer:
    """The torch optimizer a parsed ``optimizer`` section describes, over ``param_groups``."""
    params = dict(spec["params"])
    if spec["type"] == "sgd":
        return torch.optim.SGD(param_groups, **params)
    params.setdefault("lr", 1e-3)
    if not spec.get("torch_adam"):  # DeepSpeed's FusedAdam default, also for "AdamW"; torch_adam: torch's defaults
        params.setdefault("weight_decay", 0.0)
    return (torch.optim.AdamW if spec["adamw"] else torch.optim.Adam)(param_groups, **params)


def _scheduler(sec: dict, unknown: list) -> dict:
    unknown += [f"scheduler.{k}" for k in sec if k not in ("type", "params")]
    kind = sec.get("type")
    if kind not in SCHEDULER_PARAMS:
        raise _bad("scheduler.type", kind, "zeroshard implements DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR",
                   'use one of them (or pass lr_scheduler=... to initialize)')
    params = dict(_section("scheduler.params", sec.get("params", {})))
    ignored = _sort_out("scheduler.params", [k for k in params if k not in SCHEDULER_PARAMS[kind]],
                        SCHEDULER_PARAMS[kind] | DS_SCHEDULER_EXTRA, unknown)
    if params.get("last_batch_iteration", -1) != -1:
        raise _bad("scheduler.params.last_batch_iteration", params["last_batch_iteration"], "zeroshard's schedulers "
                   "start at the beginning (a resumed run restores their position from the checkpoint)", "drop the key")
    for k in ignored:
        del params[k]
    for k in ("warmup_min_lr", "warmup_max_lr", "warmup_min_ratio", "cos_min_ratio"):
        if isinstance(params.get(k), list) and k.endswith("_lr"):  # one per param group, as DeepSpeed allows
            params[k] = [_number(f"scheduler.params.{k}[{j}]", v) for j, v in enumerate(params[k])]
        elif params.get(k) is not None:
            params[k] = _number(f"scheduler.params.{k}", params[k])
    # 0 and 1 mean 2 (DeepSpeed's max(2, n)): HF Trainer writes 0 for "no warmup"
    params["warmup_num_steps"] = _int("scheduler.params.warmup_num_steps", params.get("warmup_num_steps", 1000))
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise _bad("scheduler.params.warmup_type", params["warmup_type"], "expected 'log' or 'linear'", 'write "log" or "linear"')
    if kind != "WarmupLR":
        if "total_num_steps" not in params:
            raise _bad("scheduler.params.total_num_steps", None, f"{kind} needs the total number of steps", 'add "total_num_steps"')
        params["total_num_steps"] = _int("scheduler.params.total_num_steps", params["total_num_steps"], 1)
    return {"type": kind, "params": params}


def _renamed(sec: dict) -> dict:
    """``sec`` with DeepSpeed's older names read as it reads them: ``cpu_offload: true`` is
    ``offload_optimizer: {device: cpu}``, ``cpu_offload_param`` the same for ``offload_param``,
    and ``param_persistence_threshold`` is ``stage3_param_persistence_threshold``."""
    sec = dict(sec)
    for old, new in DS_RENAMED.items():
        if sec.get(old) is None:  # null: DeepSpeed's default for the deprecated flags
            sec.pop(old, None)
            continue
        written = sec.pop(old)
        if new.startswith("offload"):
            value = {"device": "cpu"} if _bool(f"zero_optimization.{old}", written) else None
        else:  # checked under the name written
            value = _number(f"zero_optimization.{old}", written)
        if sec.get(new) is not None and sec[new] != value:
            raise _bad(f"zero_optimization.{old}", written, f"it is an older name of {new}, which is "
                       f"given too with another value ({sec[new]!r})", f"keep only {new}")
        if sec.get(new) is None:
            sec[new] = value
    return sec


def _zero(sec: dict, unknown: list) -> ZeroConfig:
    sec = _renamed(sec)
    zero = ZeroConfig(stage=sec.get("stage", 0))
    if isinstance(zero.stage, bool) or not isinstance(zero.stage, int) or zero.stage not in (0, 1, 2, 3):
        raise _bad("zero_optimization.stage", zero.stage, "ZeRO stages are 0, 1, 2 and 3", "write 0, 1, 2 or 3")
    for name in ("offload_param", "offload_optimizer"):
        if sec.get(name) is None:
            continue
        off = _section(f"zero_optimization.{name}", sec[name])
        _sort_out(f"zero_optimization.{name}", [k for k in off if k not in ("device", "pin_memory")], DS_OFFLOAD_KEYS[name],
                  unknown)
        device = off.get("device", "none")
        if device not in ("cpu", "none"):
            why = ("zeroshard offloads to CPU only (no NVMe)" if device == "nvme" else
                   'DeepSpeed\'s offload devices are "cpu", "nvme" and "none", in lower case; zeroshard offloads to "cpu"')
            raise _bad(f"zero_optimization.{name}.device", device, why, 'write "cpu" or "none"')
        setattr(zero, name, device == "cpu")
    if zero.offload_param and zero.stage != 3:
        raise _bad("zero_optimization.offload_param.device", "cpu", f"parameter offload needs ZeRO stage 3 (stage is {zero.stage})",
                   'set "stage": 3 or use offload_optimizer')
    if zero.offload_optimizer and zero.stage == 0:
        raise _bad("zero_optimization.offload_optimizer.device", "cpu", "optimizer offload needs ZeRO stage 1, 2 or 3",
                   'set "stage" to 1, 2 or 3')
    for k in sorted(ZERO_MAPPED & set(sec)):
        key = f"zero_optimization.{k}"
        zero.mapped[k] = (_bool(key, sec[k]) if k == "zero_quantized_weights" else
                          _int(key, sec[k], minimum=1) if k == "zero_hpz_partition_size" else _number(key, sec[k]))
    asks_nothing = {("zero_quantized_weights", False), ("zero_hpz_partition_size", 1)}
    inert = [k for k, v in sorted(zero.mapped.items()) if zero.stage < 3 and k in STAGE3_ONLY and (k, v) not in asks_nothing]
    if inert:  # ZeRO++ and persistence act on stage 3's sharded parameters
        warnings.warn(f"zeroshard config: {', '.join(repr('zero_optimization.' + k) for k in inert)} act at ZeRO stage 3 "
                      f"only; at stage {zero.stage} they are ignored.", stacklevel=4)
    for k in sorted(ZERO_NOT_ACTED_ON & set(sec)):
        zero.not_acted_on[k] = _number(f"zero_optimization.{k}", sec[k])
    _sort_out("zero_optimization", [k for k in sec if k not in ZERO_KEYS | ZERO_MAPPED | ZERO_NOT_ACTED_ON], DS_ZERO_KEYS,
              unknown)
    return zero
