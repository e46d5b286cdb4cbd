"""zeroshard.initialize / Engine: a DeepSpeed training loop on each ZeRO stage
against the torch engine that defines it, the fp16 loss scaler across ranks,
and checkpoints that resume bit-exactly.

* stage 3 / 2 == torch FSDP1 FULL_SHARD / SHARD_GRAD_OP (device_id=cpu),
  torch.equal on every loss, clip norm and parameter shard;
* stage 0 == torch DDP on 2 ranks, torch.equal (the engine sums then scales by
  1/N as DeepSpeed, DDP divides then sums: the same bits for N = 2), and a
  parameter without gradient trains as DeepSpeed's (zeros all-reduced);
* stage 1 (zeroshard's own ZeRO-1) == DDP: torch.equal on 2 ranks without
  clipping (same pre-divide, a two-term sum has one order, AdamW is
  elementwise on the flat master too). Otherwise within 1e-7 (measured up to
  3e-8, one ulp of these weights): DDP's clip norm combines per-tensor norms
  of full gradients while ZeRO-1 sums squares of gradient chunks, and on 4
  ranks gloo's all-reduce and reduce-scatter add the four terms in different
  orders.
"""
from __future__ import annotations

import contextlib
import math
import copy
import os
import re
import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.distributed.fsdp.wrap as twrap
from torch.nn.parallel import DistributedDataParallel

import zeroshard as zs
from models import Block, batch, build
from parity import same_on_every_rank
from zeroshard import ds_checkpoint
from zeroshard.lr_schedules import WarmupLR
from zeroshard.engine import initialize

LR, WD = 1e-2, 0.01
SCHED = {"warmup_min_lr": 1e-3, "warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"}


def _config(stage, accum=2, clip=0.05, **extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "scheduler": {"type": "WarmupLR", "params": SCHED}, "zero_optimization": {"stage": stage}, **extra}


def _engine(stage, seed=0, **cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {"fsdp_kwargs": {"auto_wrap_policy": zs.wrap.ModuleWrapPolicy({Block})}} if stage >= 2 else {}
        return initialize(model=build("mlp", seed=seed), config=_config(stage, **cfg), **kw)


def _reference(stage, model, fp16=False):
    if fp16:  # the engine, as DeepSpeed, starts its fp32 master from the fp16-rounded weights
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half())
    if stage < 2:
        return DistributedDataParallel(model)
    strategy = tfsdp.ShardingStrategy.FULL_SHARD if stage == 3 else tfsdp.ShardingStrategy.SHARD_GRAD_OP
    mp = tfsdp.MixedPrecision(torch.float16, torch.float16, torch.float16) if fp16 else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tfsdp.FullyShardedDataParallel(model, sharding_strategy=strategy, use_orig_params=True, device_id=torch.device("cpu"),
                                              auto_wrap_policy=twrap.ModuleWrapPolicy({Block}), mixed_precision=mp)


def _against_reference(rank, world_size, stage, accum, clip, steps=3, fp16=False):
    """The engine and the torch reference driven by the same DeepSpeed-style loop.

    ``fp16`` (stages 2/3): the engine's dynamic loss scaler (2**10, no overflow
    expected) against torch FSDP1 in fp16 with the scaling written out by hand."""
    ref = _reference(stage, build("mlp"), fp16)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    sched_ref = WarmupLR(opt_ref, **SCHED)
    scale = 2.0**10
    extra = {"fp16": {"enabled": True, "initial_scale_power": 10}} if fp16 else {}
    with zs.comm_stats() as stats:
        engine, opt, _, sched = _engine(stage, accum=accum, clip=clip, **extra)
        stats.calls.clear(), stats.bytes.clear()  # count the training steps only
        exact, max_diff, norms, norm_exact, norm_rel = True, 0.0, [], True, 0.0
        for step in range(steps):
            for micro in range(accum):
                x = batch("mlp", rank, step * accum + micro)
                last = micro == accum - 1
                with ref.no_sync() if stage < 2 and not last else contextlib.nullcontext():
                    loss_ref = ref(x).pow(2).mean()
                    ((loss_ref / accum).float() * scale if fp16 else loss_ref / accum).backward()
                loss = engine(x).pow(2).mean()
                returned = engine.backward(loss)
                assert torch.equal(returned, loss / accum), "DeepSpeed returns loss / accumulation steps, unscaled"
                assert not fp16 or engine.loss_scaler.loss_scale == scale
                assert engine.is_gradient_accumulation_boundary() == last
                engine.step()
                exact &= torch.equal(loss_ref, loss)
                max_diff = max(max_diff, (loss_ref - loss).abs().item())
            if fp16:
                for p in ref.parameters():
                    if p.grad is not None:  # None: a parameter with no element on this rank
                        p.grad.mul_(1.0 / scale)
            # Without clipping the engine still reports the norm (DeepSpeed's ZeRO optimizers compute it unasked).
            norm_ref = (ref.clip_grad_norm_(clip or math.inf) if stage >= 2
                        else torch.nn.utils.clip_grad_norm_(ref.parameters(), clip or math.inf))
            norm = engine.get_global_grad_norm()
            norm_exact &= torch.equal(norm_ref.float(), norm.float())
            norm_rel = max(norm_rel, ((norm_ref - norm) / norm_ref).abs().item())
            norms.append(norm_ref.item())
            opt_ref.step()
            sched_ref.step()
            opt_ref.zero_grad()
            assert engine.get_lr() == sched_ref.get_last_lr() == sched.get_last_lr()
            ours = engine.module.named_parameters() if stage >= 2 else engine.module.named_parameters(prefix="module")
            for (n_ref, a), (n, b) in zip(ref.named_parameters(), ours):
                assert n_ref == n and a.shape == b.shape, (n_ref, n, a.shape, b.shape)
                exact &= torch.equal(a, b)
                max_diff = max(max_diff, (a - b).abs().max().item() if a.numel() else 0.0)
    assert engine.global_steps == steps and engine.micro_steps == steps * accum
    out = {"exact": exact, "max_diff": max_diff, "norms": norms, "norm_exact": norm_exact, "norm_rel": norm_rel}
    if stage == 1:  # ZeRO-1's own claims: 1/N of the optimizer state, DDP's communication volume
        part = engine.zero1.parts[0]
        padded = part.layout.padded_numel
        assert part.layout.numel == sum(p.numel() for p in engine.module.parameters())
        assert padded % world_size == 0 and part.master.numel() == padded // world_size
        assert all(v.numel() == padded // world_size for v in opt.state[part.master].values() if v.dim() > 0)
        volume = steps * padded * 4 * (world_size - 1) / world_size
        assert stats.calls["reduce_scatter"] == stats.calls["all_gather"] == steps
        assert stats.bytes["reduce_scatter"] == stats.bytes["all_gather"] == volume
    return out


@pytest.mark.parametrize("world_size,stage", [(2, 3), (2, 2), (4, 3), (2, 0), (4, 2)])
def test_sharded_and_ddp_stages_equal_torch_bit_exactly(ranks, world_size, stage):
    """Stages 2/3 vs torch FSDP1, stage 0 vs DDP: accumulation 2, clipping, WarmupLR."""
    results = ranks.run(world_size, _against_reference, stage, 2, 0.05)
    for r in results:
        assert r["exact"] and r["norm_exact"], r
        assert all(n > 0.05 for n in r["norms"])  # clipping was active


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_unclipped_steps_equal_torch_and_report_the_norm(ranks, stage):
    """gradient_clipping 0: no clipping, and get_global_grad_norm() is still the
    global norm of the step's gradients (it returned None)."""
    for r in ranks.run(2, _against_reference, stage, 2, 0.0):
        assert r["exact"] and r["norm_exact"], r
        assert all(n > 0 for n in r["norms"])


@pytest.mark.parametrize("stage", [3, 2])
def test_fp16_loss_scaling_equals_torch_fsdp_with_manual_scaling(ranks, stage):
    """fp16 compute and reduction, loss x 2**10 before backward, gradients x 2**-10
    before clipping: the engine equals torch FSDP1 doing the same by hand."""
    for r in ranks.run(2, _against_reference, stage, 2, 0.05, 3, True):
        assert r["exact"] and r["norm_exact"], r


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_equals_ddp(ranks, world_size):
    """ZeRO-1 (reduce-scatter, sharded AdamW on a flat fp32 master, all-gather)
    vs DDP (all-reduce, replicated AdamW): same losses and parameters."""
    for r in ranks.run(world_size, _against_reference, 1, 2, 0.05):
        assert r["max_diff"] <= 1e-7, r
        assert all(n > 0.05 for n in r["norms"])
    unclipped = ranks.run(world_size, _against_reference, 1, 3, 0.0)
    if world_size == 2:
        assert all(r["exact"] for r in unclipped), unclipped
    assert all(r["max_diff"] <= 1e-7 for r in unclipped), unclipped
    # The norm of flat master chunks vs of per-parameter tensors: the same sum in another order.
    assert all(r["norm_rel"] <= 1e-6 and all(n > 0 for n in r["norms"]) for r in unclipped), unclipped


def _zero1_default_group(rank, world_size):
    from zeroshard.zero1 import ZeroOneOptimizer

    # zeroshard was imported before init_process_group here (the pool's worker
    # imports it first): the default must still mean the world, resolved at call time.
    z = ZeroOneOptimizer(torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.1))
    return z.group is torch.distributed.group.WORLD and z.world == world_size


def test_zero1_default_group_is_the_world(ranks):
    assert ranks.run(2, _zero1_default_group) == [True, True]


def _zero1_group_added_later(rank, world_size):
    """A head frozen at first, unfrozen at step 1 and handed to add_param_group (as
    torch's ZeroRedundancyOptimizer allows), against a plain model whose gradients
    are averaged by hand. Returns (replicas equal, max |diff| to the reference)."""
    import torch.distributed as dist

    from zeroshard.zero1 import ZeroOneOptimizer

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        m[2].requires_grad_(False)
        return m

    ours, ref = build(), build()
    z = ZeroOneOptimizer(torch.optim.SGD(ours[0].parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref[0].parameters(), lr=0.1)
    for step in range(4):
        if step == 1:
            for m, o in ((ours, z.optimizer), (ref, ref_opt)):
                m[2].requires_grad_(True)
                o.add_param_group({"params": m[2].parameters(), "lr": 0.05})
        x = batch("mlp", rank, step)
        for m in (ours, ref):
            m(x).pow(2).mean().backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.div_(world_size)
                dist.all_reduce(p.grad)
        z.reduce_gradients()
        z.step()
        z.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    return same_on_every_rank(ours.parameters()), diff


def test_zero1_param_group_added_later_is_partitioned(ranks):
    """A group added with optimizer.add_param_group after ZeRO-1 took the
    optimizer was stepped on each rank's own unreduced gradients: the replicas
    drifted apart (0.04 after 4 steps). It is partitioned like the others."""
    for same, diff in ranks.run(2, _zero1_group_added_later):
        assert same and diff <= 1e-7, (same, diff)


def _zero1_group_added_around_it(rank, world_size):
    from zeroshard.zero1 import ZeroOneOptimizer

    opt = torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.1)
    z = ZeroOneOptimizer(opt)
    torch.optim.Optimizer.add_param_group(opt, {"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(RuntimeError, match="add_param_group"):
        z.reduce_gradients()
    with pytest.raises(ValueError, match="already in a param group"):
        z.add_param_group({"params": z.parts[0].params[:1]})
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)  # unfrozen later, it would never train
    with pytest.warns(UserWarning, match="left out"):
        z.add_param_group({"params": [frozen, torch.nn.Parameter(torch.ones(3))]})
    return True


def _zero1_unfrozen_later(rank, world_size):
    import warnings as w

    from zeroshard.zero1 import ZeroOneOptimizer

    lin = torch.nn.Linear(3, 3)
    lin.bias.requires_grad_(False)
    z = ZeroOneOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    lin(torch.ones(2, 3)).sum().backward()
    with w.catch_warnings():
        w.simplefilter("error")
        z.reduce_gradients()  # nothing unfrozen yet: no warning
    lin.bias.requires_grad_(True)
    lin(torch.ones(2, 3)).sum().backward()
    with pytest.warns(UserWarning, match="not trained"):
        z.reduce_gradients()
    return True


def test_zero1_warns_about_parameters_unfrozen_after_it_took_the_optimizer(ranks):
    """Frozen when ZeRO-1 partitioned the optimizer, unfrozen later: they got gradients but were
    silently never stepped (as in DeepSpeed); a warning now names the fix."""
    assert ranks.run(2, _zero1_unfrozen_later) == [True, True]


def test_zero1_refuses_a_group_it_did_not_partition(ranks):
    assert ranks.run(2, _zero1_group_added_around_it) == [True, True]


def _zero1_vs_one_partition(rank, world_size, precision):
    """Stage 1 (N master chunks) vs stage 0 (all-reduce + one fp32 master partition) in bf16."""
    engines = [_engine(stage, clip=0.0, **{precision: {"enabled": True}})[0] for stage in (0, 1)]
    for engine in engines:
        _train(engine, rank, 3, 0)
    ref, ours = engines
    masters = [torch.cat([p.master.detach() for p in e.zero1.parts]) for e in engines]
    assert masters[1].numel() == -(-masters[0].numel() // world_size)  # stage 1 keeps 1/N of the fp32 master
    return all(torch.equal(a, b) for a, b in zip(ref.module.parameters(), ours.module.parameters()))


def test_zero1_low_precision_equals_one_partition(ranks):
    """Low-precision gradients reduced in the model dtype (two-term sums: exact),
    fp32 master steps: sharding the master changes no bit of the training. Not
    in fp16: as in DeepSpeed, stage 0 sums and then scales by 1/N while its ZeRO
    stages divide first, so at a loss scale of 2**16 a sum can overflow fp16 where
    the halves did not (one more skipped step at stage 0)."""
    assert all(ranks.run(2, _zero1_vs_one_partition, "bf16"))


# ----------------------------------------------------------------- fp16 loss scaling
def _snapshot(engine, opt):
    params = [p.detach().clone() for p in engine.module.parameters()]
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}
    return params, state


def _same(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    same_params = all(torch.equal(x, y) for x, y in zip(pa, pb))
    same_state = sa.keys() == sb.keys() and all(
        sa[k].keys() == sb[k].keys() and all(torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n])) for n in sa[k])
        for k in sa)
    return same_params and same_state


def _inject_inf(engine, stage):
    """An inf in one gradient element (on the calling rank only), after backward."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None and p.grad.numel() > 0]
    grads[0].view(-1)[0] = float("inf")


def _overflow_sequence(rank, world_size, stage, plan):
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 2,
            "min_loss_scale": 512}
    engine, opt, _, sched = _engine(stage, accum=1, clip=1.0, fp16=fp16)
    scales, skipped_ok = [], []
    for i, kind in enumerate(plan):
        before, lr_before, it_before = _snapshot(engine, opt), engine.get_lr(), sched.last_batch_iteration
        loss = engine(batch("mlp", rank, i)).float().pow(2).mean()
        engine.backward(loss)
        if kind == "inf" and rank == 1:
            _inject_inf(engine, stage)
        engine.step()
        after = _snapshot(engine, opt)
        assert engine.was_step_applied() == (kind != "inf")
        if kind == "inf":  # skipped: nothing moved, the scheduler included
            skipped_ok.append(_same(before, after) and engine.get_lr() == lr_before and sched.last_batch_iteration == it_before)
        else:
            skipped_ok.append(not _same(before, after) and sched.last_batch_iteration == it_before + 1)
        assert all(p.grad is None for p in engine.module.parameters())
        scales.append(engine.loss_scaler.loss_scale)
    out = {"scales": scales, "ok": skipped_ok, "skipped": engine.skipped_steps, "global_steps": engine.global_steps}
    engine.backward(engine(batch("mlp", rank, len(plan))).float().pow(2).mean())
    if rank == 1:
        _inject_inf(engine, stage)
    with pytest.raises(RuntimeError) as floor:  # on every rank: the overflow flag is all-reduced
        engine.step()
    return {**out, "floor": str(floor.value)}


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_overflow_on_one_rank_skips_the_step_on_all(ranks, stage):
    """fp16, dynamic scale 2**10, window 2, hysteresis 2, min 512; an inf
    gradient on rank 1 only. Expected scales, by DeepSpeed 0.19's rules: three
    clean steps double it (the first is not counted); the first overflow spends
    the hysteresis, the second halves; three clean steps double again and refill;
    the next three overflows reach the floor, and one more there stops the run."""
    plan = ["ok", "ok", "ok", "inf", "inf", "ok", "ok", "ok", "inf", "inf", "inf"]
    expected = [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048, 2048, 1024, 512]
    results = ranks.run(2, _overflow_sequence, stage, plan)
    for r in results:
        assert r["scales"] == expected, r
        assert all(r["ok"]), r
        assert r["skipped"] == plan.count("inf") and r["global_steps"] == len(plan)
        assert "again at the minimum loss scale 512" in r["floor"], r


def _lr_kwargs(rank, world_size):
    engine, _, _, sched = _engine(0, accum=2)
    for micro in range(4):
        engine.backward(engine(batch("mlp", rank, micro)).pow(2).mean())
        engine.step(lr_kwargs={"last_batch_iteration": 7 + micro})  # reaches the scheduler at boundaries only
    return sched.last_batch_iteration, engine.get_lr()


def test_step_passes_lr_kwargs_to_the_scheduler(ranks):
    """DeepSpeed's engine.step(lr_kwargs=...) calls lr_scheduler.step(**lr_kwargs)."""
    it, lr = ranks.run(1, _lr_kwargs)[0]
    assert it == 10 and lr == pytest.approx([SCHED["warmup_max_lr"]]), (it, lr)  # past warmup: max_lr (rounded)


# ----------------------------------------------------------------------- checkpoints
def _train(engine, rank, steps, start):
    accum = engine.gradient_accumulation_steps()
    for step in range(start, start + steps):
        for micro in range(accum):
            loss = engine(batch("mlp", rank, step * accum + micro)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()


def _equal_nested(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_nested(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _resume(rank, world_size, stage, ckpt_dir, extra):
    engine, *_ = _engine(stage, **extra)
    _train(engine, rank, 3, 0)
    client = {"epoch": 3, "names": ["a", "b"], "t": torch.arange(4)}
    engine.save_checkpoint(ckpt_dir, tag="mid", client_state=client)
    _train(engine, rank, 3, 3)
    expected = ds_checkpoint.model_state_dict(engine), ds_checkpoint.optimizer_state_dict(engine), engine.get_lr()
    fresh, *_ = _engine(stage, seed=1, **extra)  # other weights, no optimizer state
    path, got_client = fresh.load_checkpoint(ckpt_dir)  # the tag comes from 'latest'
    assert path == os.path.join(ckpt_dir, "mid", "mp_rank_00_model_states.pt")
    assert _equal_nested(got_client, client)
    assert (fresh.global_steps, fresh.micro_steps) == (3, 0)  # DeepSpeed does not restore micro_steps
    _train(fresh, rank, 3, 3)
    got = ds_checkpoint.model_state_dict(fresh), ds_checkpoint.optimizer_state_dict(fresh), fresh.get_lr()
    assert _equal_nested(expected, got)
    if fresh.loss_scaler is not None:
        assert fresh.loss_scaler.state_dict() == engine.loss_scaler.state_dict()
    return True


@pytest.mark.parametrize("stage,extra", [(0, {}), (1, {}), (2, {}), (3, {}),
                                         (1, {"fp16": {"enabled": True, "loss_scale_window": 2}}),
                                         (3, {"bf16": {"enabled": True}})])
def test_resume_is_bit_exact(ranks, tmp_path, stage, extra):
    """Train 3 steps, save, train 3 == load into a differently initialized engine, train 3."""
    assert all(ranks.run(2, _resume, stage, str(tmp_path), extra))


def _save(rank, world_size, stage, ckpt_dir):
    engine, *_ = _engine(stage)
    _train(engine, rank, 2, 0)
    engine.save_checkpoint(ckpt_dir, client_state={"rank": rank})
    return engine.global_steps


def _load_elsewhere(rank, world_size, stage, ckpt_dir, tag):
    engine, *_ = _engine(stage, seed=1)
    path, client = engine.load_checkpoint(ckpt_dir, tag=tag)
    saved = torch.load(path, weights_only=False)
    optim_file = os.path.join(os.path.dirname(path), saved[ds_checkpoint.OWN]["optim_file"])
    saved_optim = torch.load(optim_file, weights_only=False)["optimizer"]
    return client == {"rank": 0} and _equal_nested(saved["module"], ds_checkpoint.model_state_dict(engine)) and \
        _equal_nested(saved_optim, ds_checkpoint.optimizer_state_dict(engine))


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_reloads_at_another_world_size(ranks, tmp_path, stage):
    """Saved on 2 ranks, loaded on 4: the full model and optimizer states come back
    unchanged (ZeRO-1's flat states and FSDP's are gathered, not per rank). The
    client_state stored is rank 0's, as in DeepSpeed."""
    (steps, _) = ranks.run(2, _save, stage, str(tmp_path))
    assert (tmp_path / "latest").read_text() == f"global_step{steps}"
    assert all(ranks.run(4, _load_elsewhere, stage, str(tmp_path), f"global_step{steps}"))


def _missing(rank, world_size, ckpt_dir):
    engine, *_ = _engine(1)
    with pytest.warns(UserWarning, match="no 'latest' file"):
        assert engine.load_checkpoint(ckpt_dir) == (None, None)
    engine.save_checkpoint(ckpt_dir, tag="real")
    with pytest.raises(ValueError, match=r"no checkpoint with tag 'nope' .*tags there: \['real'\]"):
        engine.load_checkpoint(ckpt_dir, tag="nope")  # a typo must not train from scratch (DeepSpeed asserts too)
    with pytest.raises(ValueError, match="different tags"):
        engine.save_checkpoint(ckpt_dir, tag=f"t{rank}")
    return True


def test_missing_checkpoint_and_mismatched_tags(ranks, tmp_path):
    assert all(ranks.run(2, _missing, str(tmp_path)))


def _across_stages(rank, world_size, ckpt_dir):
    """Model states are the plain model's, so they load at any stage; optimizer
    states have a per-stage form and refuse to load elsewhere."""
    saved, *_ = _engine(3)
    _train(saved, rank, 2, 0)
    saved.save_checkpoint(ckpt_dir, tag="s3")
    weights = ds_checkpoint.model_state_dict(saved)
    other, *_ = _engine(1, seed=1)
    before = ds_checkpoint.model_state_dict(other)
    with pytest.raises(ValueError, match=r"is in the 'fsdp full' form, this engine needs 'zero1 flat master'"):
        other.load_checkpoint(ckpt_dir, "s3")
    assert _equal_nested(before, ds_checkpoint.model_state_dict(other))  # refused before changing anything
    other.load_checkpoint(ckpt_dir, "s3", load_optimizer_states=False)
    assert _equal_nested(weights, ds_checkpoint.model_state_dict(other))
    master = torch.cat([p.master.detach() for p in other.zero1.parts])  # rebuilt from the loaded weights
    flat = torch.cat([p.detach().reshape(-1) for p in other.module.parameters()])
    n = master.numel()
    assert torch.equal(master[: max(0, min(n, flat.numel() - rank * n))], flat[rank * n: (rank + 1) * n])
    return True


def test_weights_load_across_stages_optimizer_state_does_not(ranks, tmp_path):
    assert all(ranks.run(2, _across_stages, str(tmp_path)))


def _deepspeed_layout(rank, world_size, ckpt_dir):
    """Model files in DeepSpeed's layout both ways (deepspeed/runtime/engine.py 0.19:
    _common_checkpoint_state, client_state merged at the top level, per-rank ZeRO
    optimizer files), and checkpoints of earlier zeroshard versions."""
    ours, *_ = _engine(0)
    _train(ours, rank, 2, 0)
    with pytest.raises(ValueError, match=r"client_state keys \['module'\] are entries of the checkpoint"):
        ours.save_checkpoint(ckpt_dir, tag="clash", client_state={"module": 1})
    ours.save_checkpoint(ckpt_dir, tag="zs0", client_state={"epoch": 3})
    saved = torch.load(os.path.join(ckpt_dir, "zs0", ds_checkpoint.MODEL_FILE), weights_only=False)
    # What DeepSpeed's load_checkpoint reads from a stage-0 model file, with the client's keys beside them.
    assert {"module", "optimizer", "lr_scheduler", "global_steps", "skipped_steps", "dp_world_size", "mp_world_size",
            "epoch"} <= saved.keys() and saved["dp_world_size"] == world_size and saved["epoch"] == 3
    assert saved["optimizer"]["state"] and not os.path.exists(os.path.join(ckpt_dir, "zs0", ds_checkpoint.OPTIM_FILE))
    expected = ds_checkpoint.model_state_dict(ours), ours.optimizer.state_dict(), ours.lr_scheduler.state_dict()
    assert ours.global_samples == 32  # 2 steps of 4 x 2 micro-batches x 2 ranks

    # The same state written as DeepSpeed writes it: its own entries, the client's merged in; at stage 1/2 the
    # optimizer in per-rank partitions that zeroshard cannot read.
    ds = {"module": expected[0], "buffer_names": [], "optimizer": expected[1], "param_shapes": None,
          "frozen_param_shapes": None, "shared_params": None, "frozen_param_fragments": None, "lr_scheduler": expected[2],
          "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": 2, "global_samples": 32,
          "dp_world_size": world_size, "mp_world_size": 1, "ds_config": {}, "ds_version": "0.19.8",
          "checkpoint_parallel_dimensions": {"pp": 1, "tp": 1}, "sparse_tensor_module_names": set(), "epoch": 3}
    # DeepSpeed's fp16 optimizer's own state dict (FP16_Optimizer.state_dict: fp32 masters flattened per group)
    ds_fp16 = {"dynamic_loss_scale": True, "cur_scale": 2.0**16, "cur_iter": 2, "optimizer_state_dict": expected[1],
               "fp32_groups_flat": [torch.zeros(8)], "clip_grad": 0.0}
    if rank == 0:
        for tag, optimizer in (("ds0", expected[1]), ("ds1", None), ("ds0fp16", ds_fp16)):
            os.makedirs(os.path.join(ckpt_dir, tag))
            torch.save({**ds, "optimizer": optimizer}, os.path.join(ckpt_dir, tag, ds_checkpoint.MODEL_FILE))
        for r in range(world_size):
            torch.save({"optimizer_state_dict": {}}, os.path.join(ckpt_dir, "ds1", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        os.makedirs(os.path.join(ckpt_dir, "ds3"))
        torch.save({"module": {}}, os.path.join(ckpt_dir, "ds3", "zero_pp_rank_0_mp_rank_00_model_states.pt"))
        old = {"module": expected[0], "client_state": {"epoch": 3}, "global_steps": 2, "global_samples": 32,
               "micro_steps": 4, "skipped_steps": 0, "lr_scheduler": expected[2], "loss_scaler": None, "zero_stage": 0,
               "world_size": world_size, "ds_config": {}}  # zeroshard's own layout before this one
        os.makedirs(os.path.join(ckpt_dir, "old"))
        torch.save(old, os.path.join(ckpt_dir, "old", ds_checkpoint.MODEL_FILE))
        torch.save({"optimizer": expected[1], "format": "torch", "zero_stage": 0},
                   os.path.join(ckpt_dir, "old", ds_checkpoint.OPTIM_FILE))
    torch.distributed.barrier()

    def restored(engine, client, with_optimizer=True):
        return (client == {"epoch": 3} and engine.global_steps == 2 and engine.global_samples == 32
                and _equal_nested(ds_checkpoint.model_state_dict(engine), expected[0])
                and engine.lr_scheduler.state_dict() == expected[2]
                and (not with_optimizer or _equal_nested(engine.optimizer.state_dict(), expected[1])))

    for tag in ("zs0", "ds0", "old"):
        fresh, *_ = _engine(0, seed=1)
        assert restored(fresh, fresh.load_checkpoint(ckpt_dir, tag=tag)[1]), tag
    zero1, *_ = _engine(1, seed=1)
    with pytest.raises(ValueError, match="DeepSpeed's ZeRO partitions .* load_optimizer_states=False"):
        zero1.load_checkpoint(ckpt_dir, tag="ds1")
    assert restored(zero1, zero1.load_checkpoint(ckpt_dir, tag="ds1", load_optimizer_states=False)[1], False)
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3 checkpoint.*zero_to_fp32.py"):
        zero1.load_checkpoint(ckpt_dir, tag="ds3")
    stage0, *_ = _engine(0, seed=1)  # was KeyError('param_groups')
    with pytest.raises(ValueError, match="DeepSpeed's fp16/bf16 optimizer's .* load_optimizer_states=False"):
        stage0.load_checkpoint(ckpt_dir, tag="ds0fp16")
    assert restored(stage0, stage0.load_checkpoint(ckpt_dir, tag="ds0fp16", load_optimizer_states=False)[1], False)
    return True


def test_checkpoints_in_deepspeeds_layout(ranks, tmp_path):
    """DeepSpeed reads the weights (stage 0: all) of a zeroshard checkpoint, zeroshard a
    DeepSpeed stage 0-2 checkpoint's weights, scheduler and counters (stage 0: its
    optimizer too), refusing its partitioned states with the route that works."""
    assert all(ranks.run(2, _deepspeed_layout, str(tmp_path)))


def _accessors(rank, world_size, ckpt_dir):
    """DeepSpeed engine methods scripts and trainers call (HF Trainer: save_16bit_model,
    zero_optimization_stage); each raised AttributeError."""
    engine, *_ = _engine(3, accum=2, bf16={"enabled": True})
    assert (engine.zero_optimization_stage(), engine.fp16_enabled(), engine.bfloat16_enabled()) == (3, False, True)
    assert engine.gradient_clipping() == 0.05 and engine.dp_world_size == world_size
    assert engine.get_mom() == [(0.9, 0.999)] and not engine.was_step_applied()
    # as DeepSpeed (which casts the model before its fp32 master copies it), training starts from the bf16 values
    start, init = engine.module_state_dict(), build("mlp", seed=0).state_dict()
    assert start.keys() == init.keys() and all(torch.equal(start[k], v.bfloat16().float()) for k, v in init.items())
    for micro in range(2):  # a boundary set by hand: a step on every micro-batch instead of every 2nd
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(batch("mlp", rank, micro)).float().pow(2).mean())
        engine.step()
    assert engine.global_steps == 2 and engine.was_step_applied()
    assert engine.save_16bit_model(ckpt_dir, "model.bin")
    saved, full = torch.load(os.path.join(ckpt_dir, "model.bin")), engine.module_state_dict()
    assert saved.keys() == full.keys() and all(v.dtype == torch.bfloat16 for v in saved.values())
    assert all(torch.equal(saved[k], v.to(torch.bfloat16)) for k, v in full.items())
    return True


def test_deepspeed_engine_accessors(ranks, tmp_path):
    assert all(ranks.run(2, _accessors, str(tmp_path)))


# ------------------------------------------------------------ initialize surface
def _surface(rank, world_size):
    model = build("mlp")
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    data = [torch.randn(5) for _ in range(32)]
    cfg = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    engine, optimizer, loader, sched = initialize(model=model, optimizer=opt, training_data=data, config=cfg,
                                                  lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))
    assert optimizer is opt and len(opt.param_groups) == 2 and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    # DeepSpeedEngine holds the model as `module`: scripts save engine.state_dict() and filter on "module." (were "wrapped.")
    assert list(engine.state_dict()) == ["module." + k for k in model.state_dict()] and engine.module is model
    assert [n for n, _ in engine.named_parameters()] == ["module." + n for n, _ in model.named_parameters()]
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and sched.optimizer is opt
    assert engine.train_batch_size() == 16 and engine.train_micro_batch_size_per_gpu() == 4
    assert engine.local_rank == rank and engine.module is model and engine.scale is model.scale  # attribute pass-through
    for x in loader:
        assert x.shape == (4, 5)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert engine.global_steps == 32 // 16 and engine.get_lr() == [1e-2 * 0.25] * 2
    # no gradient_clipping key: DeepSpeed's default, 1.0 (zeroshard's was 0, no clipping)
    assert engine.gradient_clipping() == 1.0 and engine.get_global_grad_norm() is not None
    return [p.detach().clone() for p in model.parameters()]


def test_initialize_with_user_optimizer_groups_scheduler_and_data(ranks):
    """A user optimizer with two param groups (ZeRO-1 keeps both: one master
    chunk per group), a scheduler factory, training_data -> a sharded loader;
    replicas stay identical."""
    a, b = ranks.run(2, _surface)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _offload_equals_plain(rank, world_size, stage, offload):
    plain, *_ = _engine(stage)
    moved, *_ = _engine(stage, zero_optimization={"stage": stage, offload: {"device": "cpu", "pin_memory": True}})
    if offload == "offload_optimizer" and stage == 1:
        assert all(part.master.device.type == "cpu" for part in moved.zero1.parts)
    else:
        assert moved.wrapped.cpu_offload.offload_params
    for engine in (plain, moved):
        _train(engine, rank, 2, 0)
    return all(torch.equal(a, b) for a, b in zip(plain.module.parameters(), moved.module.parameters()))


@pytest.mark.parametrize("stage,offload", [(1, "offload_optimizer"), (2, "offload_optimizer"), (3, "offload_param")])
def test_cpu_offload_trains_identically(ranks, stage, offload):
    """On a CPU compute device the offload moves are no-ops: same bits as without."""
    assert all(ranks.run(2, _offload_equals_plain, stage, offload))


def _initialize_errors(rank, world_size):
    cfg = _config(1)
    model = build("mlp")
    cases = [
        (dict(model=None, config=cfg), "model= is required"),
        (dict(model=model), "no config"),
        (dict(model=model, config=cfg, mpu=object()), r"model parallelism \(mpu=\) is not supported"),
        (dict(model=model, config=cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
         "both optimizer= and a config 'optimizer' section"),
        (dict(model=model, config=cfg, lr_scheduler=lambda o: None), "both lr_scheduler= and a config 'scheduler' section"),
        (dict(model=model, config=cfg, fsdp_kwargs={"forward_prefetch": True}), "fsdp_kwargs apply to ZeRO stages 2 and 3"),
        (dict(model=model, config=_config(3), fsdp_kwargs={"use_orig_params": False}), "use_orig_params=True"),
        (dict(model=model, config=_config(3, bf16={"enabled": True}),
              fsdp_kwargs={"mixed_precision": zs.MixedPrecision(param_dtype=torch.float16)}), "contradicts the config's torch.bfloat16"),
        (dict(model=model, config=cfg, model_parameters=[torch.nn.Parameter(torch.zeros(2))]), "not a parameter of model"),
        (dict(model=model, config={**MICRO_ONLY, "scheduler": cfg["scheduler"]}), "a 'scheduler' section needs an optimizer"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            initialize(**kwargs)
    engine, opt, _, _ = initialize(model=build("mlp"), config=MICRO_ONLY)  # no optimizer: inference only
    assert opt is None
    engine.backward(engine(batch("mlp", rank, 0)).sum())
    with pytest.raises(RuntimeError, match="step\\(\\) without an optimizer"):
        engine.step()
    return True


MICRO_ONLY = {"train_micro_batch_size_per_gpu": 4}


def test_initialize_errors_name_the_fix(ranks):
    assert all(ranks.run(2, _initialize_errors))


def _bucketed_step(rank, world_size, zero_extra):
    engine, *_ = _engine(3, zero_optimization={"stage": 3, **zero_extra})
    with zs.comm_stats() as stats:
        _train(engine, rank, 1, 0)
    return dict(stats.calls), list(engine.module.state_dict().values())  # full tensors: layouts differ


def test_deepspeed_bucket_and_persistence_keys_reach_the_engine(ranks):
    """reduce_bucket_size -> bucket_cap_mb (one reduce-scatter per micro-step instead
    of one per unit), stage3_param_persistence_threshold -> param_persistence_threshold
    (units at or under it are all-reduced, never gathered); the numbers stay
    bit-identical on 2 ranks (every sum is a + b)."""
    plain = ranks.run(2, _bucketed_step, {})
    bucketed = ranks.run(2, _bucketed_step, {"reduce_bucket_size": 5e8})
    persistent = ranks.run(2, _bucketed_step, {"stage3_param_persistence_threshold": 1e9})
    (calls, ref), (b_calls, b_params), (p_calls, p_params) = plain[0], bucketed[0], persistent[0]
    micro_steps = 2
    assert calls["reduce_scatter"] > micro_steps and b_calls["reduce_scatter"] == micro_steps
    assert p_calls.get("all_gather", 0) == 0 and p_calls.get("reduce_scatter", 0) == 0 and p_calls["all_reduce"] > 0
    assert all(torch.equal(a, b) for a, b in zip(ref, b_params)) and all(torch.equal(a, b) for a, b in zip(ref, p_params))


def _zero_plus_plus(rank, world_size, zero_extra):
    engine, *_ = _engine(3, zero_optimization={"stage": 3, **zero_extra})
    handles = [u._handle for u in zs.FSDP.fsdp_modules(engine.module) if u._handle is not None]
    _train(engine, rank, 1, 0)
    return ([h.quant is not None for h in handles if h.sharded], [h.hpz is not None for h in handles if h.sharded])


def test_deepspeed_zero_plus_plus_keys_reach_the_engine(ranks):
    """zero_quantized_weights -> qwZ (quantized_all_gather), zero_hpz_partition_size
    -> hpZ (hpz_group_size); before, both were ignored as 'may be typos'."""
    quant, hpz = ranks.run(4, _zero_plus_plus, {"zero_quantized_weights": True, "zero_hpz_partition_size": 2})[0]
    assert quant and all(quant) and hpz and all(hpz)
    quant, hpz = ranks.run(4, _zero_plus_plus, {"zero_hpz_partition_size": 1})[0]
    assert not any(quant) and not any(hpz)


# ------------------------------------------------------- parameters without gradient
class _TwoHeads(torch.nn.Module):
    """A head that only some steps (and some ranks) use: MoE routing, multi-task batches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)

    def forward(self, x, use_b: bool):
        h = self.trunk(x).relu()
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _unused_head(rank, world_size, stage):
    """Head b: used by rank 0 on step 0 only. DeepSpeed's data parallelism gives a
    trainable parameter without gradient zeros before the all-reduce, so every
    rank reduces the same elements and AdamW still moves it (momentum, decay):
    reproduced here by hand on a plain replica, with DeepSpeed's sum then x 1/N."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    engine, *_ = initialize(model=_TwoHeads(), config=cfg)
    ref = _TwoHeads()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        use_b = step == 0 and rank == 0
        engine.backward(engine(x, use_b).pow(2).mean())
        engine.step()
        ref(x, use_b).pow(2).mean().backward()
        for p in ref.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.distributed.all_reduce(g)
            p.grad = g.mul_(1.0 / world_size)
        opt.step()
        opt.zero_grad()
    ours = dict(engine.module.named_parameters())
    return {n: torch.equal(p, ours[n]) for n, p in ref.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1])
def test_parameters_without_gradient_train_as_in_deepspeed(ranks, stage):
    """Stage 0 ran torch DDP, which raised at the next forward ('Expected to have
    finished reduction in the prior iteration') after reducing only some buckets."""
    for same in ranks.run(2, _unused_head, stage):
        assert all(same.values()), same


# ------------------------------------------------------------ no_sync
def _no_sync(rank, world_size, stage):
    """engine.no_sync() against DDP's: the first backward (at a boundary, accumulation
    1) stays local, the second one's reduction covers both, as DeepSpeed's."""
    ref = DistributedDataParallel(build("mlp"))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    sched_ref = WarmupLR(opt_ref, **SCHED)
    engine, *_ = _engine(stage, accum=1, clip=0.0)
    with zs.comm_stats() as stats:
        for step in range(2):
            xs = [batch("mlp", rank, 2 * step + k) for k in (0, 1)]
            with ref.no_sync():
                ref(xs[0]).pow(2).mean().backward()
            ref(xs[1]).pow(2).mean().backward()
            opt_ref.step()
            sched_ref.step()
            opt_ref.zero_grad()
            with engine.no_sync():
                assert engine.is_gradient_accumulation_boundary()
                engine.backward(engine(xs[0]).pow(2).mean())
                assert not stats.calls, "no communication inside no_sync"
                with pytest.raises(RuntimeError, match="step\\(\\) inside no_sync"):
                    engine.step()
                with pytest.raises(RuntimeError, match="entered again"):
                    with engine.no_sync():
                        pass
            engine.backward(engine(xs[1]).pow(2).mean())
            engine.step()
            stats.calls.clear()
    assert engine.global_steps == 2
    return all(torch.equal(a, b) for a, b in zip(ref.parameters(), engine.module.parameters()))


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_as_ddp(ranks, stage):
    """2 ranks: stage 0 sums then halves (DDP halves then sums: the same bits for
    N = 2); ZeRO-1 equals DDP without clipping (see the module docstring)."""
    assert all(ranks.run(2, _no_sync, stage))


def _no_sync_sharded(rank, world_size):
    engine, *_ = _engine(2)
    with pytest.raises(ValueError, match="no_sync\\(\\) at ZeRO stage 2.*Fix"):
        with engine.no_sync():
            pass
    return True


def test_no_sync_is_refused_with_sharded_gradients(ranks):
    assert all(ranks.run(2, _no_sync_sharded))


# ------------------------------------------------------------ failed saves and loads
def _failed_save_over_a_reused_tag(rank, world_size, stage, ckpt_dir):
    """A save over a reused tag that dies after the optimizer file (here: the model
    file's write fails) left the new optimizer state beside the old model file, and a
    load mixed them silently. The optimizer file is now named per save and the model
    file names its own; rank 0's error reaches every rank (rank 1 waited in a barrier
    for the process group's timeout)."""
    from unittest import mock

    from zeroshard import checkpoint

    engine, *_ = _engine(stage)
    _train(engine, rank, 2, 0)
    engine.save_checkpoint(ckpt_dir, tag="last")
    expected = copy.deepcopy((ds_checkpoint.model_state_dict(engine), ds_checkpoint.optimizer_state_dict(engine)))
    _train(engine, rank, 2, 2)  # (the first are the live parameters at stages 0/1)
    real = checkpoint.save

    def dies_at_the_model_file(obj, path):
        if os.path.basename(path) == ds_checkpoint.MODEL_FILE:
            raise OSError("disk full")
        real(obj, path)

    with mock.patch.object(checkpoint, "save", dies_at_the_model_file):
        with pytest.raises((OSError, RuntimeError), match="disk full"):
            engine.save_checkpoint(ckpt_dir, tag="last")
    fresh, *_ = _engine(stage, seed=1)
    fresh.load_checkpoint(ckpt_dir, tag="last")
    assert fresh.global_steps == 2
    got = (ds_checkpoint.model_state_dict(fresh), ds_checkpoint.optimizer_state_dict(fresh))
    assert _equal_nested(expected, got)
    engine.save_checkpoint(ckpt_dir, tag="last")  # the next save removes the dead one's optimizer file
    torch.distributed.barrier()
    return sorted(os.listdir(os.path.join(ckpt_dir, "last")))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_failed_save_over_a_reused_tag_keeps_the_previous_checkpoint(ranks, tmp_path, stage):
    for files in ranks.run(2, _failed_save_over_a_reused_tag, stage, str(tmp_path)):
        assert len(files) == 2 and files[0] == ds_checkpoint.MODEL_FILE and files[1].startswith("zero_optim_states."), files


def _failed_load_changes_nothing(rank, world_size, stage, ckpt_dir):
    model = build("mlp")
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
              {"params": [p for n, p in model.named_parameters() if not n.endswith("weight")], "weight_decay": 0.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = initialize(model=model, model_parameters=groups, config=_config(stage))
    _train(engine, rank, 1, 0)
    engine.save_checkpoint(ckpt_dir, tag="two_groups")
    other, *_ = _engine(stage, seed=1)  # one param group
    before = ds_checkpoint.model_state_dict(other)
    with pytest.raises(ValueError, match="param groups"):
        other.load_checkpoint(ckpt_dir, tag="two_groups")
    unchanged = other.global_steps == 0 and _equal_nested(before, ds_checkpoint.model_state_dict(other))
    engine.save_checkpoint(ckpt_dir, tag="adamw")
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}}
    sgd_engine, *_ = _engine(stage, seed=1, **sgd)
    _train(sgd_engine, rank, 1, 0)
    sgd_engine.save_checkpoint(ckpt_dir, tag="sgd")
    for engine, tag, missing in ((_engine(stage, seed=2, **sgd)[0], "adamw", "['dampening', 'momentum']"),
                                 (_engine(stage, seed=2)[0], "sgd", "['betas', 'eps']")):
        before = ds_checkpoint.model_state_dict(engine)
        with pytest.raises(ValueError, match=re.escape(f"lacks {missing} in param group 0, which this engine's")):
            engine.load_checkpoint(ckpt_dir, tag=tag)
        unchanged = unchanged and engine.global_steps == 0 and _equal_nested(before, ds_checkpoint.model_state_dict(engine))
    return unchanged


def _scheduler_changed(rank, world_size, stage, ckpt_dir):
    no_sched = {k: v for k, v in _config(stage).items() if k != "scheduler"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved, *_ = initialize(model=build("mlp"), config=no_sched)
        _train(saved, rank, 1, 0)
        saved.save_checkpoint(ckpt_dir, tag="no_sched")
        _engine(stage)[0].save_checkpoint(ckpt_dir, tag="warmup")
        lam = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # noqa: E731 - adds 'initial_lr' to the groups
        resumed, *_ = initialize(model=build("mlp", seed=1), config=no_sched, lr_scheduler=lam)
        resumed.load_checkpoint(ckpt_dir, tag="no_sched")  # was refused as "another optimizer" ('initial_lr')
        loaded = _equal_nested(ds_checkpoint.model_state_dict(saved), ds_checkpoint.model_state_dict(resumed))
        other, *_ = initialize(model=build("mlp", seed=1), config=no_sched, lr_scheduler=lam)
    before = ds_checkpoint.model_state_dict(other)
    with pytest.raises(ValueError, match=r"LR scheduler state in .* does not load into this engine's LambdaLR \(KeyError"):
        other.load_checkpoint(ckpt_dir, tag="warmup")  # raised from the scheduler's load, after the weights
    return loaded and _equal_nested(before, ds_checkpoint.model_state_dict(other))


def _failed_load_leaves_the_scheduler(rank, world_size, ckpt_dir):
    def seq(opt):
        lam = torch.optim.lr_scheduler.LambdaLR
        return torch.optim.lr_scheduler.SequentialLR(opt, [lam(opt, lambda s: 1.0), lam(opt, lambda s: 0.5)], milestones=[2])

    no_sched = {k: v for k, v in _config(0).items() if k != "scheduler"}
    model = build("mlp")
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
              {"params": [p for n, p in model.named_parameters() if not n.endswith("weight")], "weight_decay": 0.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved, *_ = initialize(model=model, model_parameters=groups, config=no_sched, lr_scheduler=seq)
        _train(saved, rank, 3, 0)
        saved.save_checkpoint(ckpt_dir, tag="t")
        other, *_ = initialize(model=build("mlp", seed=1), config=no_sched, lr_scheduler=seq)  # one param group
    before = [s.last_epoch for s in other.lr_scheduler._schedulers]
    with pytest.raises(ValueError, match="param groups"):
        other.load_checkpoint(ckpt_dir, tag="t")
    return [s.last_epoch for s in other.lr_scheduler._schedulers] == before != [s.last_epoch for s in saved.lr_scheduler._schedulers]


def test_a_failed_load_leaves_the_scheduler_as_it_was(ranks, tmp_path):
    """The scheduler check tried the saved state on a shallow copy, which shares SequentialLR's
    child schedulers: they took the saved epochs although the load then failed (review finding)."""
    assert all(ranks.run(2, _failed_load_leaves_the_scheduler, str(tmp_path)))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_resume_under_another_scheduler(ranks, tmp_path, stage):
    """A client LR scheduler over a checkpoint saved without one loads (an optimizer check compared
    every group key, the scheduler's 'initial_lr' too); another scheduler's state is refused before
    anything loads."""
    assert all(ranks.run(2, _scheduler_changed, stage, str(tmp_path)))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_failed_load_changes_nothing(ranks, tmp_path, stage):
    """An optimizer state that does not fit raised only after the weights were loaded
    (16 of 17 tensors overwritten at stage 3): it is now checked first. So is another
    optimizer's state: SGD's into AdamW raised a KeyError 'step' after the weights had
    loaded, AdamW's into SGD loaded and failed at the first step ('momentum')."""
    assert all(ranks.run(2, _failed_load_changes_nothing, stage, str(tmp_path)))


def _step_without_backward(rank, world_size, stage, precision):
    extra = {precision: {"enabled": True}} if precision else {}
    engine, opt, _, _ = _engine(stage, accum=1, **extra)
    params = lambda: [p.detach().clone() for p in engine.module.parameters()]  # noqa: E731
    before = params()
    with pytest.raises(ValueError, match=r"loss must be the tensor the model's output gave, got a float \(0\.5\)"):
        engine.backward(0.5)  # was an AttributeError from inside backward
    engine.step()  # no backward on any rank
    untouched = all(torch.equal(a, b) for a, b in zip(before, params()))
    no_state = not any(opt.state.values())
    norm_without = float(engine.get_global_grad_norm())
    x = batch("mlp", rank, 0)
    if rank == 0 or stage != 1:  # ZeRO-1: a backward on one rank only; the others contribute zeros, every rank steps
        engine.backward(engine(x).pow(2).mean())
    engine.step()
    stepped = not all(torch.equal(a, b) for a, b in zip(before, params()))
    return untouched, no_state, norm_without, stepped, [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage, precision", [(1, None), (0, "bf16"), (1, "bf16"), (0, None), (3, None)])
def test_a_step_without_any_backward_changes_nothing(ranks, stage, precision):
    """ZeRO-1 (also stage 0's bf16 master) filled missing gradients with zeros and
    stepped: AdamW's weight decay and step count moved every weight of a model
    that had no gradient at all (DeepSpeed's stages 1-3 fail with a KeyError
    there; its stage 0 and torch optimizers skip parameters without .grad)."""
    results = ranks.run(2, _step_without_backward, stage, precision)
    for untouched, no_state, norm_without, stepped, _ in results:
        assert untouched and no_state and norm_without == 0.0 and stepped
    if stage < 2:  # replicated parameters (stage 3's are this rank's shards)
        assert all(torch.equal(a, b) for a, b in zip(results[0][4], results[1][4]))


def _client_state_and_frozen(rank, world_size, stage, ckpt_dir):
    engine, *_ = _engine(stage, steps_per_print=7)
    frozen = next(n for n, _ in engine.module.named_parameters())
    dict(engine.module.named_parameters())[frozen].requires_grad_(False)
    _train(engine, rank, 1, 0)
    full = ds_checkpoint.model_state_dict(engine)
    engine.save_checkpoint(ckpt_dir, tag="t", client_state={"rank": rank}, exclude_frozen_parameters=True)
    saved = torch.load(os.path.join(ckpt_dir, "t", ds_checkpoint.MODEL_FILE), weights_only=False)["module"]
    _, client = engine.load_checkpoint(ckpt_dir, tag="t", load_module_strict=False)
    return sorted(set(full) - set(saved)), client, (engine.steps_per_print(), engine.wall_clock_breakdown())


@pytest.mark.parametrize("stage", [1, 3])
def test_per_rank_client_state_at_stage_3_and_frozen_parameters_left_out(ranks, tmp_path, stage):
    """As DeepSpeed: at stage 3 (a model file per rank there) each rank gets its
    own client_state back, at stages 0-2 rank 0's; exclude_frozen_parameters
    (was a TypeError) leaves the frozen weights out of the model file; and the
    steps_per_print / wall_clock_breakdown getters exist (were AttributeErrors
    naming the user's model)."""
    for rank, (left_out, client, getters) in enumerate(ranks.run(2, _client_state_and_frozen, stage, str(tmp_path))):
        assert left_out == ["inp.weight"], left_out
        assert client == {"rank": rank if stage == 3 else 0}
        assert getters == (7, False)


def _direct_backward(rank, world_size, stage, accum):
    engine, *_ = _engine(stage, accum=accum)
    before = [p.detach().clone() for p in engine.module.parameters()]
    for micro in range(accum):
        engine(batch("mlp", rank, micro)).float().pow(2).mean().backward()  # not engine.backward(loss)
        if micro < accum - 1:
            engine.step()
    with pytest.raises(RuntimeError, match=r"engine\.backward\(loss\)"):
        engine.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.zero_grad()
    _train(engine, rank, 1, 0)  # the engine's own loop still steps
    return unchanged and engine.global_steps == 1


@pytest.mark.parametrize("stage,accum", [(0, 1), (1, 2), (3, 2)])
def test_loss_backward_instead_of_engine_backward_is_refused(ranks, stage, accum):
    """loss.backward() in place of engine.backward(loss) trained silently wrong:
    at stage 0 nothing was all-reduced (replicas 0.21 apart after 4 steps), with
    accumulation the gradients were gradient_accumulation_steps times too large.
    DeepSpeed raises at stage 0; zeroshard raises wherever the step would be wrong,
    before changing anything."""
    assert all(ranks.run(2, _direct_backward, stage, accum))


def _direct_backward_frozen_shard(rank, world_size, stage):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    m.weight.requires_grad_(False)  # 16 frozen + 4 trainable elements: rank 0's shard is all frozen
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = initialize(model=m, config=cfg)
    engine(batch("mlp", rank, 0)[:, :4]).pow(2).mean().backward()
    engine.step()
    engine(batch("mlp", rank, 1)[:, :4]).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"engine\.backward\(loss\)"):
        engine.step()
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_loss_backward_refusal_is_decided_by_every_rank(ranks, stage):
    """A rank whose shard holds only frozen elements sees no gradient: it went on
    into the step's collectives while the other raised, and waited for ever."""
    assert ranks.run(2, _direct_backward_frozen_shard, stage, timeout=60) == [True, True]


def _rank_without_a_batch(rank, world_size, stage):
    engine, *_ = _engine(stage, accum=2)
    for step in range(3):
        for micro in range(2):
            if not (rank == 1 and step == 1):  # rank 1 has no batch for one whole window
                engine.backward(engine(batch("mlp", rank, 2 * step + micro)).float().pow(2).mean())
            engine.step()
    return engine.global_steps == 3 and same_on_every_rank(engine.module.parameters())


@pytest.mark.parametrize("stage", [1])
def test_a_rank_without_a_batch_in_a_window_still_steps(ranks, stage):
    """The check for loss.backward() ran its all-reduce only on ranks that had no
    engine.backward in the window: it met the others' ZeRO-1 reduce-scatter.
    (Not stage 0: its all-reduce is in the boundary's engine.backward, as DeepSpeed's;
    nor 2/3, whose forward all-gathers.)"""
    assert ranks.run(2, _rank_without_a_batch, stage, timeout=60) == [True, True]


def _zero_grad_every_micro_step(rank, world_size, stage):
    out = []
    for clear in (False, True):
        engine, *_ = _engine(stage, accum=2)
        for i in range(4):
            engine.backward(engine(batch("mlp", rank, i)).float().pow(2).mean())
            engine.step()
            if clear:
                engine.zero_grad()  # the usual habit after step(); mid-window at odd i
        out.append([p.detach().clone() for p in engine.module.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_inside_an_accumulation_window_keeps_it_at_stages_2_3(ranks, stage):
    """engine.zero_grad() after every engine.step() dropped the window's earlier
    micro-batches at stages 2/3 (0.056 off after 3 steps); DeepSpeed keeps its
    partitioned accumulation, and so does zeroshard now."""
    assert ranks.run(2, _zero_grad_every_micro_step, stage) == [True, True]


def _config_differs(rank, world_size, key, values):
    cfg = _config(0)
    section, _, name = key.rpartition(".")
    (cfg.setdefault(section, {}) if section else cfg)[name] = values[rank]
    try:
        initialize(model=build("mlp"), config=cfg)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("key,values,shown", [
    ("gradient_clipping", (0.01, 0.0), "gradient_clipping is 0.01 on rank 0 but 0.0 on rank 1"),  # replicas drifted
    ("zero_optimization.stage", (0, 1), "zero.stage is 0 on rank 0 but 1 on rank 1"),  # timed out, naming others
    # a section set on one rank only was named as 'not set' on the rank that set it
    ("scheduler", ({"type": "WarmupLR", "params": {"warmup_num_steps": 3}}, None),
     "scheduler is {type: 'WarmupLR', params.warmup_num_steps: 3} on rank 0 but None on rank 1"),
    ("steps_per_print", (10, 10**9), None),  # logging on rank 0 only: no effect on training, allowed
    ("wall_clock_breakdown", (True, False), None),
])
def test_a_config_that_differs_across_ranks_is_refused(ranks, key, values, shown):
    for msg in ranks.run(2, _config_differs, key, values):
        assert msg is None if shown is None else shown in msg and "Fix: give every rank the same config" in msg, msg


def _mixed_backward(rank, world_size, stage, how):
    engine, *_ = _engine(stage, accum=2)
    before = [p.detach().clone() for p in engine.module.parameters()]
    x = batch("mlp", rank, 0).requires_grad_(how == "penalty")
    out = engine(x)
    loss = out.float().pow(2).mean()
    if how == "penalty":  # autograd.grad through the model (a gradient penalty) changes no gradient: not refused
        (g,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
        loss = loss + g.detach().pow(2).mean()
    engine.backward(loss)
    engine.step()
    out = engine(batch("mlp", rank, 1))
    if how == "mixed":
        out.float().pow(2).mean().backward()  # the window's second micro-step, not divided by 2
        with pytest.raises(RuntimeError, match=r"beside engine\.backward in this accumulation window"):
            engine.step()
        return all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.backward(out.float().pow(2).mean())
    engine.step()
    return engine.global_steps == 1


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("how", ["mixed", "penalty"])
def test_a_window_mixing_loss_backward_with_engine_backward_is_refused(ranks, stage, how):
    """engine.backward then loss.backward() in one accumulation window: the direct half
    was not divided by gradient_accumulation_steps and the step went on, silently wrong.
    A backward outside the engine that changes no gradient (autograd.grad for a penalty)
    is not refused."""
    assert all(ranks.run(2, _mixed_backward, stage, how))


def _gan(rank, world_size, clear):
    """DeepSpeed's DCGAN loop: two engines, G's loss goes through D's forward."""
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    D = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eG, *_ = initialize(model=G, config=cfg)
        eD, optD, *_ = initialize(model=D, config=cfg)
    bce = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        real, noise = torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)
        {"module": D.zero_grad, "optimizer": optD.zero_grad}[clear]()
        eD.backward(bce(eD(real), torch.ones(4, 1)))
        fake = eG(noise)
        eD.backward(bce(eD(fake.detach()), torch.zeros(4, 1)))
        eD.step()
        G.zero_grad()
        eG.backward(bce(eD(fake), torch.ones(4, 1)))  # through D's outputs, inside G's engine.backward
        eG.step()
    return eG.global_steps == eD.global_steps == 3


@pytest.mark.parametrize("clear", ["module", "optimizer"])
def test_two_engines_one_backward_through_both_is_not_refused(ranks, clear):
    """The review of the mixed-window check: D's output hook took G's engine.backward
    through D for a direct loss.backward(), and D's next step() raised."""
    assert all(ranks.run(2, _gan, clear))


def _one_rank_finds_the_checkpoint(rank, world_size, ckpt_dir, stage):
    engine, *_ = _engine(stage)
    _train(engine, rank, 1, 0)
    engine.save_checkpoint(os.path.join(ckpt_dir, "shared"))
    own = os.path.join(ckpt_dir, "shared" if rank == 0 else "empty")  # rank 1's disk has no checkpoint
    fresh, *_ = _engine(stage, seed=1)
    try:
        fresh.load_checkpoint(own)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("stage", [0, 3])
def test_load_checkpoint_found_on_one_rank_only_raises_on_every_rank(ranks, tmp_path, stage):
    """Rank 1 warned 'no latest file' and went on with its own weights while rank 0 loaded:
    replicas differed for good at stage 0, and at stage 3 gloo aborted rank 0 (size mismatch)."""
    for msg in ranks.run(2, _one_rank_finds_the_checkpoint, str(tmp_path), stage):
        assert msg and "ranks found different checkpoints" in msg and "rank 1 found no 'latest' file" in msg \
            and "Fix:" in msg, msg


def _scaler_kind_changed(rank, world_size, ckpt_dir, saved, resumed):
    fp16 = {"enabled": True, "loss_scale_window": 2}
    engine, *_ = _engine(1, fp16={**fp16, "loss_scale": saved})
    _train(engine, rank, 2, 0)
    engine.save_checkpoint(ckpt_dir, tag="t")
    fresh, *_ = _engine(1, seed=1, fp16={**fp16, "loss_scale": resumed})
    configured = fresh.loss_scaler.state_dict()
    with pytest.warns(UserWarning, match="fp16 loss scale, this engine's config asks for"):
        fresh.load_checkpoint(ckpt_dir, tag="t")
    weights_loaded = _equal_nested(ds_checkpoint.model_state_dict(fresh), ds_checkpoint.model_state_dict(engine))
    return fresh.loss_scaler.state_dict() == configured, weights_loaded, fresh.global_steps == engine.global_steps


@pytest.mark.parametrize("saved,resumed", [(128, 0), (0, 128), (128, 64)])
def test_resume_with_another_kind_of_loss_scale_keeps_the_configured_one(ranks, tmp_path, saved, resumed):
    """A static scale saved, a dynamic one configured: the load raised KeyError('cur_iter') after
    the weights and optimizer state were loaded. A dynamic scale saved, a static one configured (a
    run resumed after diverging): the static scaler got the saved dynamic scale, and could never
    lower it. Now the configured scaler stays as configured, with a warning, and the rest loads."""
    for kept, weights, steps in ranks.run(2, _scaler_kind_changed, str(tmp_path), saved, resumed):
        assert kept and weights and steps


def _scaler_settings_changed(rank, world_size, ckpt_dir):
    engine, *_ = _engine(1, fp16={"enabled": True, "initial_scale_power": 12, "min_loss_scale": 1024})
    _train(engine, rank, 2, 0)
    engine.save_checkpoint(ckpt_dir, tag="t")
    saved = engine.loss_scaler.state_dict()
    out = {}
    for name, fp16 in (("lower", {"min_loss_scale": 1, "loss_scale_window": 50, "hysteresis": 3}),
                       ("higher", {"min_loss_scale": 2.0**13})):
        fresh, *_ = _engine(1, seed=1, fp16={"enabled": True, **fp16})
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fresh.load_checkpoint(ckpt_dir, tag="t")
        s = fresh.loss_scaler
        out[name] = (str(seen[-1].message) if seen else "", s.min_scale, s.scale_window, s.delayed_shift,
                     s.cur_scale, s.cur_iter == saved["cur_iter"], s.cur_hysteresis)
    return saved["cur_scale"], out


def test_a_resumed_fp16_run_keeps_the_configs_loss_scaler_settings(ranks, tmp_path):
    """The saved scaler replaced the config's settings: a run stopped at min_loss_scale (whose error
    says 'Fix: lower fp16.min_loss_scale') resumed with the old floor whatever the config said.
    Now it resumes the scale and step count under the config's settings, with a warning."""
    for saved_scale, out in ranks.run(2, _scaler_settings_changed, str(tmp_path)):
        assert saved_scale == 4096.0
        msg, floor, window, hysteresis, scale, same_iter, left = out["lower"]
        assert "fp16.loss_scale_window, fp16.min_loss_scale, fp16.hysteresis differ" in msg, msg
        assert (floor, window, hysteresis, scale, same_iter) == (1.0, 50, 3, 4096.0, True) and left <= 2
        msg, floor, window, hysteresis, scale, same_iter, left = out["higher"]
        assert "fp16.min_loss_scale differ" in msg and (floor, scale, same_iter) == (8192.0, 8192.0, True), out


def _files_tags_and_one_bad_copy(rank, world_size, ckpt_dir):
    import shutil
    import socket
    import subprocess
    import sys

    engine, *_ = _engine(3)
    _train(engine, rank, 1, 0)
    out = {}
    # tags that cannot name a folder inside save_dir: 'latest' wrote the checkpoint, then failed on the
    # 'latest' file (leaving its temporary); '../x' wrote outside; 'a ' was lost by 'latest' (stripped)
    for tag in ("latest", "../escaped", " a", ""):
        with pytest.raises(ValueError, match="cannot name a checkpoint folder inside save_dir"):
            engine.save_checkpoint(ckpt_dir, tag=tag)
    with pytest.raises(ValueError, match="ranks passed different tags"):  # bad on one rank: the others waited
        engine.save_checkpoint(ckpt_dir, tag="step1" if rank == 0 else "step1 ")
    out["after bad tags"] = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
    # a killed save's temporary optimizer files: a dead writer's is removed by the next save, a live one's kept
    folder = os.path.join(ckpt_dir, "t")
    engine.save_checkpoint(ckpt_dir, tag="t")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    names = {"dead": f".zero_optim_states.{'a' * 12}.pt.{host}.{int(dead.stdout)}.{'b' * 12}.tmp",
             "live": f".zero_optim_states.{'c' * 12}.pt.{host}.{os.getppid()}.{'d' * 12}.tmp"}
    torch.distributed.barrier()
    if rank == 0:
        for name in names.values():
            open(os.path.join(folder, name), "wb").close()
    engine.save_checkpoint(ckpt_dir, tag="t")
    torch.distributed.barrier()
    out["temporaries left"] = sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))
    out["live"] = names["live"]
    # the optimizer file the model file names is missing: said so (was "holds no optimizer state")
    ckpt = torch.load(os.path.join(folder, ds_checkpoint.MODEL_FILE), weights_only=False)
    copies = [f"{ckpt_dir}_r{r}" for r in range(world_size)]  # node-local copies of the checkpoint
    if rank == 0:
        for copy_dir in copies:
            shutil.copytree(ckpt_dir, copy_dir)
        os.remove(os.path.join(copies[0], "t", ckpt["zeroshard"]["optim_file"]))
        with open(os.path.join(copies[1], "t", ckpt["zeroshard"]["optim_file"]), "r+b") as f:
            f.truncate(100)
    torch.distributed.barrier()
    with pytest.raises(ValueError, match="is missing zero_optim_states.*the optimizer file its model file names"):
        engine.load_checkpoint(copies[0], tag="t")
    # one rank's copy is damaged: every rank names it (rank 0 failed in the next collective, unnamed)
    try:
        engine.load_checkpoint(f"{ckpt_dir}_r1" if rank == 1 else ckpt_dir, tag="t")
        out["one bad copy"] = None
    except (ValueError, RuntimeError) as e:
        out["one bad copy"] = str(e)
    return out


def _model_file_edited(rank, world_size, ckpt_dir):
    engine, *_ = _engine(1)
    _train(engine, rank, 1, 0)
    engine.save_checkpoint(ckpt_dir, tag="t")
    path = os.path.join(ckpt_dir, "t", ds_checkpoint.MODEL_FILE)
    saved = torch.load(path, weights_only=False)
    said = {}
    for how in ("list", "module", "global_steps"):
        torch.distributed.barrier()
        if rank == 0:
            torch.save([1, 2] if how == "list" else {k: v for k, v in saved.items() if k != how}, path)
        torch.distributed.barrier()
        other, *_ = _engine(1, seed=1)
        before = ds_checkpoint.model_state_dict(other)
        try:
            other.load_checkpoint(ckpt_dir, tag="t")
        except ValueError as e:
            said[how] = str(e)
        said[how] = (said.get(how), _equal_nested(before, ds_checkpoint.model_state_dict(other)))
    return said


def test_a_model_file_without_its_entries_is_named_before_anything_loads(ranks, tmp_path):
    """A model file that is not a dict, or lacks 'module' or 'global_steps': an AttributeError or
    KeyError from inside the load, for 'global_steps' after the weights had loaded."""
    for said in ranks.run(2, _model_file_edited, str(tmp_path / "ck")):
        for how, held in (("list", "holds a list, not a model file"),
                          ("module", "holds a dict without 'module', not a model file"),
                          ("global_steps", "holds a dict without 'global_steps', not a model file")):
            msg, unchanged = said[how]
            assert msg and held in msg and "Fix: copy the tag folder again" in msg and unchanged, (how, msg)


def test_checkpoint_tags_temporaries_and_unreadable_files(ranks, tmp_path):
    for rank, out in enumerate(ranks.run(2, _files_tags_and_one_bad_copy, str(tmp_path / "ck"))):
        assert out["after bad tags"] == [], out
        assert out["temporaries left"] == [out["live"]], out
        msg = out["one bad copy"]
        if rank == 1:
            assert msg and "is truncated or damaged" in msg, msg
        else:
            assert msg and "rank 1 could not read the checkpoint" in msg and "is truncated or damaged" in msg, msg
