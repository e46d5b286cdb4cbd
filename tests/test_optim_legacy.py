"""torch FSDP1's older optimizer-state calls and state-dict settings, against
torch FSDP1 on the same trained models: shard_full_ / scatter_full_ /
sharded_ / flatten_sharded_optim_state_dict give this rank's shards
tensor-for-tensor equal to what the optimizer holds and to torch's;
rekey_optim_state_dict equals torch's and round-trips through an unwrapped
model's optimizer; get/set_state_dict_type report what torch reports."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp

import zeroshard as zs
from models import build
from parity import train_step as _step
from parity import trained_with_adamw as _trained_pair
from parity import wrapped_with_adamw as _engines
from test_checkpoint import _assert_local_equal, _assert_osd_equal, _torch_osd

TF = tfsdp.FullyShardedDataParallel


def _trained(rank, model_name, use_orig_params):
    (ref, ours), (opt_ref, opt_ours) = _trained_pair(rank, model_name, use_orig_params)
    return ref, ours, opt_ref, opt_ours


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warnings
        return fn(*args, **kwargs)


def _full_to_shards(rank, world_size, use_orig_params):
    ref, ours, opt_ref, opt_ours = _trained(rank, "gpt", use_orig_params)
    full_t = _torch_osd(ref, opt_ref)
    full_z = zs.FSDP.full_optim_state_dict(ours, opt_ours, rank0_only=False)
    local = opt_ours.state_dict()
    shard_t = _quiet(TF.shard_full_optim_state_dict, full_t, ref, optim=opt_ref)
    _assert_local_equal(shard_t, zs.FSDP.shard_full_optim_state_dict(full_t, ours, optim=opt_ours))
    _assert_local_equal(local, zs.FSDP.shard_full_optim_state_dict(full_z, ours, optim=opt_ours))
    # optim=None: the parameter order of model.parameters(), one param group.
    _assert_local_equal(local, zs.FSDP.shard_full_optim_state_dict(full_z, ours))
    # Rank 0 alone holds the dict; the others pass None and receive their shards.
    _assert_local_equal(local, zs.FSDP.scatter_full_optim_state_dict(full_z if rank == 0 else None, ours, optim=opt_ours))
    # torch's deprecated optim_input (the parameters / groups the optimizer was built from): same results, with a warning.
    for optim_input in (list(ours.parameters()), opt_ours.param_groups):
        with pytest.warns(FutureWarning, match="optim_input is deprecated"):
            _assert_local_equal(local, zs.FSDP.shard_full_optim_state_dict(full_z, ours, optim_input=optim_input))
        with pytest.warns(FutureWarning):
            assert list(zs.FSDP.full_optim_state_dict(ours, opt_ours, optim_input=optim_input, rank0_only=False)["state"]) \
                == list(full_z["state"])
    with pytest.raises(ValueError, match="optim_input and optim list different parameters"), pytest.warns(FutureWarning):
        zs.FSDP.shard_full_optim_state_dict(full_z, ours, optim_input=list(ours.parameters())[:1], optim=opt_ours)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_shard_and_scatter_full_optim_state_dict(ranks, use_orig_params):
    assert all(ranks.run(3, _full_to_shards, use_orig_params))


def _two_groups_without_optim(rank, world_size, use_orig_params):
    (ref, ours), _ = _engines("mlp", use_orig_params)
    opts = []
    for m in (ref, ours):  # two groups in model order, different settings
        ps = list(m.parameters())
        opts.append(torch.optim.AdamW([{"params": ps[:1], "lr": 1e-2}, {"params": ps[1:], "lr": 3e-3, "weight_decay": 0.1}]))
    for step in range(2):
        for m, o in zip((ref, ours), opts):
            _step(m, o, "mlp", rank, step)
    full_t = _torch_osd(ref, opts[0])
    full_z = zs.FSDP.full_optim_state_dict(ours, opts[1], rank0_only=False)
    local = opts[1].state_dict()
    # torch's documented flow passes no optimizer: the dict's own groups number the parameters.
    _assert_local_equal(local, zs.FSDP.shard_full_optim_state_dict(full_z, ours))
    _assert_local_equal(local, zs.FSDP.scatter_full_optim_state_dict(full_z if rank == 0 else None, ours))
    if not use_orig_params:  # (torch's use_orig_params=True full dict is wrong on CPU: exp_avg == exp_avg_sq)
        _assert_local_equal(_quiet(TF.shard_full_optim_state_dict, full_t, ref),
                            zs.FSDP.shard_full_optim_state_dict(full_t, ours))
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_shard_and_scatter_without_optim_keep_the_saved_param_groups(ranks, use_orig_params):
    """Without optim= the parameters were numbered as one group over model.parameters(), so a
    dict with two groups was refused ('2 param groups but the optimizer has 1', naming a wrong
    fix); torch keeps the saved groups, and so does zeroshard now."""
    assert all(ranks.run(2, _two_groups_without_optim, use_orig_params))


def _sharded_round_trip(rank, world_size, use_orig_params):
    from torch.distributed.tensor import DTensor

    ref, ours, opt_ref, opt_ours = _trained(rank, "mlp", use_orig_params)
    rows = zs.FSDP.sharded_optim_state_dict(ours, opt_ours)
    with zs.FSDP.state_dict_type(ours, zs.StateDictType.SHARDED_STATE_DICT):
        expected = zs.FSDP.optim_state_dict(ours, opt_ours)
    assert list(rows["state"]) == list(expected["state"]) and rows["param_groups"] == expected["param_groups"]
    for fqn, st in expected["state"].items():
        for k, v in st.items():
            got = rows["state"][fqn][k]
            if isinstance(v, DTensor):
                assert isinstance(got, DTensor) and torch.equal(got.to_local(), v.to_local()), (fqn, k)
            else:
                assert torch.equal(got, v) if torch.is_tensor(v) else got == v, (fqn, k)
    local = opt_ours.state_dict()
    _assert_local_equal(local, zs.FSDP.flatten_sharded_optim_state_dict(rows, ours, opt_ours))
    if not use_orig_params:  # torch's ShardedTensor rows (its CPU offload breaks use_orig_params, see test_checkpoint)
        rows_t = _quiet(TF.sharded_optim_state_dict, ref, opt_ref)
        _assert_local_equal(local, zs.FSDP.flatten_sharded_optim_state_dict(rows_t, ours, opt_ours))
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sharded_optim_state_dict_round_trip(ranks, use_orig_params):
    assert all(ranks.run(2, _sharded_round_trip, use_orig_params))


def _named_optimizer(rank, world_size, use_orig_params):
    """torch's _NamedOptimizer (is_named_optimizer=True): state keyed by the wrapped
    model's parameter names. The FULL dict, the per-rank dict to load, and training
    after loading it into a fresh named optimizer are equal to torch's."""
    from torch.distributed.optim.named_optimizer import _NamedOptimizer

    (ref, ours), _ = _engines("mlp", use_orig_params)
    models = (ref, ours)
    named = [_NamedOptimizer(m.named_parameters(), torch.optim.AdamW, module=m, lr=1e-2) for m in models]
    for step in range(3):
        for m, o in zip(models, named):
            _step(m, o._optimizer, "mlp", rank, step)
    # The named optimizer's own dict lists parameters by name: optim_state_dict maps them back.
    assert all(isinstance(k, str) for k in _quiet(named[1].state_dict)["state"])
    full_t = _torch_osd(ref, named[0])
    full_z = zs.FSDP.optim_state_dict(ours, named[1])
    _assert_osd_equal(full_t, full_z)
    # Fresh named optimizers create their state eagerly (as torchrec's do), also for parameters
    # with no element in this rank's shard: that state is kept as the optimizer holds it.
    fresh = [_NamedOptimizer(m.named_parameters(), torch.optim.AdamW, module=m, lr=1e-2) for m in models]
    for o in fresh:
        _quiet(o.init_state)
    load_t = _quiet(TF.optim_state_dict_to_load, ref, fresh[0]._optimizer, full_t, is_named_optimizer=True)
    load_z = zs.FSDP.optim_state_dict_to_load(ours, fresh[1]._optimizer, full_z, is_named_optimizer=True)
    assert all(isinstance(k, str) for k in load_z["state"]) and load_z["param_groups"][0]["params"]
    _assert_osd_equal(load_t, load_z, key_order=False)  # torch flattens state names from a set: its order varies per process
    # torch's named optimizer converts torch's dict itself; zeroshard's is given the converted one.
    _quiet(fresh[0].load_state_dict, full_t)
    fresh[1].load_state_dict(load_z)
    _assert_local_equal(fresh[0]._optimizer.state_dict(), fresh[1]._optimizer.state_dict())
    for step in range(3, 5):
        for m, o in zip(models, fresh):
            _step(m, o._optimizer, "mlp", rank, step)
    for (n_t, p_t), (n_z, p_z) in zip(ref.named_parameters(), ours.named_parameters()):
        assert n_t == n_z and torch.equal(p_t, p_z), n_z
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_named_optimizer_matches_torch(ranks, use_orig_params):
    assert all(ranks.run(3, _named_optimizer, use_orig_params))


def _rekey(rank, world_size):
    ref, ours, opt_ref, opt_ours = _trained(rank, "mlp", False)
    full = zs.FSDP.full_optim_state_dict(ours, opt_ours, rank0_only=False)
    plain = build("mlp")
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    by_id_t = _quiet(TF.rekey_optim_state_dict, full, tfsdp.OptimStateKeyType.PARAM_ID, plain)
    by_id = zs.FSDP.rekey_optim_state_dict(full, zs.OptimStateKeyType.PARAM_ID, plain)
    assert list(by_id["state"]) == list(by_id_t["state"]) and sorted(by_id["state"]) == list(range(len(full["state"])))
    assert by_id["param_groups"] == by_id_t["param_groups"]
    assert all(by_id["state"][k] is by_id_t["state"][k] for k in by_id["state"])  # re-keyed, not copied
    assert zs.FSDP.rekey_optim_state_dict(by_id, zs.OptimStateKeyType.PARAM_ID, plain) is by_id
    plain_opt.load_state_dict(by_id)  # the unwrapped model's optimizer takes it
    back = plain_opt.state_dict()
    by_name_t = _quiet(TF.rekey_optim_state_dict, back, tfsdp.OptimStateKeyType.PARAM_NAME, plain)
    by_name = zs.FSDP.rekey_optim_state_dict(back, tfsdp.OptimStateKeyType.PARAM_NAME, plain, optim=plain_opt)
    assert list(by_name["state"]) == list(by_name_t["state"]) and by_name["param_groups"] == by_name_t["param_groups"]
    _assert_osd_equal({"state": full["state"], "param_groups": by_name["param_groups"]}, by_name)
    # ... and goes back into the wrapped model's optimizer shards.
    _assert_local_equal(opt_ours.state_dict(), zs.FSDP.shard_full_optim_state_dict(by_name, ours, optim=opt_ours))
    errors = []
    for bad in ({"state": {0: {}, "a": {}}, "param_groups": []}, {"state": {"nope": {}}, "param_groups": [{"params": ["nope"]}]}):
        try:
            zs.FSDP.rekey_optim_state_dict(bad, zs.OptimStateKeyType.PARAM_ID, plain)
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == 2 and "mix names and IDs" in errors[0] and "name no parameter" in errors[1], errors
    # The wrapped optimizer's own dict is keyed by FlatParameter IDs: no name fits one (torch raises too).
    for fn, model in ((zs.FSDP.rekey_optim_state_dict, ours), (TF.rekey_optim_state_dict, ref)):
        with pytest.raises(RuntimeError):
            _quiet(fn, opt_ours.state_dict(), zs.OptimStateKeyType.PARAM_NAME if model is ours
                   else tfsdp.OptimStateKeyType.PARAM_NAME, model, optim=opt_ours if model is ours else opt_ref)
    return True


def test_rekey_optim_state_dict_matches_torch(ranks):
    assert all(ranks.run(2, _rekey))


def _rekey_one_parameter_units(rank, world_size):
    """Each FlatParameter stands for one parameter: its state takes that parameter's name, both
    ways, as torch's (zeroshard refused any FlatParameter, with a message saying '1 parameters')."""
    import torch.nn as nn

    out = []
    for engine in (TF, zs.FSDP):
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Tanh(), nn.Linear(7, 3, bias=False))
        policy = (tfsdp.wrap if engine is TF else zs.wrap).ModuleWrapPolicy({nn.Linear})
        kw = {"device_id": torch.device("cpu")} if engine is TF else {}
        model = engine(plain, auto_wrap_policy=policy, use_orig_params=False, **kw)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * rank + step))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        full = _quiet(engine.full_optim_state_dict, model, opt, rank0_only=False)
        out.append((_quiet(engine.rekey_optim_state_dict, opt.state_dict(), tfsdp.OptimStateKeyType.PARAM_NAME, model,
                           optim=opt),
                    _quiet(engine.rekey_optim_state_dict, full, tfsdp.OptimStateKeyType.PARAM_ID, model, optim=opt)))
    (names_t, ids_t), (names, ids) = out
    assert sorted(names["state"]) == sorted(names_t["state"]) == ["0.weight", "2.weight"], names["state"].keys()
    _assert_osd_equal(names_t, names)
    assert sorted(ids["state"]) == sorted(ids_t["state"]) == [0, 1]
    _assert_osd_equal(ids_t, ids)
    return True


def test_rekey_names_a_flat_parameter_standing_for_one_parameter_as_torch(ranks):
    assert all(ranks.run(2, _rekey_one_parameter_units))


def _settings(rank, world_size):
    (ref, ours), _ = _engines("gpt", False)
    kinds = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
    for kind in kinds:
        prev_t = _quiet(TF.set_state_dict_type, ref, getattr(tfsdp.StateDictType, kind))
        prev_z = zs.FSDP.set_state_dict_type(ours, getattr(zs.StateDictType, kind))
        for t, z in ((prev_t, prev_z), (TF.get_state_dict_type(ref), zs.FSDP.get_state_dict_type(ours))):
            assert t.state_dict_type.name == z.state_dict_type.name
            assert type(t.state_dict_config).__name__ == type(z.state_dict_config).__name__
            assert type(t.optim_state_dict_config).__name__ == type(z.optim_state_dict_config).__name__
            assert t.state_dict_config.offload_to_cpu == z.state_dict_config.offload_to_cpu
            assert t.optim_state_dict_config.offload_to_cpu == z.optim_state_dict_config.offload_to_cpu
    before = zs.FSDP.get_state_dict_type(ours)
    for args in ((zs.ShardedStateDictConfig(),), (None, zs.ShardedOptimStateDictConfig())):
        with pytest.raises(RuntimeError, match="set_state_dict_type.FULL_STATE_DICT. got a Sharded"):
            zs.FSDP.set_state_dict_type(ours, zs.StateDictType.FULL_STATE_DICT, *args)  # torch: RuntimeError too
        assert zs.FSDP.get_state_dict_type(ours) == before
    cfg = zs.FullOptimStateDictConfig(rank0_only=True)
    with zs.FSDP.state_dict_type(ours, zs.StateDictType.FULL_STATE_DICT, None, cfg):
        assert zs.FSDP.get_state_dict_type(ours).optim_state_dict_config is cfg
    inner = zs.FSDP.fsdp_modules(ours)[1]
    zs.FSDP.set_state_dict_type(inner, zs.StateDictType.LOCAL_STATE_DICT)
    try:
        zs.FSDP.get_state_dict_type(ours)
    except RuntimeError as e:
        assert "different state dict settings" in str(e)
    else:
        raise AssertionError("units with different settings were not refused")
    # set_state_dict_type checks only types and config classes, as torch's, and returns the first unit's settings.
    zs.FSDP.set_state_dict_type(inner, zs.StateDictType.SHARDED_STATE_DICT)  # all units agree again
    for model, lib in ((ref, tfsdp), (ours, zs)):
        FS = lib.FullyShardedDataParallel
        _quiet(FS.set_state_dict_type, model, lib.StateDictType.FULL_STATE_DICT)
        _quiet(FS.set_state_dict_type, FS.fsdp_modules(model)[1], lib.StateDictType.FULL_STATE_DICT,
               lib.FullStateDictConfig(offload_to_cpu=True))
        prev = _quiet(FS.set_state_dict_type, model, lib.StateDictType.SHARDED_STATE_DICT)
        assert prev.state_dict_type.name == "FULL_STATE_DICT" and not prev.state_dict_config.offload_to_cpu
        assert FS.get_state_dict_type(model).state_dict_type.name == "SHARDED_STATE_DICT"
    assert ours.check_is_root() and ref.check_is_root()
    assert not inner.check_is_root() and not TF.fsdp_modules(ref)[1].check_is_root()
    return True


def test_state_dict_settings_match_torch(ranks):
    assert all(ranks.run(2, _settings))
