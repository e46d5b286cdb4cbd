"""ZeRO-3 memory: parameters are really freed outside their unit's compute,
and limit_all_gathers bounds how many units are unsharded at once."""
from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from models import MLP, Block


def _storage(unit) -> int:
    return unit._handle.padded.untyped_storage().size()


def _freed_outside_compute(rank, world_size, use_orig_params):
    torch.manual_seed(0)
    model = zs.FSDP(MLP(n_blocks=4), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    units = [m for m in model.modules() if isinstance(m, zs.FSDP)]
    inner = units[1:]
    seen_in_forward = []
    for u in inner:
        u.module.register_forward_hook(lambda mod, i, o, u=u: seen_in_forward.append(_storage(u)))
    assert all(_storage(u) == 0 for u in units), "storage allocated right after construction"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        loss = model(torch.randn(4, 5)).sum()
        # Between forward and backward only the root stays gathered (it runs backward first).
        assert [_storage(u) for u in inner] == [0] * len(inner)
        assert _storage(units[0]) > 0
        loss.backward()
        assert [_storage(u) for u in units] == [0] * len(units), "unsharded storage left after backward"
        opt.step()
        opt.zero_grad()
    assert seen_in_forward and all(s == units[1]._handle.padded_bytes for s in seen_in_forward)
    shard = units[1]._handle.local_shard
    assert shard.numel() == units[1]._handle.layout.shard_numel
    assert shard.numel() * world_size == units[1]._handle.layout.padded_numel
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_unsharded_storage_is_freed(ranks, use_orig_params):
    ranks.run(2, _freed_outside_compute, use_orig_params)


def _peak_units(rank, world_size, limit, max_live=2):
    from zeroshard import prefetch

    prefetch.MAX_LIVE_PREFETCH_UNITS, saved = max_live, prefetch.MAX_LIVE_PREFETCH_UNITS
    torch.manual_seed(0)
    model = zs.FSDP(
        MLP(n_blocks=6), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), limit_all_gathers=limit,
        backward_prefetch=zs.BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True,
    )
    peaks = []
    for step in range(3):  # forward prefetch starts from the second iteration
        zs.unsharded_tracker.reset_peaks()
        model(torch.randn(4, 5)).sum().backward()
        peaks.append(zs.unsharded_tracker.peak_non_root_units)
    assert zs.unsharded_tracker.live_non_root == 0
    prefetch.MAX_LIVE_PREFETCH_UNITS = saved
    return peaks


def test_limit_all_gathers_bounds_live_units(ranks):
    limited = ranks.run(2, _peak_units, True)[0]
    assert max(limited) <= 2, limited
    # The bound is reached (prefetch really keeps a second unit in flight) ...
    assert max(limited) == 2
    # ... and it is the limiter that holds it: a limit of one unit disables
    # prefetching and the peak drops to one.
    assert max(ranks.run(2, _peak_units, True, 1)[0]) == 1
    assert max(ranks.run(2, _peak_units, False, 1)[0]) == 2


def _dropped_model_is_freed(rank, world_size, use_orig_params):
    import gc
    import weakref

    model = zs.FSDP(MLP(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    model(torch.randn(4, 5))  # a forward without backward leaves the root gathered
    ref, shard = weakref.ref(model), weakref.ref(model._handle.flat_param)
    del model, opt
    gc.collect()
    return ref() is None and shard() is None and not any(True for _ in zs.unsharded_tracker.live)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_dropped_model_is_garbage_collected(ranks, use_orig_params):
    """Hooks held by C++ (on the FlatParameter) must not keep the wrapper alive."""
    assert all(ranks.run(2, _dropped_model_is_freed, use_orig_params))


def _state_dict_peak(rank, world_size, use_orig_params, kind):
    torch.manual_seed(0)
    model = zs.FSDP(MLP(n_blocks=4), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    model(torch.randn(4, 5)).sum().backward()
    config = zs.FullStateDictConfig(rank0_only=True, offload_to_cpu=True) if kind == "rank0_only" else None
    sd_type = zs.StateDictType.SHARDED_STATE_DICT if kind == "sharded" else zs.StateDictType.FULL_STATE_DICT
    zs.unsharded_tracker.reset_peaks()
    with zs.FSDP.state_dict_type(model, sd_type, config):
        sd = model.state_dict()
    # the root (which has parameters of its own) and one block: the units on one root-to-leaf path, of 5
    assert zs.unsharded_tracker.peak_units == 2, zs.unsharded_tracker.peak_units
    assert kind == "rank0_only" and rank != 0 or len(sd) == len(MLP(n_blocks=4).state_dict())
    if kind == "rank0_only":
        return True
    # Loading gathers the same way (each unit written back and freed once its subtree is loaded).
    before = model.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    zs.unsharded_tracker.reset_peaks()
    with zs.FSDP.state_dict_type(model, sd_type, config):
        model.load_state_dict(sd)
    assert zs.unsharded_tracker.peak_units == 2, zs.unsharded_tracker.peak_units
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("kind", ["full", "rank0_only", "sharded"])
def test_state_dicts_gather_one_unit_at_a_time(ranks, use_orig_params, kind):
    """As torch FSDP1's state-dict hooks do: a unit is gathered when the walk
    reaches it and its full parameters are copied out and freed when its
    subtree is done, so the peak is one root-to-leaf path of units on top of
    the copies (with offload_to_cpu, copies on the CPU), not the whole model
    twice; loading likewise. zeroshard used to gather every unit at once."""
    assert all(ranks.run(2, _state_dict_peak, use_orig_params, kind))


def _unsharded_grads_alive(rank, world_size, strategy):
    """How many units' unsharded gradients (the reduce-scatter send buffers) are alive when each
    block's backward starts, and how many were sent."""
    import weakref

    from zeroshard import comm

    sent, alive = [], []
    issue = comm._reduce_scatter

    def spy(out, inp, **kw):
        sent.append(weakref.ref(inp))
        return issue(out, inp, **kw)

    comm._reduce_scatter = spy
    try:
        torch.manual_seed(0)
        model = zs.FSDP(MLP(n_blocks=6), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                        sharding_strategy=strategy)
        for m in model.modules():
            if isinstance(m, Block):
                m.register_full_backward_pre_hook(lambda *_: alive.append(sum(r() is not None for r in sent)))
        torch.manual_seed(rank)
        model(torch.randn(4, 5)).sum().backward()
    finally:
        comm._reduce_scatter = issue
    return alive, len(sent)


@pytest.mark.parametrize("strategy", [zs.ShardingStrategy.FULL_SHARD, zs.ShardingStrategy.SHARD_GRAD_OP])
def test_unsharded_gradients_are_freed_during_backward(ranks, strategy):
    """Every unit's unsharded gradient stayed alive until the end of backward (the reductions were
    only waited for there): Ψ·c per rank at the end of backward where torch FSDP1 holds one unit's.
    Now a reduction is waited for once the next is issued: at most one send buffer in flight."""
    for alive, n_sent in ranks.run(2, _unsharded_grads_alive, strategy):
        assert n_sent == 7  # six blocks and the root
        assert len(alive) == 6 and alive[0] == 0, alive
        assert max(alive) <= 1, alive  # was 0, 1, 2, 3, 4, 5
