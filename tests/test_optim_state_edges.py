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
