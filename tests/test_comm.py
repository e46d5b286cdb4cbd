"""Exact communication volume per training step, checked with ``zs.comm_stats``.

Notation (fp32, so 4 bytes per element; N ranks; ring accounting, per rank):
  Ψ       = Σ over units of ``padded_numel`` (the flat buffers all-gathered and
            reduce-scattered are padded to a multiple of N)
  Ψ_root  = the root unit's ``padded_numel``
  ring(x) = x·4·(N−1)/N bytes: what one rank sends in an all-gather or
            reduce-scatter of an x-element buffer (all-reduce: 2·ring(x))

ZeRO-3 (FULL_SHARD) per step: forward all-gathers Ψ, backward all-gathers Ψ
again and reduce-scatters Ψ: the paper's 3Ψ, i.e. 1.5x DDP's all-reduce (2Ψ).
Like torch FSDP1, the root unit is not freed after forward (its backward runs
first, right after the loss), so its second all-gather is skipped and the
measured total is 3Ψ − Ψ_root. The tests assert exact call counts and bytes,
so an extra (or missing) all-gather of any unit fails them.
"""
from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from models import MLP, Block

ELEM = 4  # fp32
N_BLOCKS = 3
# Sizes picked so every unit needs tail padding on 2 and on 3 ranks:
# a Block holds 7·12+12+12·7+7 = 187 elements, the root (inp + out) 42+32 = 74.
MLP_KW = dict(d_in=5, d=7, hidden=12, n_blocks=N_BLOCKS, d_out=4)


def ring(numel: int, world_size: int) -> float:
    return numel * ELEM * (world_size - 1) / world_size


def _model(strategy, **kw):
    torch.manual_seed(0)
    return zs.FSDP(MLP(**MLP_KW), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), sharding_strategy=strategy, **kw)


def _sizes(model):
    """(#units, Ψ padded, Ψ_root padded, Ψ unpadded) of a wrapped model."""
    units = [m for m in model.modules() if isinstance(m, zs.FSDP)]
    layouts = [u._handle.layout for u in units]
    return len(units), sum(lay.padded_numel for lay in layouts), layouts[0].padded_numel, sum(lay.numel for lay in layouts)


def _snapshot(stats):
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    return {k: (stats.calls.get(k, 0), stats.bytes.get(k, 0.0)) for k in kinds}


def _volume_per_phase(rank, world_size, strategy_name, steps, kw):
    """Per step: the collectives of forward and of backward, separately.

    The optimizer step sits inside the step's window too: it must add nothing."""
    model = _model(zs.ShardingStrategy[strategy_name], **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        x = torch.randn(4, MLP_KW["d_in"], generator=torch.Generator().manual_seed(10 * step + rank))
        # Consecutive windows per phase; "whole" is their sum (nesting: test_nested_comm_stats).
        with zs.comm_stats() as fwd:
            loss = model(x).square().mean()
        with zs.comm_stats() as bwd:
            loss.backward()
        with zs.comm_stats() as optim:
            opt.step()
            opt.zero_grad()
        phases = [_snapshot(s) for s in (fwd, bwd, optim)]
        whole = {k: tuple(map(sum, zip(*(p[k] for p in phases)))) for k in phases[0]}
        out.append(dict(fwd=phases[0], bwd=phases[1], optim=phases[2], whole=whole))
    return _sizes(model), out


def expected(strategy: str, world_size: int, units: int, psi: int, psi_root: int, psi_unpadded: int):
    """Expected (calls, bytes) per collective for forward and backward of one step."""
    r = lambda n: ring(n, world_size)  # noqa: E731
    none = (0, 0.0)
    if strategy == "FULL_SHARD":
        # Forward gathers every unit; backward re-gathers all but the root.
        fwd = dict(all_gather=(units, r(psi)), reduce_scatter=none, all_reduce=none)
        bwd = dict(all_gather=(units - 1, r(psi - psi_root)), reduce_scatter=(units, r(psi)), all_reduce=none)
    elif strategy == "SHARD_GRAD_OP":
        # ZeRO-2 keeps the parameters from forward to backward: Ψ + Ψ = 2Ψ.
        fwd = dict(all_gather=(units, r(psi)), reduce_scatter=none, all_reduce=none)
        bwd = dict(all_gather=none, reduce_scatter=(units, r(psi)), all_reduce=none)
    else:  # NO_SHARD: plain data parallel, one all-reduce of the unpadded flat gradient per unit.
        fwd = dict(all_gather=none, reduce_scatter=none, all_reduce=none)
        bwd = dict(all_gather=none, reduce_scatter=none, all_reduce=(units, 2 * r(psi_unpadded)))
    return fwd, bwd


def assert_volume(measured: dict, want: dict, what: str):
    for kind, (calls, nbytes) in want.items():
        got_calls, got_bytes = measured[kind]
        assert got_calls == calls, f"{what}: {kind} calls {got_calls}, expected {calls}"
        assert got_bytes == pytest.approx(nbytes, rel=1e-12, abs=0), f"{what}: {kind} bytes {got_bytes}, expected {nbytes}"


def check_steps(strategy: str, world_size: int, sizes, steps):
    fwd, bwd = expected(strategy, world_size, *sizes)
    for i, s in enumerate(steps):
        assert_volume(s["fwd"], fwd, f"step {i} forward")
        assert_volume(s["bwd"], bwd, f"step {i} backward")
        assert_volume(s["optim"], expected("NONE", world_size, 0, 0, 0, 0)[0], f"step {i} optimizer")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_volume_per_step(ranks, world_size, strategy):
    results = ranks.run(world_size, _volume_per_phase, strategy, 2, {})
    sizes = results[0][0]
    units, psi, psi_root, psi_unpadded = sizes
    assert units == N_BLOCKS + 1
    assert psi > psi_unpadded, "the test model is meant to need padding"
    for rank_sizes, steps in results:  # every rank sends the same volume
        assert rank_sizes == sizes
        check_steps(strategy, world_size, sizes, steps)


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_shard_total_is_zero3_minus_root(ranks, world_size):
    """Forward + backward = 3Ψ(N−1)/N·4 − Ψ_root(N−1)/N·4 bytes: ZeRO-3's 3Ψ
    (gather for forward, gather for backward, reduce-scatter of gradients)
    less the root's backward all-gather, which is skipped because the root
    stays unsharded from its forward to its backward."""
    (units, psi, psi_root, _), steps = ranks.run(world_size, _volume_per_phase, "FULL_SHARD", 1, {})[0]
    whole = steps[0]["whole"]
    ag_calls, ag_bytes = whole["all_gather"]
    rs_calls, rs_bytes = whole["reduce_scatter"]
    assert (ag_calls, rs_calls) == (2 * units - 1, units)
    assert ag_bytes == pytest.approx((2 * psi - psi_root) * ELEM * (world_size - 1) / world_size, rel=1e-12, abs=0)
    assert rs_bytes == pytest.approx(psi * ELEM * (world_size - 1) / world_size, rel=1e-12, abs=0)
    zero3 = 3 * psi * (world_size - 1) / world_size * ELEM
    root_saving = psi_root * (world_size - 1) / world_size * ELEM
    assert ag_bytes + rs_bytes == pytest.approx(zero3 - root_saving, rel=1e-12, abs=0)
    assert whole["all_reduce"] == (0, 0.0)


PREFETCH = {
    "pre+fwd": dict(backward_prefetch=zs.BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True),
    "post+fwd": dict(backward_prefetch=zs.BackwardPrefetch.BACKWARD_POST, forward_prefetch=True),
    "none": dict(backward_prefetch=None, forward_prefetch=False),
    "pre+fwd unlimited": dict(backward_prefetch=zs.BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True, limit_all_gathers=False),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("prefetch", list(PREFETCH))
def test_prefetch_changes_timing_not_volume(ranks, world_size, strategy, prefetch):
    """Forward prefetch starts with the second step (it needs the first step's
    order); every step, prefetched or not, moves exactly the same bytes."""
    results = ranks.run(world_size, _volume_per_phase, strategy, 3, PREFETCH[prefetch])
    for sizes, steps in results:
        check_steps(strategy, world_size, sizes, steps)
        assert steps[1]["whole"] == steps[0]["whole"] == steps[2]["whole"]


def _with_extra_gather(rank, world_size):
    """One FULL_SHARD step plus one redundant all-gather of a block's shard."""
    from zeroshard import comm

    model = _model(zs.ShardingStrategy.FULL_SHARD)
    block = next(m for m in model.modules() if isinstance(m, zs.FSDP) and isinstance(m.module, Block))
    h = block._handle
    with zs.comm_stats() as fwd:
        loss = model(torch.randn(4, MLP_KW["d_in"])).sum()
        comm.all_gather(torch.empty(h.layout.padded_numel), h.local_shard, h.group, async_op=False)
    with zs.comm_stats() as bwd:
        loss.backward()
    return _sizes(model), [dict(fwd=_snapshot(fwd), bwd=_snapshot(bwd), optim=_snapshot(zs.comm.CommStats()))]


def test_checks_catch_an_extra_all_gather(ranks):
    """The assertions above are tight: one extra unit all-gather fails them."""
    sizes, steps = ranks.run(2, _with_extra_gather)[0]
    with pytest.raises(AssertionError, match="all_gather calls"):
        check_steps("FULL_SHARD", 2, sizes, steps)


def _nested_windows(rank, world_size):
    model = _model(zs.ShardingStrategy.FULL_SHARD)
    with zs.comm_stats() as step:
        with zs.comm_stats() as fwd:
            loss = model(torch.randn(4, MLP_KW["d_in"])).sum()
        loss.backward()
    return _sizes(model)[0], fwd.calls["all_gather"], step.calls["all_gather"]


def test_nested_comm_stats(ranks):
    """A step-wide window around a forward-only window: both count (a finished
    window is removed by identity, not by equal counts)."""
    units, fwd_gathers, step_gathers = ranks.run(2, _nested_windows)[0]
    assert (fwd_gathers, step_gathers) == (units, 2 * units - 1)


def _named_wraps_only_collective_failures(rank, world_size):
    import torch.distributed as dist

    from zeroshard import comm

    try:
        with comm.named("torch.distributed.checkpoint.load", "load_sharded('x')"):
            raise RuntimeError("Size mismatch for weight: copying a param of shape [3] into [4]")
    except RuntimeError as e:
        plain = type(e) is RuntimeError and "Size mismatch" in str(e)
    try:
        with comm.named("torch.distributed.checkpoint.load", "load_sharded('x')"):
            # "size mismatch" text, but raised by a collective: named (DETAIL's reports have no gloo words)
            dist.broadcast(torch.zeros(1), src=3)
    except comm.CollectiveError as e:
        named = "rank 0: torch.distributed.checkpoint.load for load_sharded('x') failed" in str(e)
    return plain and named


def test_a_non_collective_error_inside_torchs_collective_code_is_not_renamed(ranks):
    """comm.named names the rank and the call of a collective torch issues (DCP, ShardedTensor);
    another RuntimeError from inside (a load's size mismatch) used to be renamed a CollectiveError
    with a hint about dead or diverged ranks."""
    assert ranks.run(1, _named_wraps_only_collective_failures) == [True]
