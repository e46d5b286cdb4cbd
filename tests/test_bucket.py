"""Small units: ``bucket_cap_mb`` (one reduce-scatter for many units'
gradients) and ``param_persistence_threshold`` (small units never sharded,
their gradients all-reduced).

Numerics. Bucketing moves each gradient element to another position in the
collective's buffer but sums the same N per-rank values; persistence replaces
a reduce-scatter of an element by an all-reduce of it (again a sum of the same
N values) and the optimizer steps the whole unit instead of a shard
(elementwise: the same updates). On 2 ranks every such sum is a + b, which is
exact whatever order an algorithm uses, so training is asserted bit-identical
to torch FSDP1. On 3 ranks the order of the 3 addends may differ between the
two layouts; there the gradients are compared with the bound of two orderings
of a sum, 2(N−1)·ε·Σ|g_r| ≤ 2(N−1)·ε·N·max|g_r| per element, doubled for the
rounding of the pre/post divisions (they measured bit-identical with gloo, too).
"""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.nn.functional as F

import zeroshard as zs
from models import MLP, Block, TransformerBlock, batch, build

ELEM = 4
MLP_KW = dict(d_in=5, d=7, hidden=12, n_blocks=8, d_out=4)  # 9 units: 8 blocks of 187 elements, root of 74


def _as_ref(ref_param: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """``ours`` cut to ``ref_param``'s shard: a persistent unit holds the whole
    flat parameter where torch FSDP1 holds this rank's chunk of it."""
    if ref_param.shape == ours.shape:
        return ours
    n, world, rank = ref_param.numel(), dist.get_world_size(), dist.get_rank()
    full = F.pad(ours.detach().reshape(-1), [0, n * world - ours.numel()])
    return full[rank * n : (rank + 1) * n].view(ref_param.shape)


def _policy(lib):
    return lib.ModuleWrapPolicy({Block, TransformerBlock})


def _train_vs_torch(rank, world_size, model, kw, use_orig_params, mp, no_sync=False, steps=3, accum=2):
    """zeroshard with ``kw`` against plain torch FSDP1; torch.equal throughout."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = build(model)
        mp_kw = mp if isinstance(mp, dict) else dict(param_dtype=mp, reduce_dtype=mp)
        t_mp = tfsdp.MixedPrecision(**mp_kw) if mp else None
        z_mp = zs.MixedPrecision(**mp_kw) if mp else None
        ref = tfsdp.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=_policy(tfsdp.wrap),
                                             device_id=torch.device("cpu"), use_orig_params=use_orig_params,
                                             mixed_precision=t_mp)
        ours = zs.FSDP(copy.deepcopy(base), auto_wrap_policy=_policy(zs.wrap), use_orig_params=use_orig_params,
                       mixed_precision=z_mp, **kw)
    low_grads = isinstance(mp, dict) and mp.get("keep_low_precision_grads")  # bf16 grads: AdamW's lerp_ refuses them
    opt_ref, opt_ours = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) if low_grads
                         else torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours))
    calls = []
    for step in range(steps):
        with zs.comm_stats() as stats:
            for micro in range(accum):  # accumulation: the second reduction adds into the first one's shard
                x = batch(model, rank, step * accum + micro)
                local = no_sync and micro < accum - 1
                with ref.no_sync() if local else contextlib.nullcontext():
                    out_ref = ref(x)
                    out_ref.float().pow(2).mean().backward()
                with ours.no_sync() if local else contextlib.nullcontext():
                    out = ours(x)
                    out.float().pow(2).mean().backward()
                assert torch.equal(out_ref, out), f"step {step}: outputs differ"
        calls.append(dict(stats.calls))
        for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
            if a.grad is None:
                assert b.grad is None, n
                continue
            assert torch.equal(a.grad, _as_ref(a, b.grad)), f"step {step}: grad of {n} differs"
        opt_ref.step()
        opt_ours.step()
        opt_ref.zero_grad()
        opt_ours.zero_grad()
        for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
            assert torch.equal(a, _as_ref(a, b)), f"step {step}: parameter {n} differs after the step"
    persistent = [h.unit_name for h in ours._runtime.handles if not h.sharded]
    return calls, persistent


@pytest.mark.parametrize("model,kw,use_orig_params,mp,no_sync", [
    ("mlp", dict(bucket_cap_mb=25), False, None, False),
    # use_orig_params=False where a unit persists: torch FSDP1's per-parameter
    # shard views have no counterpart to cut a whole parameter to (the 3-rank
    # test below covers persistence with use_orig_params=True).
    ("mlp", dict(bucket_cap_mb=25, param_persistence_threshold=100), False, None, False),
    ("mlp", dict(bucket_cap_mb=25, param_persistence_threshold=100), False, None, True),
    ("gpt", dict(bucket_cap_mb=0.06), True, None, False),  # 60 KiB: two blocks' gradients (~29 KB each) per bucket
    ("gpt", dict(bucket_cap_mb=25, param_persistence_threshold=2000), False, torch.bfloat16, False),
    # the persistent root handed the optimizer fp32 gradients (NO_SHARD's rule) where torch's
    # FULL_SHARD casts them to bf16 after accumulating in fp32
    ("mlp", dict(param_persistence_threshold=100), False,
     dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=True), True),
    # the persistent root added its earlier micro-batch's fp32 gradient into the fp16 reduced one
    # (rounded to fp16) where torch's FULL_SHARD adds in fp32
    ("mlp", dict(param_persistence_threshold=100), False,
     dict(reduce_dtype=torch.float16, keep_low_precision_grads=True), False),
])
def test_bit_identical_to_torch_on_two_ranks(ranks, model, kw, use_orig_params, mp, no_sync):
    results = ranks.run(2, _train_vs_torch, model, kw, use_orig_params, mp, no_sync)
    calls, persistent = results[0]
    reductions = 1 if no_sync else 2  # per step: one per synchronized micro-batch
    if "param_persistence_threshold" in kw:
        assert persistent == ["<root> (%s)" % ("MLP" if model == "mlp" else "TinyGPT")], persistent
        assert all(c["all_reduce"] == reductions for c in calls)  # the persistent root
    else:
        assert persistent == []
    units = 4
    per_micro = [c.get("reduce_scatter", 0) / reductions for c in calls]
    if "bucket_cap_mb" not in kw:  # a reduce-scatter per sharded unit
        assert per_micro == [units - 1] * len(calls), calls
    elif kw["bucket_cap_mb"] == 25:  # every sharded unit in one bucket
        assert per_micro == [1] * len(calls), calls
    else:
        assert all(1 < n < units for n in per_micro), calls


# ------------------------------------------------------------ calls per step
def _accumulated_grads(rank, world_size, use_orig_params, kw, input_grad_pass, no_sync=False):
    torch.manual_seed(0)
    m = zs.FSDP(MLP(), auto_wrap_policy=_policy(zs.wrap), use_orig_params=use_orig_params, **kw)
    for micro in range(3):  # accumulation: each reduction adds to the ones before (no_sync: the second is local)
        x = batch("mlp", rank, micro).requires_grad_(True)
        if input_grad_pass:  # a saliency map: a backward that reaches no parameter
            torch.autograd.grad(m(x).sum(), x)
        with m.no_sync() if no_sync and micro == 1 else contextlib.nullcontext():
            m(x).pow(2).mean().backward()
    return [p.grad for p in m.parameters()], [h.persistent for h in m._runtime.handles]


@pytest.mark.parametrize("use_orig_params,no_sync", [(False, False), (True, False), (False, True), (True, True)])
def test_an_input_gradient_pass_between_micro_batches_changes_no_gradient(ranks, use_orig_params, no_sync):
    """A persistent unit's gradient set aside by that pass came back without its 'reduced' mark:
    the next backward added into it and reduced the sum again (3e-8 off in fp32; with a bf16
    reduce_dtype rounded again every micro-batch). After a no_sync micro-batch the pass put the
    set-aside reduced gradient back over the local one: that micro-batch was lost (0.63 off),
    sharded units too. torch FSDP1 with use_orig_params=False drops the earlier micro-batches'
    gradients there (not matched)."""
    kw = dict(param_persistence_threshold=100)
    plain = ranks.run(2, _accumulated_grads, use_orig_params, kw, False, no_sync)
    for (grads, persistent), (want, _) in zip(ranks.run(2, _accumulated_grads, use_orig_params, kw, True, no_sync), plain):
        assert any(persistent) and not all(persistent)
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(grads, want))  # (None: no elements on this rank)


def _calls_per_step(rank, world_size, kw):
    torch.manual_seed(0)
    model = zs.FSDP(MLP(**MLP_KW), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for step in range(2):
        x = torch.randn(4, MLP_KW["d_in"], generator=torch.Generator().manual_seed(step + 10 * rank))
        with zs.comm_stats() as s:
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        steps.append({k: (s.calls.get(k, 0), s.bytes.get(k, 0.0)) for k in ("all_gather", "reduce_scatter", "all_reduce")})
    handles = model._runtime.handles
    sizes = [(h.layout.numel, h.layout.padded_numel, h.sharded, h.local_shard.numel()) for h in handles]
    return steps, sizes


def ring(numel, world_size):
    return numel * ELEM * (world_size - 1) / world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_calls_per_step(ranks, world_size):
    """9 units (8 blocks + root). Per step, unbucketed: 17 all-gathers, 9
    reduce-scatters. bucket_cap_mb=25: 1 reduce-scatter of the same bytes.
    A cap of two blocks' gradients: buckets close in backward order
    [b7 b6] [b5 b4] [b3 b2] [b1 b0] and the root's flushes alone: 5.
    param_persistence_threshold=74 (the root's size): the root is neither
    gathered nor reduce-scattered but all-reduced: 16 all-gathers, 8 + 1."""
    base_steps, sizes = ranks.run(world_size, _calls_per_step, {})[0]
    (root_numel, root_padded, _, _), (_, block_padded, _, _) = sizes[0], sizes[1]
    psi = sum(p for _, p, _, _ in sizes)
    block_grad_bytes = block_padded * ELEM
    cap_two = 2 * block_grad_bytes / 2**20
    cases = {
        "none": ({}, 17, 9, 0),
        "bucket 25": (dict(bucket_cap_mb=25), 17, 1, 0),
        "bucket 2 blocks": (dict(bucket_cap_mb=cap_two), 17, 5, 0),
        "persist root": (dict(param_persistence_threshold=root_numel), 16, 8, 1),
        "persist root + bucket 25": (dict(param_persistence_threshold=root_numel, bucket_cap_mb=25), 16, 1, 1),
    }
    for name, (kw, ag, rs, ar) in cases.items():
        steps, sizes = (base_steps, sizes) if not kw else ranks.run(world_size, _calls_per_step, kw)[0]
        persistent = "param_persistence_threshold" in kw
        for s in steps:
            assert (s["all_gather"][0], s["reduce_scatter"][0], s["all_reduce"][0]) == (ag, rs, ar), (name, s)
            # Bucketing changes calls, never bytes; persistence trades the root's
            # gather + reduce-scatter for one all-reduce of its unpadded numel.
            gathered = 2 * psi - root_padded - (root_padded if persistent else 0)
            assert s["all_gather"][1] == pytest.approx(ring(gathered, world_size), rel=1e-12, abs=0), name
            reduced = psi - (root_padded if persistent else 0)
            assert s["reduce_scatter"][1] == pytest.approx(ring(reduced, world_size), rel=1e-12, abs=0), name
            assert s["all_reduce"][1] == pytest.approx(2 * ring(root_numel, world_size) if persistent else 0, abs=0)
        if persistent:  # the root is held whole on every rank; the blocks stay sharded
            assert sizes[0][2] is False and sizes[0][3] == root_numel
            assert all(sh and n == p // world_size for _, p, sh, n in sizes[1:])


# ---------------------------------------------------- 3 ranks: stated bound
def _bucketed_vs_unbucketed(rank, world_size):
    torch.manual_seed(0)
    base = build("gpt")
    x = batch("gpt", rank, 0)
    plain = copy.deepcopy(base)
    plain(x).float().pow(2).mean().backward()
    g_max = torch.stack([p.grad.abs().max() for p in plain.parameters() if p.grad is not None]).max()
    dist.all_reduce(g_max, op=dist.ReduceOp.MAX)  # max over ranks and elements of |g_r|
    grads = []
    for kw in ({}, dict(bucket_cap_mb=25, param_persistence_threshold=2000)):
        model = zs.FSDP(copy.deepcopy(base), auto_wrap_policy=_policy(zs.wrap), use_orig_params=True, **kw)
        model(x).float().pow(2).mean().backward()
        with zs.FSDP.summon_full_params(model, with_grads=True):
            grads.append([p.grad.clone() for p in model.parameters()])
    eps, n = torch.finfo(torch.float32).eps, world_size
    bound = 2 * (2 * (n - 1) * eps * n * g_max.item())
    exact = True
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=bound)
        exact &= torch.equal(a, b)
    return bound, exact


def test_three_ranks_within_summation_bound(ranks):
    for bound, _exact in ranks.run(3, _bucketed_vs_unbucketed):
        assert 0 < bound < 1e-4


# --------------------------------------------------- hybrid sharding (HSDP)
def _hybrid(rank, world_size, kw):
    """2 × 2 ranks (fsdp_group_size=2): a bucket is reduce-scattered in its
    shard group, then its shards all-reduced once across replicas."""
    base = build("gpt")

    def make(**extra):
        return zs.FSDP(copy.deepcopy(base), auto_wrap_policy=_policy(zs.wrap), fsdp_group_size=2,
                       use_orig_params=True, **extra)

    plain, ours = make(), make(**kw)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, ours)]
    calls = []
    for step in range(2):
        x = batch("gpt", rank, step)
        plain(x).pow(2).mean().backward()
        with zs.comm_stats() as s:
            ours(x).pow(2).mean().backward()
        calls.append((s.calls["reduce_scatter"], s.calls["all_reduce"]))
        with zs.FSDP.summon_full_params(plain, with_grads=True), zs.FSDP.summon_full_params(ours, with_grads=True):
            for (n, a), (_, b) in zip(plain.named_parameters(), ours.named_parameters()):
                assert torch.equal(a, b) and torch.equal(a.grad, b.grad), f"step {step}: {n}"
        for o in opts:
            o.step()
            o.zero_grad()
    return calls


def test_hybrid_sharding(ranks):
    """Each element is (a + b) + (c + d) either way: within the shard group,
    then across replicas; asserted bit-identical on 4 ranks. Per backward:
    1 bucketed reduce-scatter + 1 replica all-reduce for the 3 blocks, and 2
    all-reduces (shard group, replicas) for the persistent root."""
    for calls in ranks.run(4, _hybrid, dict(bucket_cap_mb=25, param_persistence_threshold=2000)):
        assert calls == [(1, 3)] * 2


def _persistent_unit_without_gradient(rank, world_size, use_orig_params):
    class TwoPaths(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.big, self.small = torch.nn.Linear(16, 16), torch.nn.Linear(2, 2)  # small: persistent

        def forward(self, x):
            return self.big(x)  # small gets no gradient this step

    torch.manual_seed(0)
    mp = zs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=True)
    model = zs.FSDP(TwoPaths(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({torch.nn.Linear}),
                    param_persistence_threshold=100, mixed_precision=mp, use_orig_params=use_orig_params)
    model(torch.randn(4, 16)).float().sum().backward()
    return [(h.persistent, h.flat_param.grad is None) for h in model._runtime.handles if h.persistent]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_persistent_unit_without_gradient_under_keep_low_precision_grads(ranks, use_orig_params):
    """The cast of a persistent unit's gradient to the parameter dtype read .grad.dtype on None."""
    for persistent in ranks.run(2, _persistent_unit_without_gradient, use_orig_params):
        assert (True, True) in persistent, persistent


def _bucketed_low_precision_grads_are_their_own(rank, world_size):
    torch.manual_seed(0)
    m = zs.FSDP(MLP(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), bucket_cap_mb=25,
                mixed_precision=zs.MixedPrecision(reduce_dtype=torch.bfloat16))
    m(torch.randn(4, 5)).sum().backward()
    return [(p.grad.dtype, p.grad._base is None) for p in m.parameters()]


def test_bucketed_low_precision_gradients_do_not_hold_the_bucket(ranks):
    """Cast back to fp32 in place, each unit's gradient stayed a view of the whole bf16 bucket
    output, keeping it alive until zero_grad (the diff review's finding)."""
    for grads in ranks.run(2, _bucketed_low_precision_grads_are_their_own):
        assert grads and all(g == (torch.float32, True) for g in grads), grads



def _local_load_across_persistence(rank, world_size):
    def make(threshold):
        torch.manual_seed(0)
        return zs.FSDP(MLP(), auto_wrap_policy=_policy(zs.wrap), use_orig_params=True, param_persistence_threshold=threshold)

    saved = make(100)
    with zs.FSDP.state_dict_type(saved, zs.StateDictType.LOCAL_STATE_DICT):
        sd = saved.state_dict()
    other = make(None)
    try:
        with zs.FSDP.state_dict_type(other, zs.StateDictType.LOCAL_STATE_DICT):
            other.load_state_dict(sd)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def test_a_local_dict_from_other_persistence_names_it(ranks):
    """Same world size, another param_persistence_threshold: the error said to load 'at this world
    size' only, which it was."""
    for msg in ranks.run(2, _local_load_across_persistence):
        assert msg and "param_persistence_threshold" in msg, msg
