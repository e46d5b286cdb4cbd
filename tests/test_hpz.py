"""Hierarchical secondary shards (ZeRO++ hpZ): ``hpz_group_size=k``.

On 4 ranks with k = 2 (groups {0, 1} and {2, 3}):
* training is bit-identical to FULL_SHARD (outputs, gradients, AdamW steps):
  the backward rebuilds exactly the buffer the forward gathered;
* forward all-gathers run over all 4 ranks, backward all-gathers only over the
  rank's own group of 2, reduce-scatters over all 4 — asserted with the group
  membership comm_stats records — with the bytes the estimator predicts;
* between forward and backward each rank holds padded/k elements per non-root
  unit (the estimator's ``secondary_bytes``), and nothing once backward is done;
* with qwZ as well, it equals qwZ alone bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch

import zeroshard as zs
from models import Block, TransformerBlock, batch, build
from zeroshard.estimate import comm_volume, estimate_model, hpz_tradeoff
from zeroshard.quantize import Int8BlockQuant

K = 2


def _policy(name):
    return zs.wrap.ModuleWrapPolicy({TransformerBlock} if name == "gpt" else {Block})


def _window(stats) -> dict:
    return {k: (stats.calls[k], stats.bytes[k], sorted(stats.group_ranks[k])) for k in stats.calls}


def _secondary_bytes(model) -> int:
    return sum(h.secondary.numel() * h.secondary.element_size() for h in model._runtime.handles if h.secondary is not None)


def _hpz_vs(rank, world_size, model_name, use_orig_params, base_kw, steps=2):
    """The model with ``hpz_group_size=K`` against the same model without it."""
    base = build(model_name)
    kw = dict(auto_wrap_policy=_policy(model_name), use_orig_params=use_orig_params, **base_kw)
    ref = zs.FSDP(copy.deepcopy(base), **kw)
    hpz = zs.FSDP(copy.deepcopy(base), hpz_group_size=K, **kw)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, hpz)]
    windows, held = [], []
    for step in range(steps):
        x = batch(model_name, rank, step)
        out_ref = ref(x)
        out_ref.float().square().mean().backward()
        with zs.comm_stats() as fwd:
            out = hpz(x)
        held.append(_secondary_bytes(hpz))
        with zs.comm_stats() as bwd:
            out.float().square().mean().backward()
        held.append(_secondary_bytes(hpz))
        windows.append((_window(fwd), _window(bwd)))
        assert torch.equal(out_ref, out), f"step {step}: output differs"
        for (n, a), (_, b) in zip(ref.named_parameters(), hpz.named_parameters()):
            assert (a.grad is None) == (b.grad is None), n
            if a.grad is not None:
                assert torch.equal(a.grad, b.grad), f"step {step}: grad of {n} differs"
        for o in opts:
            o.step()
            o.zero_grad()
        for (n, a), (_, b) in zip(ref.named_parameters(), hpz.named_parameters()):
            assert torch.equal(a, b), f"step {step}: {n} differs after AdamW"
    live = [h.padded.untyped_storage().size() for h in hpz._runtime.handles]
    return windows, held, live


def _check_groups(results, est):
    world = len(results)
    everyone = (tuple(range(world)),)
    volume = comm_volume(est)
    for rank, (windows, held, live) in enumerate(results):
        block = tuple(range(rank // K * K, rank // K * K + K))
        for fwd, bwd in windows:
            assert set(fwd) == {"all_gather"} and fwd["all_gather"][2] == list(everyone)
            assert fwd["all_gather"][1] == pytest.approx(volume["forward all_gather"][0], rel=1e-12, abs=0)
            ag_calls, ag_bytes, ag_groups = bwd["all_gather"]
            assert ag_groups == [block], f"rank {rank}: backward all-gathers over {ag_groups}, expected {block}"
            assert ag_calls == len(est.units) - 1  # every unit but the root
            assert volume["backward all_gather"][1] == K
            assert ag_bytes == pytest.approx(volume["backward all_gather"][0], rel=1e-12, abs=0)
            rs_calls, rs_bytes, rs_groups = bwd["reduce_scatter"]
            assert rs_groups == list(everyone) and rs_calls == len(est.units)
            assert rs_bytes == pytest.approx(volume["reduce_scatter"][0], rel=1e-12, abs=0)
        # Held from forward to backward: the estimator's secondary bytes; then nothing.
        assert held[0::2] == [est.secondary_bytes] * len(windows) and set(held[1::2]) == {0}
        assert live == [0] * len(live)


@pytest.mark.parametrize("model_name,use_orig_params,prefetch", [
    ("mlp", False, zs.BackwardPrefetch.BACKWARD_PRE),
    ("gpt", True, zs.BackwardPrefetch.BACKWARD_POST),
])
def test_backward_gathers_within_group_bit_identical(ranks, model_name, use_orig_params, prefetch):
    results = ranks.run(4, _hpz_vs, model_name, use_orig_params, dict(backward_prefetch=prefetch))
    est = estimate_model(build(model_name), 4, _policy(model_name), "FULL_SHARD", use_orig_params=use_orig_params,
                         hpz_group_size=K)
    assert est.secondary_bytes == sum(u.padded_numel for u in est.units[1:]) * 4 // K
    _check_groups(results, est)


def test_with_quantized_all_gather(ranks):
    """hpZ + qwZ equals qwZ alone: the secondary shard holds the dequantized
    weights the forward used, which re-quantizing the master gives again."""
    results = ranks.run(4, _hpz_vs, "mlp", False, dict(quantized_all_gather=Int8BlockQuant(block_size=32)))
    for windows, _, _ in results:
        fwd, bwd = windows[0]
        assert len(bwd["all_gather"][2]) == 1 and len(bwd["all_gather"][2][0]) == K


def _changed_between_forward_and_backward(rank, world_size, how):
    """The shard changes between forward and backward (a fused optimizer step, an edit
    written back by summon_full_params, an in-place edit of the parameters):
    FULL_SHARD's backward gathers the new shard; hpZ gathered the secondary
    kept at forward, giving other gradients."""
    base = build("mlp")
    grads = []
    for kw in ({}, {"hpz_group_size": 2}):
        model = zs.FSDP(copy.deepcopy(base), auto_wrap_policy=_policy("mlp"), use_orig_params=how == "in-place edit", **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
        model(batch("mlp", rank, 0)).pow(2).mean().backward()
        out = model(batch("mlp", rank, 1))
        if how == "fused step":
            opt.step()
        elif how == "in-place edit":  # a weight constraint, a hand-written update
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        else:
            with zs.FSDP.summon_full_params(model):
                for p in model.parameters():
                    p.data.mul_(0.5)
        model.zero_grad()
        out.pow(2).mean().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])  # None: no slice here
    return all(a is b is None or torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("how", ["fused step", "summon edit", "in-place edit"])
def test_a_shard_changed_after_forward_is_gathered_anew(ranks, how):
    assert all(ranks.run(4, _changed_between_forward_and_backward, how))


def _rejects(rank, world_size):
    errors = []
    for kw in (dict(sharding_strategy=zs.ShardingStrategy.SHARD_GRAD_OP), dict(hpz_group_size=3)):
        kw.setdefault("hpz_group_size", K)
        try:
            zs.FSDP(build("mlp"), auto_wrap_policy=_policy("mlp"), **kw)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_rejects_other_strategies_and_bad_group_sizes(ranks):
    errors = ranks.run(4, _rejects)[0]
    assert len(errors) == 2 and "FULL_SHARD" in errors[0] and "divide" in errors[1]


def test_closed_form_tradeoff():
    """7B parameters in bf16 on 64 ranks, hpZ over nodes of 8: each rank holds
    Ψ·2/8 = 1.75 GB more and sends Ψ·2·7/8 inside its node instead of Ψ·2·63/64."""
    t = hpz_tradeoff(7e9, 64, 8, itemsize=2)
    assert t["secondary_bytes"] == 1.75e9
    assert t["backward_bytes_hpz"] == 7e9 * 2 * 7 / 8 and t["backward_bytes_zero3"] == 7e9 * 2 * 63 / 64
    assert hpz_tradeoff(7e9, 64, 64, 2)["backward_bytes_hpz"] == t["backward_bytes_zero3"]  # k = N: plain ZeRO-3


def _update_skipping_empty_slices(rank, world_size):
    """A hand-written update between forward and backward that skips parameters without a
    gradient (``if p.grad is not None``): ranks holding no slice of a unit move no counter."""
    import torch.nn as nn

    torch.manual_seed(0)
    model = zs.FSDP(nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 1)), use_orig_params=True, hpz_group_size=K,
                    auto_wrap_policy=zs.wrap.ModuleWrapPolicy({nn.Linear}))
    x = torch.randn(3, 4)
    model(x).sum().backward()
    out = model(x)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.1)
    out.sum().backward()
    return [p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters()]


def test_ranks_agree_on_dropping_changed_secondaries(ranks):
    """Each rank dropped its secondary shards alone when its own counters moved: on this model some
    ranks gathered a unit over all 4 ranks while their hpZ partners gathered it over 2 (a hang)."""
    assert all(all(ok) for ok in ranks.run(4, _update_skipping_empty_slices, timeout=60))
