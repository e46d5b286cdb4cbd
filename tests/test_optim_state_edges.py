"""Optimizer state dicts where zeroshard once differed from torch FSDP1 (found
by a side-by-side review), each compared with torch FSDP1 on 2 gloo ranks: a
given ``optim_state_dict`` argument, misshapen states on load, and the order
of the states inside one parameter's entry."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from models import batch, build
from parity import DEFAULTS, _wrap

ENGINES = ("torch", "zeroshard")


def _trained(engine, base, optim_cls=torch.optim.AdamW, steps=2, snapshot_at=None, **overrides):
    """A wrapped copy of ``base`` and its optimizer after ``steps`` steps; with
    ``snapshot_at``, also ``deepcopy(optim.state_dict())`` taken after that step."""
    case = {**DEFAULTS, **overrides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _wrap(engine, copy.deepcopy(base), case)
    optim, snapshot = optim_cls(model.parameters(), lr=1e-2), None
    for step in range(steps):
        model(batch("mlp", torch.distributed.get_rank(), step)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        if step + 1 == snapshot_at:
            snapshot = copy.deepcopy(optim.state_dict())
    return model, optim, snapshot


def _fsdp(engine):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs
    return tfsdp.FullyShardedDataParallel if engine == "torch" else zs.FullyShardedDataParallel


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _osd(engine, model, optim, *given):
    """The FULL optimizer state dict. torch's with offload_to_cpu=False: with
    its default on CPU, use_orig_params=True returns views of one buffer reused
    for every state name (exp_avg comes back equal to exp_avg_sq)."""
    if engine == "zeroshard":
        return _quiet(_fsdp(engine).optim_state_dict, model, optim, *given)
    import torch.distributed.fsdp as tfsdp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tfsdp.FullyShardedDataParallel.state_dict_type(model, tfsdp.StateDictType.FULL_STATE_DICT, None,
                                                            tfsdp.FullOptimStateDictConfig(offload_to_cpu=False)):
            return tfsdp.FullyShardedDataParallel.optim_state_dict(model, optim, *given)


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _given_state_dict(rank, world_size, use_orig_params):
    base = build("mlp")
    out = []
    for engine in ENGINES:
        model, optim, snapshot = _trained(engine, base, steps=3, snapshot_at=2, use_orig_params=use_orig_params)
        out.append(_osd(engine, model, optim, snapshot))
    assert _same(*out)
    assert out[1]["state"]["inp.weight"]["step"].item() == 2.0  # the snapshot's, not the optimizer's 3
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_optim_state_dict_converts_the_given_state_dict(ranks, use_orig_params):
    """``optim_state_dict(model, optim, osd)`` converts ``osd``'s states, as
    torch does; zeroshard read ``optim.state`` instead (a step later here)."""
    assert all(ranks.run(2, _given_state_dict, use_orig_params))


def _misshapen(rank, world_size, use_orig_params, key, how):
    import zeroshard as zs

    base = build("mlp")
    model, optim, _ = _trained("zeroshard", base, use_orig_params=use_orig_params)
    osd = _quiet(zs.FSDP.optim_state_dict, model, optim)
    st = osd["state"][key]
    for name in ("exp_avg", "exp_avg_sq"):
        st[name] = st[name].t().contiguous() if how == "transposed" else torch.cat([st[name], st[name][:1]])
    with pytest.raises(ValueError, match=f"'exp_avg' of '{key}' has shape") as info:
        zs.FSDP.optim_state_dict_to_load(model, optim, osd)
    return str(info.value)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("key,how", [("inp.weight", "transposed"), ("blocks.2.l2.bias", "longer")])
def test_misshapen_optimizer_state_is_refused_on_every_rank(ranks, use_orig_params, key, how):
    """A transposed state (same element count) loaded scrambled; with
    use_orig_params only the ranks holding part of the parameter raised (the
    others went on into a collective that never completed), naming it
    relative to its unit. Every rank now raises, naming the model's FQN."""
    ranks.run(2, _misshapen, use_orig_params, key, how)


def _key_order(rank, world_size, optim_name, strategy):
    base = build("mlp")
    optim_cls = {"nadam": torch.optim.NAdam, "asgd": torch.optim.ASGD,
                 "rmsprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr, centered=True, momentum=0.9)}[optim_name]
    out = []
    for engine in ENGINES:
        model, optim, _ = _trained(engine, base, optim_cls, strategy=strategy, use_orig_params=True)
        out.append(_osd(engine, model, optim))
    assert [list(v) for v in out[0]["state"].values()] == [list(v) for v in out[1]["state"].values()]
    assert _same(*out)
    return True


@pytest.mark.parametrize("optim_name,strategy", [("nadam", "FULL_SHARD"), ("asgd", "FULL_SHARD"), ("rmsprop", "NO_SHARD")])
def test_state_order_inside_a_parameter_matches_torch(ranks, optim_name, strategy):
    """use_orig_params: torch sorts the zero-dim states by name (NAdam's
    mu_product before step), and passes a NO_SHARD parameter's state through
    in the optimizer's order."""
    assert all(ranks.run(2, _key_order, optim_name, strategy))


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.s = torch.nn.Linear(1, 1, bias=False)  # one element: rank 1's shard of it is all padding

    def forward(self, x):
        return x * self.s.weight


def _per_rank_optimizers(rank, world_size, form):
    """use_orig_params=True; each rank's optimizer holds only its non-empty shards, so the 1-element
    parameter is in rank 0's optimizer only. Saving hung (the unit's gather ran on rank 0 alone)."""
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp.wrap as twrap

    import zeroshard as zs
    out = {}
    for engine, lib, wrap in (("torch", tfsdp, twrap), ("zeroshard", zs, zs.wrap)):
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(4, 4), _Scale())
        kwargs = {"device_id": torch.device("cpu")} if engine == "torch" else {}
        model = _quiet(lib.FullyShardedDataParallel, base, auto_wrap_policy=wrap.ModuleWrapPolicy({_Scale}),
                       use_orig_params=True, **kwargs)
        optim = torch.optim.AdamW([p for p in model.parameters() if p.numel() > 0], lr=1e-2)
        for step in range(2):
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
        out[engine] = (model, optim, _osd(engine, model, optim))
    assert _same(out["torch"][2], out["zeroshard"][2])  # every rank gets the 1-element parameter's state
    assert "1.s.weight" in out["zeroshard"][2]["state"]
    model, optim, _ = out["zeroshard"]
    kind = zs.StateDictType.SHARDED_STATE_DICT if form == "sharded" else zs.StateDictType.FULL_STATE_DICT
    ocfg = zs.FullOptimStateDictConfig(rank0_only=True) if form == "rank0_only" else None
    with zs.FSDP.state_dict_type(model, kind, None, ocfg):
        osd = _quiet(zs.FSDP.optim_state_dict, model, optim)
        # Loaded into the same per-rank optimizer: rank 1 takes part in the rows' all-gathers (or rank 0's
        # broadcasts) of a parameter its optimizer does not hold. rank0_only cannot work here: rank 0's
        # param groups name a parameter rank 1's optimizer lacks, which every rank learns and raises for.
        if form == "rank0_only":
            with pytest.raises(ValueError, match="rank 1 cannot load its optimizer state dict|param group 0"):
                zs.FSDP.optim_state_dict_to_load(model, optim, osd)
        else:
            fresh = torch.optim.AdamW([p for p in model.parameters() if p.numel() > 0], lr=1e-2)
            fresh.load_state_dict(zs.FSDP.optim_state_dict_to_load(model, fresh, osd))
            assert _same(fresh.state_dict(), optim.state_dict())
        # A dict of an optimizer over all parameters: refused on every rank, before any collective.
        with pytest.raises(ValueError, match="param group 0 .* does not hold|cannot load its optimizer state dict"):
            zs.FSDP.optim_state_dict_to_load(model, torch.optim.AdamW(model.parameters(), lr=1e-2), osd)
    return True


@pytest.mark.parametrize("form", ["full", "rank0_only", "sharded"])
def test_optimizers_holding_different_parameters_per_rank(ranks, form):
    assert all(ranks.run(2, _per_rank_optimizers, form, timeout=90))


class _SGDWithNone(torch.optim.SGD):
    @torch.no_grad()
    def step(self):
        super().step()
        for p in (p for g in self.param_groups for p in g["params"] if p.grad is not None):
            self.state[p]["extra"] = None


def _flat_state_misuse(rank, world_size):
    """use_orig_params=False: one FlatParameter state per unit, so its parameters' states must agree.
    zeroshard accepted these dicts silently (zeros or a float64 state loaded) where torch raises."""
    base = build("mlp")
    for engine in ENGINES:
        model, optim, _ = _trained(engine, base)
        full = _osd(engine, model, optim)
        to_load = lambda osd: _quiet(_fsdp(engine).optim_state_dict_to_load, model, optim, osd)  # noqa: E731
        cases = {"names": lambda st: st["blocks.0.l1.weight"].pop("exp_avg_sq"),
                 "dtype": lambda st: st["blocks.0.l1.weight"].update(exp_avg=st["blocks.0.l1.weight"]["exp_avg"].double()),
                 "missing": lambda st: st.pop("blocks.0.l2.weight")}
        messages = {"names": "have different names", "dtype": "different dtypes", "missing": "but not for"}
        for how, edit in cases.items():
            osd = copy.deepcopy(full)
            edit(osd["state"])
            with pytest.raises((ValueError, KeyError), match=messages[how] if engine == "zeroshard" else None):
                to_load(osd)
        # An optimizer over another model's parameters.
        foreign = torch.optim.AdamW(build("mlp").parameters(), lr=1e-2)
        with pytest.raises((ValueError, KeyError), match="not in the model" if engine == "zeroshard" else None):
            _osd(engine, model, foreign)
        # A state whose value is None passes through, as torch passes it.
        sgd = _SGDWithNone(model.parameters(), lr=1e-2, momentum=0.9)
        model(batch("mlp", rank, 0)).pow(2).mean().backward()
        sgd.step()
        loaded = _quiet(_fsdp(engine).optim_state_dict_to_load, model, sgd, _osd(engine, model, sgd))
        assert all(st["extra"] is None for st in loaded["state"].values())
    return True


def test_flat_parameter_states_that_disagree_are_refused_and_none_passes(ranks):
    assert all(ranks.run(2, _flat_state_misuse))


def _to_load(engine, model, optim, osd):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs
    mod = tfsdp if engine == "torch" else zs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mod.FullyShardedDataParallel.state_dict_type(model, mod.StateDictType.FULL_STATE_DICT, None,
                                                          mod.FullOptimStateDictConfig(offload_to_cpu=False)):
            return mod.FullyShardedDataParallel.optim_state_dict_to_load(model, optim, osd)


def _factored_states(rank, world_size, strategy):
    base = build("mlp", seed=0)
    seen = {}
    for engine in ENGINES:
        model, optim, _ = _trained(engine, base, torch.optim.Adafactor, strategy=strategy, use_orig_params=True)
        seen[engine] = (model, optim, _osd(engine, model, optim))
    (_, _, t_osd), (zm, zo, z_osd) = seen["torch"], seen["zeroshard"]
    loaded = _to_load("zeroshard", zm, zo, copy.deepcopy(t_osd))  # torch's dict into zeroshard
    return _same(t_osd, z_osd), _same(loaded, zo.state_dict()), tuple(t_osd["state"]["inp.weight"]["row_var"].shape)


@pytest.mark.parametrize("world_size, strategy", [(2, "NO_SHARD"), (1, "FULL_SHARD")])
def test_states_not_shaped_like_their_parameter_pass_through_unsharded_units(ranks, world_size, strategy):
    """Adafactor's row/column factors of a parameter held whole (NO_SHARD, or any
    strategy on one rank): zeroshard squeezed them into parameter-sized slots and
    failed on save ('size of tensor a (35) must match ... (5)') and on load ('has
    shape (7, 1) but the parameter has shape (7, 5)'). torch passes them through."""
    for same_dict, same_loaded, row_shape in ranks.run(world_size, _factored_states, strategy):
        assert row_shape == (7, 1) and same_dict and same_loaded


def _saved_groups_are_copies(rank, world_size, use_orig_params):
    base = build("mlp", seed=0)
    out = []
    for engine in ENGINES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _wrap(engine, copy.deepcopy(base), {**DEFAULTS, "use_orig_params": use_orig_params})
        optim = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
        model(batch("mlp", rank, 0)).pow(2).mean().backward()
        optim.step()
        osd = _osd(engine, model, optim)
        sched.step()  # updates the tensor lr in place
        out.append(float(osd["param_groups"][0]["lr"]))
    return out


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_saved_param_groups_do_not_follow_the_live_optimizer(ranks, use_orig_params):
    """A tensor lr in the returned dict was the optimizer's own tensor: a scheduler
    step after saving changed the saved value (0.01 -> 0.005). torch deep-copies."""
    for torch_lr, ours in ranks.run(2, _saved_groups_are_copies, use_orig_params):
        assert ours == torch_lr == pytest.approx(0.01)


def _settings_and_bad_dicts(rank, world_size):
    import time

    import zeroshard as zs
    model, optim, _ = _trained("zeroshard", build("mlp", seed=0), steps=1)
    errors = {}
    # Set on the wrapped module below the root: the nested units only.
    zs.FSDP.set_state_dict_type(model.module, zs.StateDictType.SHARDED_STATE_DICT)
    try:
        zs.FSDP.optim_state_dict(model, optim)
    except RuntimeError as e:
        errors["mixed"] = str(e)
    zs.FSDP.set_state_dict_type(model.module, zs.StateDictType.FULL_STATE_DICT)  # all the same again
    osd = _quiet(zs.FSDP.optim_state_dict, model, optim)
    started = time.monotonic()
    try:  # a rank0_only dict loaded without rank0_only: rank 1 holds {}
        zs.FSDP.optim_state_dict_to_load(model, optim, osd if rank == 0 else {})
    except ValueError as e:
        errors["one_rank_bad"] = (str(e), time.monotonic() - started)
    ids = copy.deepcopy(optim.state_dict())  # keyed by position, as a plain optimizer's
    try:
        zs.FSDP.optim_state_dict_to_load(model, optim, ids)
    except ValueError as e:
        errors["ids"] = str(e)
    zs.ShardedOptimStateDictConfig(_use_dtensor=True), zs.ShardedStateDictConfig(_use_dtensor=True)  # torch's keywords
    return errors


def test_mixed_settings_and_one_rank_bad_dict_are_refused_on_every_rank(ranks):
    """Units with different state dict settings used the root's silently (torch
    asserts); a dict only one rank could not read left the others waiting in a
    collective until that process died; a plain optimizer's ID-keyed dict now
    names rekey_optim_state_dict."""
    for errors in ranks.run(2, _settings_and_bad_dicts):
        assert "have different state dict settings" in errors["mixed"]
        message, seconds = errors["one_rank_bad"]
        assert "without 'state' and 'param_groups'" in message and seconds < 10
        assert "rekey_optim_state_dict" in errors["ids"]


def _bad_dict_on_one_rank(rank, world_size, use_orig_params, bad, strategy="FULL_SHARD"):
    """Ranks read different files and rank 1's is bad (a state of another shape, or a state missing for
    one of a FlatParameter's parameters): every rank raises before converting anything. The per-parameter
    checks ran after the ranks' agreement, so rank 0 loaded while rank 1 raised (half the shards with the
    checkpoint's state, half fresh, if rank 1 went on with a new optimizer; else rank 0's next collective
    timed out). Under use_orig_params a parameter without state is no error on its own (it may never
    have stepped), so the ranks compare which states they hold: rank 1 restarted Adam for that
    parameter alone (NO_SHARD's replicas drifted apart, silently; torch FSDP1 too)."""
    import zeroshard as zs

    torch.manual_seed(0)
    model = zs.FSDP(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)), use_orig_params=use_orig_params,
                    sharding_strategy=getattr(zs.ShardingStrategy, strategy))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    optim.step()
    with zs.FSDP.state_dict_type(model, zs.StateDictType.FULL_STATE_DICT):
        osd = zs.FSDP.optim_state_dict(model, optim)
    if rank == 1:
        if bad == "shape":
            osd["state"]["0.weight"]["exp_avg"] = torch.zeros(7, 6)
        else:
            del osd["state"]["0.bias"]
    before = copy.deepcopy(optim.state_dict())
    said = ("cannot load its optimizer state dict" if rank == 0 else "0.weight|0.bias") if not (use_orig_params and bad == "missing") \
        else rf"this rank's optimizer state dict and rank {1 - rank}'s hold different states for '0.bias' \(here: "
    with pytest.raises(ValueError, match=said):
        zs.FSDP.optim_state_dict_to_load(model, optim, osd)
    return _same(optim.state_dict(), before)


@pytest.mark.parametrize("use_orig_params,bad,strategy", [(False, "shape", "FULL_SHARD"), (True, "shape", "FULL_SHARD"),
                                                          (False, "missing", "FULL_SHARD"), (True, "missing", "FULL_SHARD"),
                                                          (True, "missing", "NO_SHARD")])
def test_a_dict_bad_on_one_rank_raises_on_every_rank(ranks, use_orig_params, bad, strategy):
    assert all(ranks.run(2, _bad_dict_on_one_rank, use_orig_params, bad, strategy, timeout=90))
