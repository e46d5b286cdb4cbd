"""The rest of torch FSDP1's ``wrap`` module: ``always_wrap_policy``,
``CustomPolicy`` (per-unit keyword overrides), ``enable_wrap`` / ``wrap``,
torch's own policy objects, and mixed precision's fp32 units
(``MixedPrecision._module_classes_to_ignore``, BatchNorm by default).

Parity is ``torch.equal`` against torch FSDP1 given the same policy: outputs,
gradients, clipped norms and parameters after AdamW (``parity.run_case``),
plus the unit structure each engine builds."""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
import torch.distributed.fsdp as tfsdp
import torch.distributed.fsdp.wrap as twrap
import torch.nn as nn

import zeroshard as zs
from models import Block, BNBlock, build
from parity import run_case

BF16 = dict(param_dtype="bfloat16", reduce_dtype="bfloat16", buffer_dtype="bfloat16")


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_custom_policy_per_unit_strategies_match_torch(ranks, world_size, use_orig_params):
    """Blocks SHARD_GRAD_OP, the head NO_SHARD, the root FULL_SHARD."""
    ranks.run(world_size, run_case, dict(policy="custom", use_orig_params=use_orig_params))


STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


@given(
    world_size=st.integers(1, 4),
    root=st.sampled_from(STRATEGIES),
    blocks=st.lists(st.sampled_from([None, *STRATEGIES]), min_size=1, max_size=4),
    use_orig_params=st.booleans(),
    backward_prefetch=st.sampled_from([None, "BACKWARD_PRE", "BACKWARD_POST"]),
)
def test_random_per_unit_strategies_match_torch(ranks, world_size, root, blocks, use_orig_params, backward_prefetch):
    """Property: any mix of per-unit sharding strategies (CustomPolicy
    overrides; None = not a unit) trains bit-identically to torch FSDP1."""
    ranks.run(world_size, run_case, dict(
        policy="per_block", unit_strategies=tuple(blocks), strategy=root, use_orig_params=use_orig_params,
        backward_prefetch=backward_prefetch, model_kwargs=dict(n_blocks=len(blocks)), steps=2))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_always_wrap_policy_matches_torch(ranks, use_orig_params):
    ranks.run(2, run_case, dict(policy="always", use_orig_params=use_orig_params))


@pytest.mark.parametrize("policy", ["bn_block", "size", "custom"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_batchnorm_stays_fp32_under_mixed_precision(ranks, policy, use_orig_params):
    """With bf16 mixed precision and an auto-wrap policy, each BatchNorm is a
    unit of its own in fp32 (inputs cast up, outputs back down), on both of
    torch's paths: policy objects and policy callables."""
    ranks.run(2, run_case, dict(model="bn", policy=policy, mp=BF16, use_orig_params=use_orig_params, min_num_params=40))


def _units(model):
    return [(n.replace("_fsdp_wrapped_module.", ""), type(m.module).__name__, m.sharding_strategy.name,
             m.mixed_precision.param_dtype if m.mixed_precision is not None else None)
            for n, m in model.named_modules() if isinstance(m, (zs.FSDP, tfsdp.FullyShardedDataParallel))]


def _policy(which, lib, wrap_lib):
    if which == "always":
        return wrap_lib.always_wrap_policy
    if which == "custom":  # blocks SHARD_GRAD_OP, every other Linear a unit with the root's keywords
        return wrap_lib.CustomPolicy(lambda m: {"sharding_strategy": lib.ShardingStrategy.SHARD_GRAD_OP}
                                     if isinstance(m, Block) else isinstance(m, nn.Linear))
    if which == "bn_block":
        return wrap_lib.ModuleWrapPolicy({BNBlock})
    if which == "or":  # as PEFT's fsdp_auto_wrap_policy joins them
        return functools.partial(wrap_lib._or_policy, policies=[
            functools.partial(wrap_lib.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear) and m.out_features == 3),
            functools.partial(wrap_lib.transformer_auto_wrap_policy, transformer_layer_cls={Block})])
    if which == "private":  # torch's private helpers, as Accelerate's FSDP plugin and older scripts call them
        return functools.partial(wrap_lib._or_policy, policies=[
            functools.partial(wrap_lib._module_wrap_policy, module_classes={Block}),
            functools.partial(wrap_lib._wrap_module_cls_individually, module_classes=[nn.Linear])])
    return wrap_lib.size_based_auto_wrap_policy  # default min_num_params (1e8): no unit but the fp32 ones


def _same_units(rank, world_size, name, which, mp):
    base = build(name)
    built = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lib, wrap_lib, extra in ((tfsdp, twrap, {"device_id": torch.device("cpu")}), (zs, zs.wrap, {})):
            kw = dict(extra, auto_wrap_policy=_policy(which, lib, wrap_lib))
            if mp:
                kw["mixed_precision"] = lib.MixedPrecision(param_dtype=torch.bfloat16)
            built.append(lib.FullyShardedDataParallel(copy.deepcopy(base), **kw))
    ref, ours = (_units(m) for m in built)
    # torch's instances report param_dtype None when mixed precision is off; so does a zeroshard unit's MixedPrecision().
    assert ref == ours, (ref, ours)
    return len(ours)


@pytest.mark.parametrize("name,which,mp,expected", [
    ("mlp", "always", False, 13),  # root, inp, blocks (the ModuleList), 3 blocks, 6 Linears in them, out
    ("mlp", "custom", False, 12),
    ("mlp", "or", False, 5),  # root, 3 blocks, the 3-wide output Linear
    ("mlp", "private", False, 12),  # root, 3 blocks, every Linear (inp, 6 in blocks, out)
    ("bn", "bn_block", True, 5),
    ("bn", "size", True, 3),
])
def test_units_match_torch(ranks, name, which, mp, expected):
    assert ranks.run(2, _same_units, name, which, mp) == [expected] * 2


def _torch_policy_objects(rank, world_size):
    """torch's own ModuleWrapPolicy / CustomPolicy objects work in zeroshard."""
    base = build("mlp")
    for policy in (twrap.ModuleWrapPolicy({Block}),
                   twrap.CustomPolicy(lambda m: {"sharding_strategy": tfsdp.ShardingStrategy.SHARD_GRAD_OP}
                                      if isinstance(m, Block) else False)):
        ours = zs.FSDP(copy.deepcopy(base), auto_wrap_policy=policy)
        blocks = [m for m in ours.modules() if isinstance(m, zs.FSDP) and isinstance(m.module, Block)]
        assert len(blocks) == 3, _units(ours)
        ours(torch.randn(4, 5)).sum().backward()
    return True


def test_torch_policy_objects(ranks):
    assert ranks.run(2, _torch_policy_objects) == [True, True]


def _enable_wrap(rank, world_size, use_orig_params):
    """Units built with enable_wrap / wrap (the manual form) train like torch's."""
    torch.manual_seed(0)
    base = build("mlp")
    models = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lib, wrap_lib, extra in ((tfsdp, twrap, {"device_id": torch.device("cpu")}), (zs, zs.wrap, {})):
            m = copy.deepcopy(base)
            with wrap_lib.enable_wrap(wrapper_cls=lib.FullyShardedDataParallel, use_orig_params=use_orig_params, **extra):
                for i, blk in enumerate(m.blocks):  # the middle block: an override from wrap()
                    m.blocks[i] = wrap_lib.wrap(blk, sharding_strategy=lib.ShardingStrategy.SHARD_GRAD_OP) if i == 1 \
                        else wrap_lib.wrap(blk)
                models.append(wrap_lib.wrap(m))
    ref, ours = models
    assert _units(ref) == _units(ours), (_units(ref), _units(ours))
    assert [u[2] for u in _units(ours)] == ["FULL_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        outs = [m(x) for m in models]
        assert torch.equal(*outs), step
        for out, opt in zip(outs, opts):
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
            assert torch.equal(a, b), (step, n)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_enable_wrap_matches_torch(ranks, use_orig_params):
    assert ranks.run(2, _enable_wrap, use_orig_params) == [True, True]


def test_wrap_outside_enable_wrap_is_the_identity():
    lin = nn.Linear(2, 2)
    assert zs.wrap.wrap(lin) is lin


def test_enable_wrap_does_not_nest():
    with zs.wrap.enable_wrap(wrapper_cls=zs.FSDP):
        with pytest.raises(NotImplementedError, match="do not nest"):
            with zs.wrap.enable_wrap(wrapper_cls=zs.FSDP):
                pass
    lin = nn.Linear(2, 2)
    assert zs.wrap.wrap(lin) is lin  # the context is gone after an error inside it


def _bad_policies(rank, world_size):
    with pytest.raises(ValueError, match="CustomPolicy's lambda_fn returned 1 for a Linear"):
        zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.CustomPolicy(lambda m: 1 if isinstance(m, nn.Linear) else False))
    with pytest.raises(ValueError, match=r"gave the Block unit unknown keyword\(s\) \['shard_strategy'\]"):
        zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.CustomPolicy(lambda m: {"shard_strategy": 1} if isinstance(m, Block) else False))
    for policy in (zs.wrap.ModuleWrapPolicy({Block}), zs.wrap.always_wrap_policy):
        model = build("mlp")
        model.blocks[2] = zs.FSDP(model.blocks[2])
        with pytest.raises(ValueError, match="already an FSDP unit"):
            zs.FSDP(model, auto_wrap_policy=policy, mixed_precision=zs.MixedPrecision(param_dtype=torch.bfloat16))
        # refused before anything changed (torch checks first too)
        assert type(model.inp) is nn.Linear and type(model.blocks[0]) is Block and not model.inp._forward_pre_hooks
    return True


def test_policy_misuse_is_refused(ranks):
    assert ranks.run(2, _bad_policies) == [True, True]


def test_size_based_policy_does_not_recurse_into_small_subtrees():
    """torch's rule: recursion needs nonwrapped_numel >= min_num_params too."""
    for recurse in (True, False):
        for numel, expected in ((99, False), (100, True)):
            args = dict(module=nn.Linear(2, 2), recurse=recurse, nonwrapped_numel=numel, min_num_params=100)
            assert zs.wrap.size_based_auto_wrap_policy(**args) is expected
            assert twrap.size_based_auto_wrap_policy(**args) is expected


def test_fp32_hooks_keep_container_types():
    """run_in_fp32 casts inside namedtuples, OrderedDicts and dataclasses and returns the same types."""
    import collections
    import dataclasses

    from zeroshard.mixed_precision import run_in_fp32

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor
        n: int = 1

    Pair = collections.namedtuple("Pair", "a b")

    class M(nn.Module):
        def forward(self, x):
            assert x.dtype == torch.float32  # the input was cast up
            return Pair(x, collections.OrderedDict(z=x)), Out(x)

    m = M()
    run_in_fp32(m)
    (pair, out) = m(torch.ones(2, dtype=torch.bfloat16))
    assert type(pair) is Pair and type(pair.b) is collections.OrderedDict and type(out) is Out and out.n == 1
    assert pair.a.dtype == pair.b["z"].dtype == out.y.dtype == torch.bfloat16  # and back down


def _double_wrapped(rank, world_size, use_orig_params):
    from parity import assert_same_value, train_step

    base = build("mlp")
    models = []
    for cls, extra in ((tfsdp.FullyShardedDataParallel, {"device_id": torch.device("cpu")}), (zs.FSDP, {})):
        policy = (twrap if cls is tfsdp.FullyShardedDataParallel else zs.wrap).ModuleWrapPolicy({Block})
        inner = cls(copy.deepcopy(base), auto_wrap_policy=policy, use_orig_params=use_orig_params, **extra)
        models.append(cls(inner, use_orig_params=use_orig_params, **extra))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        for m, o in zip(models, opts):
            train_step(m, o, "mlp", rank, step)
    ref, ours = models
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in ours.named_parameters()]
    for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        assert_same_value(a, b, n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sds = [m.state_dict() for m in models]
        # offload_to_cpu=False: torch's default (True) on CPU returns exp_avg equal to exp_avg_sq with use_orig_params
        with tfsdp.FullyShardedDataParallel.state_dict_type(ref, tfsdp.StateDictType.FULL_STATE_DICT, None,
                                                            tfsdp.FullOptimStateDictConfig(offload_to_cpu=False)):
            osds = [tfsdp.FullyShardedDataParallel.optim_state_dict(ref, opts[0]), zs.FSDP.optim_state_dict(ours, opts[1])]
    assert list(sds[0]) == list(sds[1]) and list(osds[0]["state"]) == list(osds[1]["state"])
    for k in sds[0]:
        assert_same_value(sds[0][k], sds[1][k], k)
    for k in osds[0]["state"]:
        for name in osds[0]["state"][k]:
            assert_same_value(osds[0]["state"][k][name], osds[1]["state"][k][name], (k, name))
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_wrapping_a_unit_again_matches_torch(ranks, use_orig_params):
    """FSDP(FSDP(model)): torch allows it; the outer unit owns no parameter."""
    assert ranks.run(2, _double_wrapped, use_orig_params) == [True, True]


def test_policy_objects_are_policies():
    """torch's _Policy base, for code that checks isinstance(policy, _Policy)."""
    assert isinstance(zs.wrap.ModuleWrapPolicy({Block}), zs.wrap._Policy)
    assert isinstance(zs.wrap.CustomPolicy(lambda m: False), zs.wrap._Policy)
