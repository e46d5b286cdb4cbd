"""Before training: meta-device construction, sync_module_states, CPU offload
and the hybrid-sharding groups."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.nn as nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

import zeroshard as zs
from models import MLP, Block, batch, build


def _meta_init_vs_torch(rank, world_size, use_param_init_fn):
    def init_fn(m):  # the param_init_fn protocol: materialize this module's own states
        m.to_empty(device=torch.device("cpu"), recurse=False)
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()

    fn = init_fn if use_param_init_fn else None
    models = []
    for engine in ("torch", "zeroshard"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = MLP(n_blocks=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if engine == "torch":
                models.append(tfsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"), param_init_fn=fn,
                                                             auto_wrap_policy=TorchModuleWrapPolicy({Block})))
            else:
                models.append(zs.FSDP(model, param_init_fn=fn, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block})))
    ref, ours = models
    for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        assert not b.is_meta and torch.equal(a, b), n
    x = batch("mlp", rank, 0)
    assert torch.equal(ref(x), ours(x))
    return True


@pytest.mark.parametrize("use_param_init_fn", [False, True])
def test_meta_device_init_matches_torch(ranks, use_param_init_fn):
    ranks.run(2, _meta_init_vs_torch, use_param_init_fn)


class Wide(nn.Module):
    def __init__(self, n=8, d=512):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))


def _init_fn_reaching_wrapped_units(rank, world_size, use_orig_params):
    def init_fn(m):  # to_empty without recurse=False: on the root it re-empties the wrapped Blocks too
        m.to_empty(device=torch.device("cpu"))
        with torch.no_grad():
            for p in m.parameters(recurse=False):
                p.fill_(0.05)

    with torch.device("meta"):
        model = MLP(n_blocks=3)
    try:
        zs.FSDP(model, param_init_fn=init_fn, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_param_init_fn_reaching_wrapped_units_is_refused(ranks, use_orig_params):
    """torch FSDP1 trains on the re-emptied (garbage) values of the wrapped units silently."""
    for msg in ranks.run(2, _init_fn_reaching_wrapped_units, use_orig_params):
        assert msg is not None and msg.startswith("zeroshard: param_init_fn re-created the parameters of a unit wrapped already"), msg
        assert "to_empty(device=..., recurse=False)" in msg, msg


def _partly_meta_vs_torch(rank, world_size, real):
    """A unit with some states on meta: torch FSDP1 re-creates and resets every
    module of that unit, the real ones too; zeroshard does the same, so the
    values and the random stream after wrapping are torch's."""
    models, draws = [], []
    for engine in ("torch", "zeroshard"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = MLP(n_blocks=2)
        if real == "inp":  # a real module in the root unit, its values set by hand
            model.inp = nn.Linear(5, 7)
            nn.init.constant_(model.inp.weight, 0.5)
        else:  # every parameter real, only the root's buffer on meta
            model = MLP(n_blocks=2)
            model.scale = torch.empty(3, device="meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if engine == "torch":
                models.append(tfsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                                             auto_wrap_policy=TorchModuleWrapPolicy({Block})))
            else:
                models.append(zs.FSDP(model, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block})))
        draws.append(torch.rand(4))
    ref, ours = models
    assert torch.equal(*draws)
    with tfsdp.FullyShardedDataParallel.summon_full_params(ref), zs.FSDP.summon_full_params(ours):
        for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
            assert torch.equal(a, b), n
        assert not torch.equal(ours.inp.weight, torch.full_like(ours.inp.weight, 0.5))  # reset, as torch
    assert torch.equal(ref.scale, ours.scale)
    return True


@pytest.mark.parametrize("real", ["inp", "all_but_a_buffer"])
def test_partly_meta_unit_is_reset_whole_as_torch(ranks, real):
    ranks.run(2, _partly_meta_vs_torch, real)


def _meta_init_peak(rank, world_size):
    """8 x 1 MB layers built on meta and wrapped one unit per layer: each time
    a layer is materialized, count the unsharded parameter bytes alive in the
    whole model (FlatParameter shards excluded). Units are materialized and
    sharded one at a time, so the peak is one layer, never the model.
    (An instrumented count: RSS is blurred by the allocator keeping freed pages.)"""
    from zeroshard.flat_param import FlatParameter

    with torch.device("meta"):
        model = Wide()
    peak = [0]

    def track(m):
        m.to_empty(device=torch.device("cpu"), recurse=False)
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
        alive = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta and not isinstance(p, FlatParameter))
        peak[0] = max(peak[0], alive)

    zs.FSDP(model, param_init_fn=track, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({nn.Linear}))
    layer = sum(p.numel() * 4 for p in nn.Linear(512, 512).parameters())
    return peak[0], layer, 8 * layer


def test_meta_init_never_materializes_the_whole_model(ranks):
    for peak, layer, full in ranks.run(2, _meta_init_peak):
        assert peak == layer < full, (peak, layer, full)


def _sync(rank, world_size):
    torch.manual_seed(rank)  # every rank starts from different weights
    model = zs.FSDP(build("mlp", seed=rank), sync_module_states=True, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    got = model.state_dict()
    want = build("mlp", seed=0).state_dict()
    assert list(got) == list(want)
    return all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_module_states_takes_rank0_weights(ranks, world_size):
    assert all(ranks.run(world_size, _sync))


def _sync_ignored(rank, world_size):
    """torch FSDP1 broadcasts every not-yet-synced buffer under the unit, those of
    ignored modules too, but no ignored parameter (torch refuses
    sync_module_states on CPU, so the expectation is written out here)."""
    model = build("mlp", seed=rank)
    model.norm = nn.BatchNorm1d(7)
    with torch.no_grad():
        model.norm.running_mean.fill_(rank)
        model.norm.weight.fill_(rank)
    model = zs.FSDP(model, sync_module_states=True, ignored_states=[model.norm],
                    auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    want = build("mlp", seed=0).state_dict()
    got = model.state_dict()
    return (all(torch.equal(got[k], want[k]) for k in want), model.norm.running_mean.tolist(), model.norm.weight[0].item())


def test_sync_module_states_broadcasts_ignored_modules_buffers(ranks):
    for rank, (same, mean, weight) in enumerate(ranks.run(2, _sync_ignored)):
        assert same and mean == [0.0] * 7 and weight == rank


def _offload_vs_plain(rank, world_size, use_orig_params):
    """CPUOffload on a CPU compute device: the code path runs (shards and
    grads kept on CPU, copies to the compute device are no-ops) and training
    is bit-identical to the same run without offload."""
    base = build("mlp")
    runs = []
    for offload in (False, True):
        model = zs.FSDP(copy.deepcopy(base), cpu_offload=zs.CPUOffload(offload_params=offload), use_orig_params=use_orig_params,
                        auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            model(batch("mlp", rank, step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert all(u._handle.local_shard.device.type == "cpu" for u in zs.FSDP.fsdp_modules(model))
        runs.append(model.state_dict())
    return all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_cpu_offload_is_bit_identical_on_cpu(ranks, use_orig_params):
    assert all(ranks.run(2, _offload_vs_plain, use_orig_params))


def _bad_group_size(rank, world_size):
    try:
        zs.FSDP(MLP(), fsdp_group_size=2)
    except ValueError as e:
        return str(e)
    return None


def test_fsdp_group_size_must_divide_world(ranks):
    for msg in ranks.run(3, _bad_group_size):
        assert msg and "fsdp_group_size=2" in msg and "world size 3" in msg


def _hybrid_layout(rank, world_size):
    """HYBRID_SHARD over 2 groups of 2: shards are half the unit (not a
    quarter), all-gathers and reduce-scatters stay inside a pair, the
    all-reduce goes across pairs; and the gradients agree with FULL_SHARD on
    4 ranks up to fp32 summation order ((g0+g1)+(g2+g3) against gloo's
    4-way reduce-scatter), hence a tolerance instead of torch.equal."""
    base = build("mlp")
    kw = dict(auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=True)
    hybrid = zs.FSDP(copy.deepcopy(base), fsdp_group_size=2, **kw)
    full = zs.FSDP(copy.deepcopy(base), **kw)
    for h, f in zip(zs.FSDP.fsdp_modules(hybrid), zs.FSDP.fsdp_modules(full)):
        assert h._handle.layout.shard_numel == -(-h._handle.layout.numel // 2)
        assert f._handle.layout.shard_numel == -(-f._handle.layout.numel // 4)
    assert hybrid.process_group.size() == 2 and hybrid._replicate_group.size() == 2
    x = batch("mlp", rank, 0)
    with zs.comm_stats() as stats:
        hybrid(x).pow(2).mean().backward()
    assert stats.group_sizes["all_gather"] == {2} and stats.group_sizes["reduce_scatter"] == {2}
    assert stats.group_sizes["all_reduce"] == {2} and stats.calls["all_reduce"] == stats.calls["reduce_scatter"]
    full(x).pow(2).mean().backward()
    with zs.FSDP.summon_full_params(hybrid, with_grads=True), zs.FSDP.summon_full_params(full, with_grads=True):
        for (n, a), (_, b) in zip(hybrid.named_parameters(), full.named_parameters()):
            assert torch.equal(a, b), n
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=n)
    return True


def test_hybrid_groups_and_shard_sizes(ranks):
    assert all(ranks.run(4, _hybrid_layout))


def _groups_misused_and_subgroups(rank, world_size):
    """On 4 ranks. (1) Replicate groups crossing shard positions ({0,3}, {1,2}
    over shard groups {0,1}, {2,3}) trained with replicas diverging silently;
    (2) fsdp_group_size silently replaced process_group. (3) A model sharded
    over {0,1} (and another over {2,3}): its LOCAL state dict raised 'Global
    rank 0 does not exist' on {2,3}, and optim_state_dict_to_load checked
    over the world, waiting for ranks outside the model. (4) Replicate groups
    of different sizes ({0,2}, {1}, {3}): with auto-wrapped units, ranks 1 and
    3 failed at construction with an internal TypeError (their shard-group
    exchanges paired with other ones), ranks 0 and 2 with a 'layout' naming a
    whole tuple; left alone, positions 1 never averaged and drifted apart."""
    import torch.distributed as dist

    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    uneven = [dist.new_group([0, 2]), dist.new_group([1]), dist.new_group([3])]
    mine, other = shard[rank // 2], crossed[0 if rank in (0, 3) else 1]
    said = []
    hybrid = {"sharding_strategy": zs.ShardingStrategy.HYBRID_SHARD}
    for kw in ({"process_group": (mine, other), **hybrid},
               {"process_group": (mine, other), "fsdp_group_size": 2},
               {"process_group": (mine, uneven[{0: 0, 2: 0, 1: 1, 3: 2}[rank]]), **hybrid,
                "auto_wrap_policy": zs.wrap.ModuleWrapPolicy({Block})},
               # (5) the same with sync_module_states: a rank alone in its replicate group skipped the comparisons'
               # sharing while the other in its shard group waited there (the subgroup's timeout, 30 min by default)
               {"process_group": (mine, uneven[{0: 0, 2: 0, 1: 1, 3: 2}[rank]]), **hybrid, "sync_module_states": True}):
        try:
            zs.FSDP(build("mlp"), **kw)(batch("mlp", rank, 0))  # the grid is checked at the first forward
            said.append(None)
        except ValueError as e:
            said.append(str(e))
    def make(seed):
        model = zs.FSDP(build("mlp", seed=seed), process_group=mine, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = make(0)
    model(batch("mlp", rank, 0)).sum().backward()
    opt.step()
    opt.zero_grad()
    with zs.FSDP.state_dict_type(model, zs.StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
    osd = zs.FSDP.optim_state_dict(model, opt)
    fresh, fresh_opt = make(1)
    with zs.FSDP.state_dict_type(fresh, zs.StateDictType.LOCAL_STATE_DICT):
        fresh.load_state_dict(local)
    fresh_opt.load_state_dict(zs.FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(batch("mlp", rank, 1)).sum().backward()
        o.step()
    return said, torch.equal(model(batch("mlp", rank, 2)), fresh(batch("mlp", rank, 2)))


def test_hybrid_groups_misused_and_models_on_subgroups(ranks):
    for said, restored in ranks.run(4, _groups_misused_and_subgroups):
        assert said[0] is not None and "joins ranks at different positions" in said[0] and "Fix" in said[0], said
        assert said[1] is not None and "pass only one of process_group, device_mesh and fsdp_group_size" in said[1], said
        for uneven in said[2:]:
            assert uneven is not None and "replicate groups have different sizes" in uneven and "Fix" in uneven, said
        assert restored


def _meta_equals_eager(rank, world_size, wrap_each):
    def make():
        return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Linear(7, 2))

    torch.manual_seed(3)
    eager = make()
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = make()
    policy = zs.wrap.ModuleWrapPolicy({nn.Linear}) if wrap_each else None
    model = zs.FSDP(meta, auto_wrap_policy=policy)
    got, want = model.state_dict(), eager.state_dict()
    return list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("wrap_each", [False, True])
def test_meta_init_equals_eager_init_with_same_seed(ranks, wrap_each):
    """Where materialization order equals construction order (here: a
    Sequential), meta-device init reproduces the eagerly built weights."""
    assert all(ranks.run(2, _meta_equals_eager, wrap_each))


def _module_reprs(rank, world_size, use_orig_params):
    model = zs.FSDP(MLP(n_blocks=2), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    names = []
    model.apply(lambda m: names.append(type(m).__name__))
    before = repr(model)
    model(batch("mlp", rank, 0))
    return before, repr(model), names


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_wrapped_module_prints_before_first_forward(ranks, use_orig_params):
    """repr() and apply() reach every submodule before the first unshard too
    (torch FSDP1 allows both; the original attributes must exist)."""
    for before, after, names in ranks.run(2, _module_reprs, use_orig_params):
        assert before == after and "bias=True" in before and "Linear" in names


class _EmbNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10, bias=False)

    def forward(self, i):
        return self.head(self.lin(self.emb(i)))


def _init_whole_subtree(module):
    module.to_empty(device=torch.device("cpu"))
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _ignored_module_edges(rank, world_size):
    """(1) A meta model whose param_init_fn also materializes an ignored module
    (torch FSDP1 takes it) was refused as 're-created the parameters of a unit
    wrapped already', with no unit wrapped. (2) sync_module_states broadcast an
    ignored module's weight when another module used it (a tied head), though
    not when it was ignored through ignored_states. (3) device_id=meta."""
    outputs = []
    for engine in ("torch", "zeroshard"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = _EmbNet()
        wrap = tfsdp.FullyShardedDataParallel if engine == "torch" else zs.FSDP
        extra = {"device_id": torch.device("cpu")} if engine == "torch" else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = wrap(model, ignored_modules=[model.emb], param_init_fn=_init_whole_subtree, **extra)
        outputs.append(model(torch.arange(4)))
    tied = []
    for how in ("ignored_modules", "ignored_states"):
        net = _EmbNet()
        torch.manual_seed(rank)
        net.emb.reset_parameters()
        net.head.weight = net.emb.weight
        mine = net.emb.weight.detach().clone()
        kw = {"ignored_modules": [net.emb]} if how == "ignored_modules" else {"ignored_states": [net.emb.weight]}
        net = zs.FSDP(net, sync_module_states=True, **kw)
        tied.append(torch.equal(net.module.emb.weight, mine))
    try:
        zs.FSDP(nn.Linear(2, 2), device_id=torch.device("meta"))
        meta = None
    except ValueError as e:
        meta = str(e)
    return torch.equal(outputs[0], outputs[1]), tied, meta


def test_ignored_modules_at_init_as_torch(ranks):
    for same, tied, meta in ranks.run(2, _ignored_module_edges):
        assert same
        assert tied == [True, True], tied
        assert meta is not None and "device_id=meta" in meta and "Fix" in meta, meta


def _double_wrap_sync(rank, world_size, use_orig_params):
    model = build("mlp", seed=0)
    want = [v.clone() for v in model.state_dict().values()]
    outer = zs.FSDP(zs.FSDP(model, use_orig_params=use_orig_params), sync_module_states=True,
                    use_orig_params=use_orig_params)
    return all(torch.equal(a, b) for a, b in zip(outer.state_dict().values(), want))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sync_module_states_around_a_wrapped_unit_syncs_nothing_of_it(ranks, use_orig_params):
    """FSDP(FSDP(m), sync_module_states=True): the outer unit broadcast rank 0's shard over every
    rank's (use_orig_params=False: every parameter silently wrong) or refused the ranks' shards
    as 'different models'; torch FSDP1 skips the inner unit's parameters."""
    assert all(ranks.run(2, _double_wrap_sync, use_orig_params))


def _meta_ignored_buffers(rank, world_size):
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.device("meta"):
        model.add_module("norm", nn.BatchNorm1d(2, affine=False))  # fp32 buffers beside fp32 weights
    wrapped = zs.FSDP(model, sync_module_states=True, ignored_modules=[model.norm])
    with zs.FSDP.summon_full_params(wrapped):
        weight = wrapped.module[0].weight.detach().clone()
    return weight, [b.is_meta for b in model.norm.buffers()]


def test_sync_module_states_leaves_an_ignored_modules_meta_buffers(ranks):
    """They went into the broadcast beside real tensors of their dtype: 'tensors[2] is on meta'.
    torch FSDP1 leaves them on meta for the user to fill."""
    (w0, meta0), (w1, meta1) = ranks.run(2, _meta_ignored_buffers)
    assert torch.equal(w0, w1) and all(meta0) and all(meta1)
