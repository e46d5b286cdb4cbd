"""summon_full_params and state dicts: full parameters under their original
names, equal to torch FSDP1's; a FULL state dict loads into the plain model;
loads write back into the shards; LOCAL state dicts round-trip and refuse
another world size."""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

import zeroshard as zs
from models import Block, TransformerBlock, batch, build


def _pair(model_name, strategy, use_orig_params, bf16=False):
    base = build(model_name)
    mp = dict(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16) if bf16 else None
    kw = dict(sharding_strategy=getattr(zs.ShardingStrategy, strategy), use_orig_params=use_orig_params,
              mixed_precision=zs.MixedPrecision(**mp) if mp else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = tfsdp.FullyShardedDataParallel(
            copy.deepcopy(base), device_id=torch.device("cpu"), auto_wrap_policy=TorchModuleWrapPolicy({Block, TransformerBlock}),
            sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy), use_orig_params=use_orig_params,
            mixed_precision=tfsdp.MixedPrecision(**mp) if mp else None)
    ours = zs.FSDP(copy.deepcopy(base), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block, TransformerBlock}), **kw)
    return base, ref, ours


def _train_step(model, opt, model_name, rank, step):
    model(batch(model_name, rank, step)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full_state_dict_parity(rank, world_size, model_name, strategy, use_orig_params, bf16=False):
    base, ref, ours = _pair(model_name, strategy, use_orig_params, bf16)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(2):
        for m, o in zip((ref, ours), opts):
            _train_step(m, o, model_name, rank, step)
    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert list(sd_ref) == list(sd_ours), (list(sd_ref), list(sd_ours))
    for k in sd_ref:
        assert sd_ref[k].dtype == sd_ours[k].dtype and torch.equal(sd_ref[k], sd_ours[k]), k
    if bf16:  # full precision values (and buffer dtypes) were saved; that is all to check
        return len(sd_ours)
    # Keys are the plain model's: it loads strictly and computes the same output.
    plain = copy.deepcopy(base)
    plain.load_state_dict(sd_ours, strict=True)
    x = batch(model_name, rank, 99)
    assert torch.equal(plain(x), ours(x))
    # The state dict is a copy: training on does not change it.
    before = {k: v.clone() for k, v in sd_ours.items()}
    _train_step(ours, opts[1], model_name, rank, 5)
    assert all(torch.equal(before[k], v) for k, v in sd_ours.items())
    # Loading writes back into the shards: the model is back to the saved point.
    ours.load_state_dict(sd_ours)
    assert torch.equal(plain(x), ours(x))
    return len(sd_ours)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_full_state_dict_matches_torch_and_loads_into_plain_model(ranks, world_size, strategy, use_orig_params, model_name):
    ranks.run(world_size, _full_state_dict_parity, model_name, strategy, use_orig_params)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_state_dict_under_mixed_precision(ranks, strategy, use_orig_params):
    ranks.run(2, _full_state_dict_parity, "mlp", strategy, use_orig_params, True)


def _summon(rank, world_size, use_orig_params):
    _, ref, ours = _pair("mlp", "FULL_SHARD", use_orig_params)
    for m in (ref, ours):
        m(batch("mlp", rank, 0)).sum().backward()
    kw = dict(with_grads=True) if use_orig_params else {}
    with tfsdp.FullyShardedDataParallel.summon_full_params(ref, **kw), zs.FSDP.summon_full_params(ours, **kw):
        named_ref, named_ours = list(ref.named_parameters()), list(ours.named_parameters())
        # Inside the block both engines name parameters as the plain model does.
        assert [n for n, _ in named_ref] == [n for n, _ in named_ours] == [n for n, _ in build("mlp").named_parameters()]
        assert [n for n, _ in ref.named_buffers()] == [n for n, _ in ours.named_buffers()]
        for (n, a), (_, b) in zip(named_ref, named_ours):
            assert a.shape == b.shape and torch.equal(a, b), n
            if use_orig_params:
                assert torch.equal(a.grad, b.grad), n
        with torch.no_grad():  # writeback: edits inside persist
            for _, p in named_ours:
                p.mul_(2.0)
    with zs.FSDP.summon_full_params(ours, writeback=False), tfsdp.FullyShardedDataParallel.summon_full_params(ref):
        for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
            assert torch.equal(2.0 * a, b), n
        with torch.no_grad():  # no writeback: edits are dropped
            for p in ours.parameters():
                p.zero_()
    with zs.FSDP.summon_full_params(ours):
        assert all(p.abs().sum() > 0 for p in ours.parameters())
    units = [m for m in ours.modules() if isinstance(m, zs.FSDP)]
    assert all(u._handle.padded.untyped_storage().size() == 0 for u in units)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_full_params_matches_torch(ranks, use_orig_params):
    ranks.run(2, _summon, use_orig_params)


def _summon_inside_forward(rank, world_size):
    model = zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    inner = model.blocks[0]
    inner.module.register_forward_pre_hook(lambda *a: zs.FSDP.summon_full_params(inner).__enter__())
    try:
        model(batch("mlp", rank, 0))
    except RuntimeError as e:
        return str(e)
    return None


def test_summon_inside_forward_is_refused(ranks):
    for msg in ranks.run(2, _summon_inside_forward):
        assert msg and "summon_full_params" in msg and "outside forward" in msg


def _local_save(rank, world_size, path):
    torch.manual_seed(0)
    model = zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, "mlp", rank, 0)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.LOCAL_STATE_DICT):
        sd = model.state_dict()
        assert sum(k.endswith("_flat_param") for k in sd) == 4  # root + 3 blocks, torch FSDP1's ShardedTensors
        assert {k for k in sd if not k.endswith("_flat_param")} == {"scale"}
        torch.save(sd, os.path.join(path, f"local{rank}.pt"))
        expected = model(batch("mlp", rank, 1))
        _train_step(model, opt, "mlp", rank, 1)
        assert not torch.equal(expected, model(batch("mlp", rank, 1)))
        model.load_state_dict(torch.load(os.path.join(path, f"local{rank}.pt"), weights_only=False))
        assert torch.equal(expected, model(batch("mlp", rank, 1)))
    return True


def _local_load_other_world(rank, world_size, path):
    model = zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    with zs.FSDP.state_dict_type(model, zs.StateDictType.LOCAL_STATE_DICT):
        try:  # rank 2 has no file of its own: it tries rank 0's
            model.load_state_dict(torch.load(os.path.join(path, f"local{rank % 2}.pt"), weights_only=False))
        except RuntimeError as e:  # torch's ShardedTensor refuses to unpickle in another world
            return str(e)
    return None


def _local_load_other_model(rank, world_size):
    saved = zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    other = zs.FSDP(build("mlp", hidden=9), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    with zs.FSDP.state_dict_type(saved, zs.StateDictType.LOCAL_STATE_DICT), \
            zs.FSDP.state_dict_type(other, zs.StateDictType.LOCAL_STATE_DICT):
        try:
            other.load_state_dict(saved.state_dict())
        except ValueError as e:
            return str(e)
    return None


def test_local_state_dict_round_trip_and_world_size_check(ranks, tmp_path):
    ranks.run(2, _local_save, str(tmp_path))
    for msg in ranks.run(3, _local_load_other_world, str(tmp_path)):
        assert msg and "save time" in msg
    for msg in ranks.run(2, _local_load_other_model):  # zeroshard's own check, before anything is copied
        assert msg and "this rank's shard of unit" in msg and "world size" in msg and "Fix" in msg


def _local_plain_shards(rank, world_size):
    """Per-rank files holding plain tensors of each shard's elements, without
    (hfai-style) or with the padding, load; before, the unpadded one was refused
    as '(15,) but ... has 15 elements'. A wrong size names both sizes."""
    model = zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    expected = model(batch("mlp", rank, 0))
    loaded = []
    for padded in (False, True):
        with zs.FSDP.state_dict_type(model, zs.StateDictType.LOCAL_STATE_DICT):
            sd = model.state_dict()
            for key in [k for k in sd if k.endswith("_flat_param")]:
                shard = sd[key].local_shards()[0].tensor if sd[key].local_shards() else torch.zeros(0)
                n = -(-sd[key].metadata().size[0] // world_size)  # the padded shard (no alignment: use_orig_params=False)
                sd[key] = torch.cat([shard, shard.new_zeros(n - shard.numel())]) if padded else shard.clone()
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            model.load_state_dict(sd)
        loaded.append(torch.equal(expected, model(batch("mlp", rank, 0))))
        assert loaded[-1] or padded, [(k, tuple(v.shape)) for k, v in sd.items()]
    with zs.FSDP.state_dict_type(model, zs.StateDictType.LOCAL_STATE_DICT):
        sd = model.state_dict()
        key = next(k for k in sd if k.endswith("_flat_param"))
        sd[key] = torch.zeros(1000)
        try:
            model.load_state_dict(sd)
            said = None
        except ValueError as e:
            said = str(e)
    return loaded, said


def test_local_state_dict_of_plain_shards(ranks):
    for loaded, said in ranks.run(3, _local_plain_shards):
        assert loaded == [True, True]
        assert said is not None and "is (1000,)" in said and "with its padding" in said, said


def _apply_init(rank, world_size, use_orig_params):
    """model.apply(init) writes into the full parameters of every unit and
    the shards keep the result, as torch FSDP1's apply does."""
    _, ref, ours = _pair("mlp", "FULL_SHARD", use_orig_params)

    def init(m):
        if isinstance(m, torch.nn.Linear):
            with torch.no_grad():
                m.weight.copy_(torch.arange(m.weight.numel(), dtype=m.weight.dtype).view_as(m.weight) / 97.0)
                m.bias.fill_(0.25)

    for m in (ref, ours):
        assert m.apply(init) is m
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert list(sd_ref) == list(sd_ours)
    for k in sd_ref:
        assert torch.equal(sd_ref[k], sd_ours[k]), k
    assert torch.equal(sd_ours["out.bias"], torch.full_like(sd_ours["out.bias"], 0.25))
    for m in (ref, ours):  # and training goes on from the written values
        m(batch("mlp", rank, 0)).sum().backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        # None on both sides where this rank's shard holds none of a use_orig_params parameter
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), n
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_apply_initializes_the_full_parameters_like_torch(ranks, use_orig_params):
    assert all(ranks.run(2, _apply_init, use_orig_params))
