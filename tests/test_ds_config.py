"""Configs people bring from DeepSpeed and Accelerate: the DeepSpeed JSON subset
(batch-size arithmetic, validation messages, unknown-key warnings, optimizer
and LR-schedule construction), the loss scalers' rules on their own, and
Accelerate's fsdp_config turned into FullyShardedDataParallel keywords that
train exactly like a hand-written wrap."""
from __future__ import annotations

import copy
import json
import math
import os
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zeroshard as zs
from models import Block, batch, build
from zeroshard import ds_config
from zeroshard.accelerate_config import from_accelerate_config
from zeroshard.ds_config import build_optimizer, load_config
from zeroshard.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler
from zeroshard.loss_scale import DynamicLossScaler, StaticLossScaler, has_overflow, unscale_

MICRO = {"train_micro_batch_size_per_gpu": 4}


# ------------------------------------------------------------------ batch sizes
@given(micro=st.integers(1, 64), accum=st.integers(1, 16), world=st.integers(1, 64),
       given_keys=st.sampled_from([(0, 1), (0, 2), (1, 2), (0, 1, 2)]))
def test_any_two_batch_sizes_determine_the_third(micro, accum, world, given_keys):
    names = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
    values = [micro * accum * world, micro, accum]
    cfg = load_config({names[i]: values[i] for i in given_keys}, world)
    assert [cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps] == values


@pytest.mark.parametrize("given,world,expected", [
    ({"train_batch_size": 32}, 2, (32, 16, 1)),  # DeepSpeed: accumulation 1
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
])
def test_one_batch_size_implies_no_accumulation(given, world, expected):
    cfg = load_config(given, world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("given,match", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     r"train_batch_size=30, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2 do not fit 2 ranks.*\(4 x 2 x 2 = 16\)"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
     r"train_batch_size=30, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=None do not fit 2 ranks.*\(4 x 3 x 2 = 24\)"),
    ({"train_batch_size": 6, "gradient_accumulation_steps": 4},
     r"train_batch_size=6, train_micro_batch_size_per_gpu=None, gradient_accumulation_steps=4 do not fit 2 ranks.*\(0 x 4 x 2 = 0\)"),
    ({"gradient_accumulation_steps": 4}, r"one of train_batch_size and train_micro_batch_size_per_gpu is required"),
])
def test_batch_sizes_that_do_not_fit_name_all_three(given, match):
    with pytest.raises(ValueError, match=match):
        load_config(given, 2)


# ------------------------------------------------------------------- validation
BAD = [
    ({"gradient_accumulation_steps": "2"}, r"gradient_accumulation_steps = '2': expected an integer >= 1.*not a string"),
    ({"train_micro_batch_size_per_gpu": "auto"}, r"= 'auto': 'auto' is filled in by the HF Trainer.*write the value itself"),
    ({"gradient_clipping": -1.0}, r"gradient_clipping = -1.0: expected a number >= 0.0"),
    ({"optimizer": {"type": "Lamb"}}, r"optimizer.type = 'Lamb': zeroshard builds Adam, AdamW and SGD"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, r"optimizer.params.betas = \[0.9\]: expected two numbers"),
    ({"optimizer": {"type": "Adam", "params": {"lr": "1e-3"}}}, r"optimizer.params.lr = '1e-3': expected a number"),
    ({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}, r"optimizer.params.lr = None: SGD needs a learning rate"),
    ({"optimizer": "Adam"}, r"optimizer = 'Adam': expected an object"),
    ({"scheduler": {"type": "OneCycle"}}, r"scheduler.type = 'OneCycle': zeroshard implements DeepSpeed's WarmupLR"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, r"warmup_type = 'cosine': expected 'log' or 'linear'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}}, r"warmup_num_steps = -1: expected an integer >= 0"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, "x"]}}}, r"warmup_max_lr\[1\] = 'x'"),
    ({"fp16": {"initial_scale_power": 128}}, r"initial_scale_power = 128: 2\*\*power must be a finite fp32.*at most 127"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, r"total_num_steps = None: WarmupDecayLR needs the total"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, r"total_num_steps = None: WarmupCosineLR needs the total"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": "x"}}},
     r"cos_min_ratio = 'x'"),
    ({"fp16": {"enabled": "true"}}, r"fp16.enabled = 'true': expected true or false.*JSON boolean"),
    ({"fp16": True}, r"fp16 = True: expected an object"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"\"fp16\" and \"bf16\" cannot both be enabled"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, r"both given.*keep one"),
    ({"fp16": {"hysteresis": 0}}, r"fp16.hysteresis = 0: expected an integer >= 1"),
    ({"fp16": {"loss_scale_window": 1.5}}, r"fp16.loss_scale_window = 1.5: expected an integer"),
    ({"fp16": {"min_loss_scale": 0}}, r"fp16.min_loss_scale = 0: the scale must stay positive"),
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage = 4: ZeRO stages are 0, 1, 2 and 3"),
    ({"zero_optimization": {"stage": "3"}}, r"zero_optimization.stage = '3'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, r"offload_param.device = 'nvme': zeroshard offloads to CPU only"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "CPU"}}}, r"offload_param.device = 'CPU': DeepSpeed's offload devices are \"cpu\", \"nvme\" and \"none\", in lower case"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}}}, r"zero_optimization.cpu_offload = True: it is an older name of offload_optimizer, which is given too with another value \({'device': 'none'}\)"),
    ({"zero_optimization": {"stage": 3, "param_persistence_threshold": 10, "stage3_param_persistence_threshold": 20}}, r"zero_optimization.param_persistence_threshold = 10: it is an older name of stage3_param_persistence_threshold"),
    ({"zero_optimization": {"stage": 3, "param_persistence_threshold": -5}}, r"zero_optimization.param_persistence_threshold = -5"),
    ({"zero_optimization": {"stage": 3, "cpu_offload_param": "yes"}}, r"zero_optimization.cpu_offload_param = 'yes': expected true or false"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, r"parameter offload needs ZeRO stage 3 \(stage is 2\)"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, r"optimizer offload needs ZeRO stage 1, 2 or 3"),
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, r"zero_optimization.reduce_bucket_size = '5e8': expected a number"),
    ({"zero_optimization": {"zero_hpz_partition_size": 0}}, r"zero_optimization.zero_hpz_partition_size = 0: expected an integer >= 1"),
    ({"zero_optimization": {"zero_quantized_weights": "true"}}, r"zero_optimization.zero_quantized_weights = 'true': expected true or false"),
]


@pytest.mark.parametrize("bad,match", BAD)
def test_bad_values_name_key_value_and_fix(bad, match):
    with pytest.raises(ValueError, match=match) as info:
        load_config({**MICRO, **bad}, 1)
    assert "Fix:" in str(info.value)


def test_config_must_be_a_dict_or_json_path(tmp_path):
    with pytest.raises(ValueError, match="expected a dict or a path to a JSON file, got list"):
        load_config([1], 1)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**MICRO, "zero_optimization": {"stage": 3}}))
    assert load_config(str(path), 2).zero.stage == 3


def test_deepspeed_keys_not_acted_on_warn_listing_all_of_them():
    cfg = {**MICRO, "steps_per_print": 10, "prescale_gradients": False,
           "fp16": {"enabled": True, "auto_cast": False, "fp16_master_weights_and_grads": False},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "set_grad_none": True, "fused": False}},
           "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1}},
           "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu", "buffer_count": 4}}}
    with pytest.warns(UserWarning, match=r"keys ignored: 'prescale_gradients', 'optimizer.params.set_grad_none', "
                                         r"'scheduler.params.last_batch_iteration', 'fp16.fp16_master_weights_and_grads', "
                                         r"'zero_optimization.offload_optimizer.buffer_count', "
                                         r"'zero_optimization.overlap_comm'"):
        parsed = load_config(cfg, 1)
    assert parsed.optimizer["params"] == {"lr": 1e-3, "fused": False}  # torch's own keyword reaches torch's AdamW
    assert parsed.zero.offload_optimizer and not parsed.fp16.auto_cast and parsed.steps_per_print == 10


@pytest.mark.parametrize("section, bad", [
    ("zero_optimization", {"zero_optimization": {"stage": 2, "overlap_com": True}}),
    ("bf16", {"bf16": {"enabled": True, "bogus": 1}}),
    ("fp16", {"fp16": {"enabled": True, "fp16_master": 1}}),
    ("optimizer.params", {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1}}}),
    ("optimizer.params", {"optimizer": {"type": "SGD", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}),
    ("scheduler.params", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max": 0.1}}}),
    # A typo here left offload off with only a warning (DeepSpeed's offload models forbid extra keys too).
    ("zero_optimization.offload_optimizer", {"zero_optimization": {"stage": 2, "offload_optimizer": {"devcie": "cpu"}}}),
    ("zero_optimization.offload_param", {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}}),
])
def test_typos_in_sections_deepspeed_validates_are_refused(section, bad):
    """DeepSpeed refuses these (pydantic "Extra inputs are not permitted", or a
    TypeError from the optimizer's or scheduler's constructor); zeroshard warned
    and trained without them, e.g. with no weight decay at all."""
    with pytest.raises(ValueError, match=rf"unknown key\(s\) '{section}\.\w+': DeepSpeed refuses them too"):
        load_config({**MICRO, **bad}, 1)


def test_older_deepspeed_names_are_read_as_deepspeed_reads_them():
    """cpu_offload / cpu_offload_param (deprecated) and param_persistence_threshold (the field behind the
    stage3_ alias) were accepted as known and then ignored: no offload, no persistence."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        two = load_config({**MICRO, "zero_optimization": {"stage": 2, "cpu_offload": True}}, 1)
        three = load_config({**MICRO, "zero_optimization": {"stage": 3, "cpu_offload_param": True, "cpu_offload": True,
                                                            "param_persistence_threshold": 1000}}, 1)
        off = load_config({**MICRO, "zero_optimization": {"stage": 3, "cpu_offload_param": False, "cpu_offload": None}}, 1)
        same = load_config({**MICRO, "zero_optimization": {"stage": 3, "param_persistence_threshold": 10,
                                                           "stage3_param_persistence_threshold": 10,
                                                           "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}, 1)
    assert same.zero.mapped == {"stage3_param_persistence_threshold": 10} and same.zero.offload_optimizer
    assert two.zero.offload_optimizer and not two.zero.offload_param
    assert three.zero.offload_param and three.zero.offload_optimizer
    assert three.zero.mapped == {"stage3_param_persistence_threshold": 1000}
    assert not off.zero.offload_param and not off.zero.offload_optimizer
    with pytest.raises(ValueError, match="parameter offload needs ZeRO stage 3"):  # checked as the new name is
        load_config({**MICRO, "zero_optimization": {"stage": 2, "cpu_offload_param": True}}, 1)


def test_keys_accepted_but_not_acted_on_are_documented_and_recorded():
    mapped = {"reduce_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e5}
    ignored = {"stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accepted: no unknown-key warning
        cfg = load_config({**MICRO, "zero_optimization": {"stage": 3, **mapped, **ignored}}, 1)
    assert cfg.zero.mapped == mapped and cfg.zero.not_acted_on == ignored
    doc = " ".join(ds_config.__doc__.split())
    assert "not acted on" in doc and all(k in doc for k in {**mapped, **ignored})


# ------------------------------------------------------------ optimizer, schedule
@pytest.mark.parametrize("section,cls,expected", [
    ({"type": "Adam", "params": {"lr": 0.1}}, torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.0}),  # DeepSpeed: adam_w_mode
    ({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1}),
    ({"type": "AdamW", "params": {"betas": [0.8, 0.9], "eps": 1e-6, "torch_adam": True}}, torch.optim.AdamW,
     {"betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01}),  # torch_adam: torch's AdamW default
    ({"type": "AdamW", "params": {"lr": 0.1}}, torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.0}),  # FusedAdam's
    ({"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9, "nesterov": True}}, torch.optim.SGD,
     {"lr": 0.5, "momentum": 0.9, "nesterov": True}),
])
def test_optimizer_section_builds_deepspeeds_optimizer(section, cls, expected):
    spec = load_config({**MICRO, "optimizer": section}, 1).optimizer
    opt = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(3))])
    assert type(opt) is cls
    assert {k: opt.defaults[k] for k in expected} == expected


def _lrs(sched, steps):
    out = [sched.get_last_lr()[0]]
    for _ in range(steps):
        sched.step()
        out.append(sched.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_schedules_follow_deepspeeds_formulas():
    opt = lambda: torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)  # noqa: E731
    # lr before the first step is min_lr; after k steps it is that of iteration k - 1.
    log = _lrs(WarmupLR(opt(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10), 12)
    assert log == pytest.approx([0.1, 0.1] + [0.1 + math.log(i + 1) / math.log(10) for i in range(1, 10)] + [1.1, 1.1])
    linear = _lrs(WarmupLR(opt(), warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear"), 6)
    assert linear == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
    assert _lrs(WarmupLR(opt(), warmup_num_steps=2, warmup_type="linear"), 3)[-1] == 0.5  # max_lr: the optimizer's lr
    # ... each param group's own lr (DeepSpeed's is group 0's for all, and so was this: a second group at
    # 10x trained 10x too slowly; a documented difference)
    groups = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (1e-3, 1e-2)])
    two = WarmupLR(groups, warmup_num_steps=4, warmup_type="linear")
    for _ in range(5):
        two.step()
    assert [g["lr"] for g in groups.param_groups] == two.get_last_lr() == [1e-3, 1e-2]
    decay = WarmupDecayLR(opt(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    lrs = _lrs(decay, 22)
    assert lrs[11] == pytest.approx(1.0) and lrs[16] == pytest.approx(0.5) and lrs[21] == lrs[22] == 0.0
    fresh = WarmupDecayLR(opt(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    fresh.load_state_dict(decay.state_dict())
    assert fresh.get_last_lr() == decay.get_last_lr()
    # WarmupDecayLR's max_lr defaults to 0.001, not the optimizer's lr as WarmupLR's does
    assert _lrs(WarmupDecayLR(opt(), total_num_steps=20, warmup_num_steps=2, warmup_type="linear"), 3)[-1] == 0.001


def test_no_warmup_and_per_group_lrs_load_as_deepspeed_reads_them():
    """warmup_num_steps 0 (what the HF Trainer writes for no warmup) was refused; DeepSpeed warms up
    over max(2, n) steps. A list of warmup lrs, one per param group, was refused by the config."""
    cfg = {**MICRO, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0, "warmup_type": "linear",
                                                                  "warmup_min_lr": [0.0, 0.0], "warmup_max_lr": [1.0, 4.0]}}}
    spec = load_config(cfg, 1).scheduler
    groups = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 9.0} for _ in range(2)])
    sched = build_scheduler(spec, groups)
    seen = []
    for _ in range(3):
        sched.step()
        seen.append([g["lr"] for g in groups.param_groups])
    assert seen == [[0.0, 0.0], [0.5, 2.0], [1.0, 4.0]]  # i / 2 for i = 0, 1, then the max


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_follows_deepspeeds_formula(warmup_type):
    """DeepSpeed's WarmupCosineLR, written out here in its order of operations
    (so the comparison is exact): a ratio of the lr at construction, 0 before
    the first step."""
    lo, end, lr = 0.1, 0.01, 0.5
    # (pi * (step / steps), as this was, rounds the half cosine differently from DeepSpeed's
    # pi * step / steps at 31 of the (150, 13) schedule's 141 steps from n on, none of (20, 5)'s)
    for total, n in ((20, 5), (150, 13)):
        def ratio(i):
            if i < n:
                g = (1.0 / math.log(n)) * math.log(i + 1) if warmup_type == "log" else i / n
                return lo + g * (1.0 - lo)
            # DeepSpeed: real_last_step / real_total_steps, held at the end here (DeepSpeed's climbs back)
            half = (1 + math.cos(math.pi * min(i - n + 1, total - n) / (total - n))) / 2
            return max(0.0, end + (1.0 - end) * half)

        sched = WarmupCosineLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr), total_num_steps=total,
                               warmup_min_ratio=lo, warmup_num_steps=n, cos_min_ratio=end, warmup_type=warmup_type)
        assert _lrs(sched, total + 4) == [0.0] + [lr * ratio(i) for i in range(total + 4)]
        assert sched.optimizer.param_groups[0]["lr"] == lr * end  # past the end: held at cos_min_ratio
    spec = load_config({**MICRO, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": total}}}, 1).scheduler
    assert spec == {"type": "WarmupCosineLR", "params": {"total_num_steps": total, "warmup_num_steps": 1000}}


# --------------------------------------------------------------------- loss scalers
def _trajectory(scaler, overflows):
    out = []
    for o in overflows:
        scaler.update_scale(o)
        out.append(scaler.loss_scale)
    return out


def test_dynamic_loss_scaler_rules():
    F, T = False, True
    # window 3, as DeepSpeed 0.19's update_scale: the clean steps since the start or the last overflow,
    # less the first, reach 3 (was 3 clean steps, DeepSpeed's older rule: [8, 8, 16, ...])
    assert _trajectory(DynamicLossScaler(8, scale_window=3, hysteresis=1),
                       [F, F, F, F, T, F, F, F, F]) == [8, 8, 8, 16, 8, 8, 8, 8, 16]
    # hysteresis 3: the third overflow halves; later ones halve at once until a growth refills it
    assert _trajectory(DynamicLossScaler(64, scale_window=100, hysteresis=3), [T, T, T, T, F]) == [64, 64, 32, 16, 16]
    # a clean step between overflows refills only with consecutive_hysteresis
    assert _trajectory(DynamicLossScaler(64, scale_window=100, hysteresis=2), [T, F, T]) == [64, 64, 32]
    assert _trajectory(DynamicLossScaler(64, scale_window=100, hysteresis=2, consecutive_hysteresis=True), [T, F, T]) == [64, 64, 64]
    # never below min_loss_scale; an overflow there stops the run, as DeepSpeed's raise_error_at_min_scale
    floor = DynamicLossScaler(4, scale_window=100, min_scale=2, hysteresis=1)
    assert _trajectory(floor, [T]) == [2]
    with pytest.raises(RuntimeError, match=r"overflowed .* again at the minimum loss scale 2 \(fp16.min_loss_scale\)"):
        floor.update_scale(True)
    assert _trajectory(DynamicLossScaler(4, scale_window=100, min_scale=2, hysteresis=1, raise_error_at_min_scale=False),
                       [T, T, T]) == [2, 2, 2]
    assert _trajectory(StaticLossScaler(128), [T, F, T]) == [128, 128, 128]
    a = DynamicLossScaler(8, scale_window=3)
    _trajectory(a, [T, F])
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert _trajectory(a, [F, F, T, T]) == _trajectory(b, [F, F, T, T])


def test_overflow_check_and_unscale_without_a_process_group():
    g = [torch.ones(3, dtype=torch.float16), torch.zeros(0)]
    assert not has_overflow(g, torch.device("cpu"))
    for bad in (float("inf"), float("-inf"), float("nan")):
        h = [t.clone() for t in g]
        h[0][1] = bad
        assert has_overflow(h, torch.device("cpu"))
    assert not has_overflow([], torch.device("cpu"))
    unscale_(g, 4.0)
    assert torch.equal(g[0], torch.full((3,), 0.25, dtype=torch.float16))


# ---------------------------------------------------------- Accelerate fsdp_config
S, P = zs.ShardingStrategy, zs.BackwardPrefetch


@pytest.mark.parametrize("field,value,key,expected", [
    ("fsdp_sharding_strategy", "SHARD_GRAD_OP", "sharding_strategy", S.SHARD_GRAD_OP),
    ("fsdp_sharding_strategy", 1, "sharding_strategy", S.FULL_SHARD),  # Accelerate's 1-based ints
    ("fsdp_sharding_strategy", "3", "sharding_strategy", S.NO_SHARD),
    ("fsdp_sharding_strategy", 4, "sharding_strategy", S.HYBRID_SHARD),
    ("fsdp_sharding_strategy", "hybrid_shard_zero2", "sharding_strategy", S._HYBRID_SHARD_ZERO2),
    ("fsdp_reshard_after_forward", False, "sharding_strategy", S.SHARD_GRAD_OP),
    ("fsdp_reshard_after_forward", "HYBRID_SHARD", "sharding_strategy", S.HYBRID_SHARD),
    ("fsdp_backward_prefetch", "BACKWARD_PRE", "backward_prefetch", P.BACKWARD_PRE),
    ("fsdp_backward_prefetch", "NO_PREFETCH", "backward_prefetch", None),
    ("fsdp_backward_prefetch_policy", 2, "backward_prefetch", P.BACKWARD_POST),
    ("fsdp_forward_prefetch", True, "forward_prefetch", True),
    ("fsdp_use_orig_params", "false", "use_orig_params", False),
    ("fsdp_backward_prefetch", None, "backward_prefetch", None),  # YAML null: left out
    ("mixed_precision", "BF16", "mixed_precision", zs.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)),
    ("fsdp_offload_params", True, "cpu_offload", zs.CPUOffload(offload_params=True)),
    ("mixed_precision", "bf16", "mixed_precision", zs.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)),
    ("mixed_precision", "fp16", "mixed_precision", zs.MixedPrecision(torch.float16, torch.float16, torch.float16)),
    ("fsdp_auto_wrap_policy", "NO_WRAP", "auto_wrap_policy", None),
])
def test_accelerate_field_maps_to_keyword(field, value, key, expected):
    assert from_accelerate_config({field: value})[key] == expected


def test_accelerate_defaults_and_non_constructor_settings():
    # A field left out takes `accelerate launch`'s default (its --fsdp_use_orig_params and
    # --fsdp_cpu_ram_efficient_loading default to "true"), since the input is the launcher's YAML.
    kw = from_accelerate_config({})
    assert kw == {"sharding_strategy": S.FULL_SHARD, "backward_prefetch": None, "forward_prefetch": False,
                  "auto_wrap_policy": None, "use_orig_params": True, "sync_module_states": True,
                  "cpu_offload": zs.CPUOffload(offload_params=False)}
    assert kw.state_dict_type == zs.StateDictType.FULL_STATE_DICT and kw.cpu_ram_efficient_loading
    kw = from_accelerate_config({"fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False,
                                 "fsdp_sync_module_states": False})
    assert kw.state_dict_type == zs.StateDictType.SHARDED_STATE_DICT and not kw.cpu_ram_efficient_loading
    assert kw["sync_module_states"] is False
    assert from_accelerate_config({"fsdp_state_dict_type": 2}).state_dict_type == zs.StateDictType.LOCAL_STATE_DICT
    with pytest.warns(UserWarning, match="setting sync_module_states=True"):
        kw = from_accelerate_config({"fsdp_sync_module_states": False})  # cpu_ram_efficient_loading's default needs it
    assert kw["sync_module_states"] is True


def test_accelerate_keys_without_the_fsdp_prefix_are_read_as_accelerate_launch_reads_them():
    # `accelerate launch` adds "fsdp_" to an fsdp_config key without "fsdp" in it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kw = from_accelerate_config({"distributed_type": "FSDP", "fsdp_config": {
            "sharding_strategy": "SHARD_GRAD_OP", "offload_params": True, "use_orig_params": False,
            "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 7}})
    assert kw["sharding_strategy"] == S.SHARD_GRAD_OP and kw["cpu_offload"].offload_params and not kw["use_orig_params"]
    assert kw["auto_wrap_policy"].keywords == {"min_num_params": 7}
    # Both keys, agreeing on resharding after forward: one setup (the strategy names the hybrid form).
    for name, reshard, want in (("HYBRID_SHARD", True, S.HYBRID_SHARD), ("HYBRID_SHARD_ZERO2", False, S._HYBRID_SHARD_ZERO2),
                                ("SHARD_GRAD_OP", False, S.SHARD_GRAD_OP)):
        got = from_accelerate_config({"fsdp_sharding_strategy": name, "fsdp_reshard_after_forward": reshard})
        assert got["sharding_strategy"] == want, (name, reshard)
    with pytest.raises(ValueError, match="both sharding_strategy and fsdp_sharding_strategy are given"):
        from_accelerate_config({"fsdp_sharding_strategy": 1, "sharding_strategy": 1})


def test_accelerate_wrap_policies_resolve_against_the_model():
    model = build("mlp")
    for names in ("Block", ["Block"], "Block, Linear"):
        policy = from_accelerate_config({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                         "fsdp_transformer_layer_cls_to_wrap": names}, model=model)["auto_wrap_policy"]
        assert policy.func is zs.wrap.transformer_auto_wrap_policy
        assert Block in policy.keywords["transformer_layer_cls"]
    model._no_split_modules = ["Block"]  # transformers' default list
    policy = from_accelerate_config({"fsdp_auto_wrap_policy": 1}, model=model)["auto_wrap_policy"]
    assert policy.keywords["transformer_layer_cls"] == {Block}
    size = from_accelerate_config({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 100})["auto_wrap_policy"]
    assert size.func is zs.wrap.size_based_auto_wrap_policy and size.keywords == {"min_num_params": 100}
    assert from_accelerate_config({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 0})["auto_wrap_policy"] is None


@pytest.mark.parametrize("cfg,model,match", [
    ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "GPT2Block"}, True,
     r"names \['GPT2Block'\], which the model does not contain \(its module classes: Block, Linear, MLP, ModuleList\)"),
    ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "Block"}, False, "pass model="),
    ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}, True, r"fsdp_transformer_layer_cls_to_wrap = None"),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": -5}, False, r"fsdp_min_num_params = -5"),
    ({"fsdp_auto_wrap_policy": "EVERYTHING"}, False, r"fsdp_auto_wrap_policy = 'EVERYTHING'.*TRANSFORMER_BASED_WRAP"),
    ({"fsdp_sharding_strategy": 6}, False, r"fsdp_sharding_strategy = 6 is not valid. Fix: use one of FULL_SHARD.*\(or 1-5\)"),
    ({"fsdp_forward_prefetch": "maybe"}, False, r"fsdp_forward_prefetch = 'maybe'.*true or false"),
    ({"mixed_precision": "fp8"}, False, r"mixed_precision = 'fp8'.*bf16, fp16 or no"),
    ({"fsdp_version": 2}, False, r"fsdp_version = 2.*FSDP2 is not supported"),
    ({"fsdp_activation_checkpointing": True}, False, r"activation checkpointing is not implemented"),
    ({"distributed_type": "DEEPSPEED", "fsdp_config": {}}, False, r"distributed_type = 'DEEPSPEED'"),
    ({"distributed_type": "MULTI_GPU", "mixed_precision": "bf16"}, False, r"distributed_type = 'MULTI_GPU'"),
    ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": ""}, True,
     r"fsdp_transformer_layer_cls_to_wrap = '' is not valid.*or leave the field out"),
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_reshard_after_forward": True}, False,
     r"fsdp_sharding_strategy = 'SHARD_GRAD_OP' and fsdp_reshard_after_forward = True say different things"),
    ({"fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_backward_prefetch_policy": "BACKWARD_POST"}, False,
     r"say different things. Fix: keep only fsdp_backward_prefetch"),
    ({"fsdp_ignored_modules": "vision_tower"}, False, r"fsdp_ignored_modules.*pass ignored_modules="),
    (["FULL_SHARD"], False, r"expected a mapping, got list"),
])
def test_accelerate_errors_name_field_value_and_fix(cfg, model, match):
    with pytest.raises(ValueError, match=match):
        from_accelerate_config(cfg, model=build("mlp") if model else None)


def test_accelerate_file_forms(tmp_path):
    whole = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "bf16",
             "num_processes": 2, "fsdp_config": {"fsdp_sharding_strategy": 2, "fsdp_use_orig_params": True}}
    path = tmp_path / "accelerate.json"
    path.write_text(json.dumps(whole))
    kw = from_accelerate_config(str(path))
    assert kw["sharding_strategy"] == S.SHARD_GRAD_OP and kw["use_orig_params"] and kw["mixed_precision"].param_dtype == torch.bfloat16
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text("distributed_type: FSDP\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n")
    try:
        import yaml  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs PyYAML, which is not installed. Fix: pip install pyyaml, or pass the config as a dict"):
            from_accelerate_config(str(yaml_path))
    else:
        assert from_accelerate_config(str(yaml_path))["sharding_strategy"] == S.SHARD_GRAD_OP


LAUNCHER_ENV = {  # what `accelerate launch` exports for an FSDP config (every field; values as it writes them)
    "ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "bf16", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP",
    "FSDP_OFFLOAD_PARAMS": "false", "FSDP_MIN_NUM_PARAMS": "100000000", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_FORWARD_PREFETCH": "true", "FSDP_USE_ORIG_PARAMS": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_RESHARD_AFTER_FORWARD": "true"}  # exported whatever the strategy (accelerate 1.x); FSDP1's plugin does not read it


def test_accelerate_launch_environment_is_read_when_no_config_is_given(monkeypatch):
    """Inside `accelerate launch` the config reaches the script only as FSDP_* variables;
    from_accelerate_config() reads them as Accelerate's FullyShardedDataParallelPlugin does."""
    for name in [n for n in os.environ if n.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(name)
    model = build("mlp")
    for name, value in LAUNCHER_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FSDP_USE_FULL_PREC_IN_EVAL", "1")  # torch's own variable, not a config field: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kw = from_accelerate_config(model=model)
    want = from_accelerate_config({"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                   "fsdp_transformer_layer_cls_to_wrap": "Block", "fsdp_backward_prefetch": "BACKWARD_PRE",
                                   "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_forward_prefetch": True,
                                   "fsdp_use_orig_params": False, "mixed_precision": "bf16"}, model=model)
    assert {k: v for k, v in kw.items() if k != "auto_wrap_policy"} == {k: v for k, v in want.items() if k != "auto_wrap_policy"}
    assert kw["auto_wrap_policy"].keywords == want["auto_wrap_policy"].keywords == {"transformer_layer_cls": {Block}}
    assert kw.state_dict_type == zs.StateDictType.SHARDED_STATE_DICT and kw.cpu_ram_efficient_loading
    # Set by hand (a common recipe): unset variables take the plugin's defaults, not the launcher's.
    for name in LAUNCHER_ENV:
        if name not in ("ACCELERATE_USE_FSDP", "FSDP_AUTO_WRAP_POLICY", "FSDP_TRANSFORMER_CLS_TO_WRAP"):
            monkeypatch.delenv(name)
    kw = from_accelerate_config(model=model)
    assert kw["sharding_strategy"] == S.FULL_SHARD and kw["use_orig_params"] is False and "mixed_precision" not in kw
    assert kw["sync_module_states"] is False  # the plugin's default for an unset FSDP_SYNC_MODULE_STATES
    assert not kw.cpu_ram_efficient_loading and kw["auto_wrap_policy"].keywords == {"transformer_layer_cls": {Block}}
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    assert from_accelerate_config(model=model)["auto_wrap_policy"] is None  # FSDP_MIN_NUM_PARAMS unset: 0, no wrapping
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with pytest.raises(ValueError, match="no config was given and ACCELERATE_USE_FSDP is not true.*Fix: pass the config"):
        from_accelerate_config(model=model)


def _accelerate_vs_hand(rank, world_size):
    from zeroshard.engine import initialize

    cfg = {"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": world_size, "fsdp_config": {
        "fsdp_sharding_strategy": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Block", "fsdp_backward_prefetch": "BACKWARD_POST",
        "fsdp_forward_prefetch": True, "fsdp_use_orig_params": True, "fsdp_sync_module_states": True,
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_offload_params": False}}
    base = build("mlp")
    kw = from_accelerate_config(cfg, model=base)
    bf16 = zs.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    a = zs.FSDP(copy.deepcopy(base), **kw)
    b = zs.FSDP(copy.deepcopy(base), sharding_strategy=S.SHARD_GRAD_OP, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                backward_prefetch=P.BACKWARD_POST, forward_prefetch=True, use_orig_params=True, sync_module_states=True,
                mixed_precision=bf16)
    units = [[type(u.module).__name__ for u in zs.FSDP.fsdp_modules(m)] for m in (a, b)]
    assert units[0] == units[1] == ["MLP", "Block", "Block", "Block"], units
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    for step in range(3):
        outs = []
        for m, o in zip((a, b), opts):
            out = m(batch("mlp", rank, step))
            out.float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
    same = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    # The same kwargs drive zeroshard.initialize at stage 2 (their strategy is ZeRO-2).
    ds = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}}
    engine, *_ = initialize(model=copy.deepcopy(base), config=ds, fsdp_kwargs=kw)
    assert engine.wrapped.sharding_strategy == S.SHARD_GRAD_OP and engine.wrapped.mixed_precision == bf16
    with pytest.raises(ValueError, match="does not implement ZeRO stage 3"):
        initialize(model=copy.deepcopy(base), config={**ds, "zero_optimization": {"stage": 3}}, fsdp_kwargs=kw)
    return same


def test_accelerate_kwargs_train_like_a_hand_written_wrap(ranks):
    assert all(ranks.run(2, _accelerate_vs_hand))


def test_accelerate_yaml_no_read_as_false_and_the_legacy_fp16_key():
    """YAML 1.1 reads an unquoted ``mixed_precision: no`` as False: it was refused with "'false' is not
    valid ... use bf16, fp16 or no" (Accelerate's ClusterConfig maps False back to "no"). The legacy
    top-level ``fp16: true`` (older accelerate configs) was ignored and the model trained in fp32;
    Accelerate reads it as mixed_precision: fp16."""
    fsdp = {"fsdp_sharding_strategy": "FULL_SHARD"}
    as_parsed = {"distributed_type": "FSDP", "mixed_precision": False, "fsdp_config": fsdp}
    assert "mixed_precision" not in from_accelerate_config(as_parsed)
    assert "mixed_precision" not in from_accelerate_config({**fsdp, "mixed_precision": False})
    legacy = from_accelerate_config({"distributed_type": "FSDP", "fp16": True, "fsdp_config": fsdp})
    assert legacy["mixed_precision"].param_dtype == torch.float16
    assert "mixed_precision" not in from_accelerate_config({"distributed_type": "FSDP", "fp16": False, "fsdp_config": fsdp})
    explicit = from_accelerate_config({"distributed_type": "FSDP", "fp16": True, "mixed_precision": "bf16", "fsdp_config": fsdp})
    assert explicit["mixed_precision"].param_dtype == torch.bfloat16


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_only_keys_below_stage3_warn(stage):
    """ZeRO++ (qwZ, hpZ) and the persistence threshold act on stage 3's sharded parameters:
    below it they were accepted and did nothing, silently."""
    cfg = {**MICRO, "zero_optimization": {"stage": stage, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                          "stage3_param_persistence_threshold": 1000}}
    with pytest.warns(UserWarning, match=r"'zero_optimization.stage3_param_persistence_threshold', "
                                         r"'zero_optimization.zero_hpz_partition_size', "
                                         rf"'zero_optimization.zero_quantized_weights' act at ZeRO stage 3 only; at stage {stage}"):
        load_config(cfg, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({**MICRO, "zero_optimization": {**cfg["zero_optimization"], "stage": 3}}, 2)
        load_config({**MICRO, "zero_optimization": {"stage": 2, "zero_quantized_weights": False}}, 1)


@pytest.mark.parametrize("cfg, match", [
    # A misspelled field was dropped with a warning (and named as read, fsdp_offload_param): the default ran.
    ({"fsdp_sharding_stratgy": "SHARD_GRAD_OP"}, r"unknown fsdp_config field 'fsdp_sharding_stratgy'\. Fix: did you mean fsdp_sharding_strategy\?"),
    ({"offload_param": True}, r"unknown fsdp_config field 'offload_param'\. Fix: did you mean fsdp_offload_params\?"),
    # A whole config's misspelled top-level key was dropped without a word (Accelerate refuses it).
    ({"distributed_type": "FSDP", "fsdp_confg": {"fsdp_sharding_strategy": 2}}, r"unknown top-level key \(Accelerate's config files have none such\) 'fsdp_confg'\. Fix: did you mean fsdp_config\?"),
    ({"distributed_type": "FSDP", "mixed_precison": "bf16"}, r"'mixed_precison'\. Fix: did you mean mixed_precision\?"),
    # fsdp_config not a mapping: AttributeError from .items().
    ({"distributed_type": "FSDP", "fsdp_config": ["fsdp_sharding_strategy", 2]}, r"fsdp_config = \['fsdp_sharding_strategy', 2\] is not valid\. Fix: use a mapping"),
    ({"distributed_type": "FSDP", "fsdp_config": "FULL_SHARD"}, r"fsdp_config = 'FULL_SHARD' is not valid"),
    ({"fsdp_activation_checkpointing_offload": True}, r"fsdp_activation_checkpointing_offload = True is not valid\. Fix: use false"),
])
def test_accelerate_misspelled_or_malformed_config_raises(cfg, match):
    with pytest.raises(ValueError, match=match):
        from_accelerate_config(cfg)


def test_accelerate_whole_config_keys_accelerate_writes_are_accepted():
    """Every key of Accelerate 1.x's config files (the launcher's own ones are not zeroshard's business)."""
    whole = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP", "downcast_bf16": "no",
             "enable_cpu_affinity": False, "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16",
             "num_machines": 1, "num_processes": 2, "rdzv_backend": "static", "same_network": True, "tpu_env": [],
             "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": False, "dynamo_config": {},
             "ipex_config": {"ipex": False}, "tp_config": {"tp_size": 1},  # earlier 1.x releases' keys
             "fsdp_config": {"fsdp_activation_checkpointing": False, "fsdp_activation_checkpointing_offload": False,
                             "fsdp_auto_wrap_policy": "NO_WRAP", "fsdp_cpu_ram_efficient_loading": True,
                             "fsdp_offload_params": False, "fsdp_sharding_strategy": "FULL_SHARD",
                             "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_sync_module_states": True,
                             "fsdp_use_orig_params": True, "fsdp_version": 1}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kw = from_accelerate_config(whole)
    assert kw["sharding_strategy"] == S.FULL_SHARD and kw["mixed_precision"].param_dtype == torch.bfloat16


def test_accelerate_state_dict_settings_come_with_accelerates_configs():
    """kw.state_dict_type alone gave every rank a full state dict on the compute device, where Accelerate
    pairs FULL_STATE_DICT with offload_to_cpu and rank0_only, SHARDED_STATE_DICT with offload_to_cpu."""
    from zeroshard import FullOptimStateDictConfig, FullStateDictConfig, ShardedOptimStateDictConfig, ShardedStateDictConfig

    full = from_accelerate_config({"fsdp_state_dict_type": "FULL_STATE_DICT"})
    assert type(full.state_dict_config) is FullStateDictConfig and full.state_dict_config.rank0_only
    assert full.state_dict_config.offload_to_cpu
    assert type(full.optim_state_dict_config) is FullOptimStateDictConfig and full.optim_state_dict_config.rank0_only
    assert full.optim_state_dict_config.offload_to_cpu
    sharded = from_accelerate_config({"fsdp_state_dict_type": 3})
    assert type(sharded.state_dict_config) is ShardedStateDictConfig and sharded.state_dict_config.offload_to_cpu
    assert type(sharded.optim_state_dict_config) is ShardedOptimStateDictConfig and sharded.optim_state_dict_config.offload_to_cpu
    local = from_accelerate_config({"fsdp_state_dict_type": "LOCAL_STATE_DICT"})
    assert local.state_dict_config is None and local.optim_state_dict_config is None  # torch's defaults
