"""register_comm_hook: a hook replaces each unit's gradient collective.

Parity with torch FSDP1 running the same hook (``torch.equal``: outputs,
gradients, clipped norms, parameters after AdamW): torch's default hooks on
both engines, zeroshard's own hooks against torch's, the bf16/fp16
compression hooks, and a custom hook that sums instead of averaging (if
zeroshard ignored the hook it would average and differ from torch). Plus the
misuse errors and byte accounting of zeroshard's hooks."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zeroshard as zs
from parity import run_case, sum_hook

SHARDED = ["FULL_SHARD", "SHARD_GRAD_OP"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", SHARDED + ["NO_SHARD"])
@pytest.mark.parametrize("hook", ["default", "zeroshard", "sum"])
def test_hooks_match_torch(ranks, world_size, strategy, hook):
    ranks.run(world_size, run_case, {"comm_hook": hook, "strategy": strategy, "model": "gpt", "policy": "transformer"})


@pytest.mark.parametrize("hook", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_compression_hooks_match_torch(ranks, hook, strategy, use_orig_params):
    ranks.run(3, run_case, {"comm_hook": hook, "strategy": strategy, "use_orig_params": use_orig_params})


@pytest.mark.parametrize("hook,strategy,mp", [
    ("fp16", "FULL_SHARD", {"reduce_dtype": "bfloat16"}),
    ("bf16", "NO_SHARD", {"param_dtype": "bfloat16"}),
    ("fp16", "SHARD_GRAD_OP", {"param_dtype": "bfloat16", "reduce_dtype": "float32"}),
])
def test_compression_hooks_do_their_own_casts(ranks, hook, strategy, mp):
    """Under mixed precision torch FSDP1 hands its fp16/bf16 hooks the gradient
    without casting it to reduce_dtype first (nor back after): so must zeroshard,
    for torch's hooks and its own, or fp32 -> bf16 -> fp16 rounds twice."""
    ranks.run(2, run_case, {"comm_hook": hook, "strategy": strategy, "mp": mp, "optim": "sgd"})


def test_hook_with_mixed_precision_and_no_sync(ranks):
    # The hook receives the gradient already cast to reduce_dtype, as in torch.
    mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    ranks.run(2, run_case, {"comm_hook": "zeroshard", "mp": mp, "no_sync": True, "use_orig_params": True})


def _sum_differs_from_default(rank, world_size):
    def grads(hook):
        torch.manual_seed(0)
        model = zs.FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        if hook:
            model.register_comm_hook(model.process_group, sum_hook)
        model(torch.randn(4, 8) + rank).sum().backward()
        return model._handle.flat_param.grad.clone()

    summed, averaged = grads(True), grads(False)
    assert torch.allclose(summed, averaged * world_size, rtol=1e-5, atol=1e-6)
    assert not torch.equal(summed, averaged)
    return True


def test_custom_hook_really_replaces_the_reduction(ranks):
    assert all(ranks.run(2, _sum_differs_from_default))


def _misuse(rank, world_size):
    def model(**kw):
        return zs.FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({nn.Linear}), **kw)

    errors = []
    m = model()
    try:
        m.register_comm_hook(None, "not callable")
    except ValueError as e:
        errors.append(str(e))
    m.register_comm_hook(zs.comm_hooks.DefaultState(m.process_group), zs.comm_hooks.reduce_scatter_hook)
    assert all(u._handle.comm_hook is not None for u in m.fsdp_modules(m) if u._handle is not None)
    try:
        m.register_comm_hook(None, zs.comm_hooks.reduce_scatter_hook)
    except RuntimeError as e:
        errors.append(str(e))
    inner = model()
    inner(torch.randn(2, 4))  # the outer instance is the root now
    try:
        inner.module[0].register_comm_hook(None, sum_hook)
    except RuntimeError as e:
        errors.append(str(e))
    bucketed = model(bucket_cap_mb=1)
    try:
        bucketed.register_comm_hook(bucketed.process_group, sum_hook)
    except ValueError as e:
        errors.append(str(e))
    assert all(u._comm_hook is None for u in bucketed.fsdp_modules(bucketed))  # nothing half-registered
    try:
        zs.comm_hooks.DefaultState(None)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_misuse_is_refused_with_a_fix(ranks):
    errors = ranks.run(2, _misuse)[0]
    assert len(errors) == 5, errors
    for text, fragment in zip(errors, ["must be callable", "already registered", "root", "bucket_cap_mb", "process group"]):
        assert fragment in text and "zeroshard" in text, text


def _refused_before_backward(rank, world_size):
    """Each of these failed inside backward (a TypeError, torch's 'unknown
    parameter type') or was silently ignored; now refused up front, naming
    the unit and the fix. Returns {case: message}."""
    from torch.distributed.algorithms._comm_hooks import default_hooks as torch_hooks

    def model(**kw):
        return zs.FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(40, 40)),
                       auto_wrap_policy=zs.wrap.ModuleWrapPolicy({nn.Linear}), **kw)

    hooks = zs.comm_hooks
    cases = {
        "persistent unit, sharded hook": lambda: model(param_persistence_threshold=100).register_comm_hook(
            hooks.DefaultState(torch.distributed.group.WORLD), hooks.reduce_scatter_hook),
        "NO_SHARD, sharded hook": lambda: model(sharding_strategy=zs.ShardingStrategy.NO_SHARD).register_comm_hook(
            hooks.DefaultState(torch.distributed.group.WORLD), hooks.reduce_scatter_hook),
        "sharded, NO_SHARD hook": lambda: model().register_comm_hook(hooks.DefaultState(torch.distributed.group.WORLD), hooks.allreduce_hook),
        "torch's bf16 hook on CPU": lambda: model().register_comm_hook(
            torch_hooks.LowPrecisionState(torch.distributed.group.WORLD), torch_hooks.bf16_compress_hook),
    }
    said = {}
    for name, make in cases.items():
        try:
            make()
        except ValueError as e:
            said[name] = str(e)
    mixed = nn.Sequential(zs.FSDP(nn.Linear(4, 4), bucket_cap_mb=25), nn.Linear(4, 4))
    try:
        zs.FSDP(mixed)(torch.randn(2, 4))
    except ValueError as e:
        said["bucket_cap_mb on one unit"] = str(e)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    outer = zs.FSDP(inner, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({nn.Linear}))
    outer.module[0].register_comm_hook(hooks.DefaultState(torch.distributed.group.WORLD), hooks.reduce_scatter_hook)
    try:
        outer(torch.randn(2, 4))
    except RuntimeError as e:
        said["hook made an inner unit the root"] = str(e)
    return said


def test_hooks_and_buckets_that_cannot_work_are_refused_before_backward(ranks):
    said = ranks.run(2, _refused_before_backward)[0]
    assert len(said) == 6, said
    assert "unit 0 (Linear) calls hook(state, grad) (param_persistence_threshold keeps it whole)" in said[
        "persistent unit, sharded hook"]
    assert "calls hook(state, grad) (it is NO_SHARD), which reduce_scatter_hook(state" in said["NO_SHARD, sharded hook"]
    assert "calls hook(state, grad, output) (it is sharded), which allreduce_hook(state" in said["sharded, NO_SHARD hook"]
    assert "record_stream" in said["torch's bf16 hook on CPU"] and "zeroshard.comm_hooks.bf16_compress_hook" in said[
        "torch's bf16 hook on CPU"]
    assert "disagree on bucket_cap_mb" in said["bucket_cap_mb on one unit"]
    assert "register_comm_hook, no_sync, check_is_root" in said["hook made an inner unit the root"]
    assert all("Fix" in m for m in said.values()), said


def _hybrid_refused(rank, world_size):
    model = zs.FSDP(nn.Linear(4, 4), fsdp_group_size=2)
    try:
        model.register_comm_hook(model.process_group, sum_hook)
    except ValueError as e:
        return str(e)
    return None


def test_hybrid_sharding_refuses_hooks(ranks):
    for text in ranks.run(4, _hybrid_refused):
        assert text is not None and "hybrid" in text


def _bytes(rank, world_size, compressed):
    model = zs.FSDP(nn.Linear(64, 64))
    hooks = zs.comm_hooks
    if compressed:
        model.register_comm_hook(hooks.LowPrecisionState(model.process_group), hooks.bf16_compress_hook)
    else:
        model.register_comm_hook(hooks.DefaultState(model.process_group), hooks.reduce_scatter_hook)
    model(torch.randn(2, 64)).sum().backward()  # first backward: lazy init outside the window
    with zs.comm_stats() as stats:
        model(torch.randn(2, 64)).sum().backward()
    assert model.module.weight.grad is None and model._handle.flat_param.grad.dtype == torch.float32
    return stats.calls["reduce_scatter"], stats.bytes["reduce_scatter"]


def test_zeroshard_hooks_are_counted_and_compression_halves_the_bytes(ranks):
    calls, fp32 = ranks.run(2, _bytes, False)[0]
    calls_bf16, bf16 = ranks.run(2, _bytes, True)[0]
    assert calls == calls_bf16 == 1
    padded = 64 * 64 + 64  # weight + bias, even: no padding on 2 ranks
    assert fp32 == padded * 4 / 2 and bf16 == padded * 2 / 2


def _kept_output_and_wrapped_hook(rank, world_size):
    import functools

    import torch.distributed as dist
    import torch.distributed.fsdp as tfsdp

    def adapter(fn):  # an all-reduce hook made usable on sharded units, decorated with functools.wraps
        @functools.wraps(fn)
        def wrapper(state, grad, output=None):
            fn(state, grad)
            if output is not None:
                output.copy_(grad.view(world_size, -1)[rank])
                state.setdefault("outputs", []).append(output)
        return wrapper

    @adapter
    def avg_hook(state, grad):
        grad.div_(world_size)
        dist.all_reduce(grad)

    seen = {}
    for engine in ("torch", "zeroshard"):
        torch.manual_seed(0)
        mp = (tfsdp if engine == "torch" else zs).MixedPrecision(param_dtype=torch.bfloat16)
        m = (tfsdp.FullyShardedDataParallel(nn.Linear(6, 4), mixed_precision=mp, device_id=torch.device("cpu"))
             if engine == "torch" else zs.FSDP(nn.Linear(6, 4), mixed_precision=mp))
        state = {}
        m.register_comm_hook(state, avg_hook)  # zeroshard refused it: avg_hook(state, grad) takes no output
        m(torch.randn(4, 6) + rank).float().sum().backward()
        grad = m._handle.flat_param.grad
        m.clip_grad_norm_(1e-3)
        # torch casts the hook's output back to the parameter dtype in place: it is the gradient, clipped too
        seen[engine] = (state["outputs"][0] is grad, state["outputs"][0].dtype, grad.clone())
    assert seen["zeroshard"][:2] == seen["torch"][:2] == (True, torch.float32), seen
    assert torch.equal(seen["torch"][2], seen["zeroshard"][2])
    return True


def test_a_hook_sees_what_torch_shows_it(ranks):
    """Two review findings: a hook wrapped with functools.wraps was checked against the
    wrapped function's signature (and refused); under mixed precision the output tensor
    a stateful hook keeps (error feedback) stayed the pre-cast bf16 copy, not the gradient."""
    assert all(ranks.run(2, _kept_output_and_wrapped_hook))
