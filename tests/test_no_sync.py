"""``no_sync()`` as torch documents it, for every sharding strategy.

torch's FSDP.no_sync docstring: inside the context gradients are accumulated
locally, unsharded (``higher memory usage because FSDP will accumulate the full
model gradients (instead of gradient shards)``), and synchronized in the first
backward after it. So a micro-step under no_sync must issue no reduce-scatter
and no all-reduce for any strategy; it still all-gathers what the strategy
needs for compute (FULL_SHARD: forward and backward, minus the root kept
between them; NO_SHARD: nothing). SHARD_GRAD_OP follows torch's heuristic
(``_should_free_in_backward``): while gradients are not synchronized it does not
reshard after backward, trading memory for speed, so only the first micro-step
all-gathers and the later ones, the synchronizing one included, reuse the
unsharded parameters. The gradients it
leaves behind — unsharded, per parameter — must equal torch FSDP1's exactly,
and so must the sharded gradients after the synchronizing step.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

import zeroshard as zs
from models import MLP, Block

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
MLP_KW = dict(d_in=5, d=7, hidden=12, n_blocks=3, d_out=4)


def _build(engine, strategy, use_orig_params):
    torch.manual_seed(0)
    model = MLP(**MLP_KW)
    if engine == "torch":
        return tfsdp.FullyShardedDataParallel(
            model, auto_wrap_policy=TorchModuleWrapPolicy({Block}), use_orig_params=use_orig_params,
            sharding_strategy=tfsdp.ShardingStrategy[strategy], device_id=torch.device("cpu"))
    return zs.FSDP(model, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params,
                   sharding_strategy=zs.ShardingStrategy[strategy])


def _grads(model, use_orig_params):
    """What a user sees: each parameter's .grad (flat parameters' when not use_orig_params)."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _micro_steps(rank, world_size, strategy, use_orig_params):
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, MLP_KW["d_in"], generator=g) for _ in range(3)]
    seen = {}
    for engine in ("zeroshard", "torch"):
        model = _build(engine, strategy, use_orig_params)
        stats, grads = [], []
        for i, x in enumerate(xs):
            last = i == len(xs) - 1
            with zs.comm_stats() as s:
                if last:
                    model(x).pow(2).sum().backward()
                else:
                    with model.no_sync():
                        model(x).pow(2).sum().backward()
            stats.append({k: s.calls.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")})
            grads.append(_grads(model, use_orig_params))
        n_units = sum(isinstance(m, zs.FSDP) for m in model.modules()) if engine == "zeroshard" else None
        seen[engine] = (stats, grads, n_units)
    return seen


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_no_sync_communicates_nothing_and_matches_torch(ranks, strategy, use_orig_params):
    for seen in ranks.run(2, _micro_steps, strategy, use_orig_params):
        stats, grads, n_units = seen["zeroshard"]
        gathers = {"FULL_SHARD": [2 * n_units - 1] * 3, "SHARD_GRAD_OP": [n_units, 0, 0], "NO_SHARD": [0] * 3}[strategy]
        for micro, expected in zip(stats[:-1], gathers):  # under no_sync
            assert micro == {"all_gather": expected, "reduce_scatter": 0, "all_reduce": 0}, micro
        synced = stats[-1]
        assert synced["all_gather"] == gathers[-1]
        if strategy == "NO_SHARD":
            assert synced["all_reduce"] == n_units and synced["reduce_scatter"] == 0
        else:
            assert synced["reduce_scatter"] == n_units and synced["all_reduce"] == 0
        _, ref_grads, _ = seen["torch"]
        for step, (ours, ref) in enumerate(zip(grads, ref_grads)):
            assert ours.keys() == ref.keys()
            for name in ours:
                a, b = ours[name], ref[name]
                assert (a is None) == (b is None), (step, name)
                if a is not None:
                    assert a.shape == b.shape and torch.equal(a, b), (
                        f"micro-step {step}, {name}: shape {tuple(a.shape)} vs torch {tuple(b.shape)}")


def _step_inside_no_sync(rank, world_size, strategy, use_orig_params):
    model = _build("zeroshard", strategy, use_orig_params)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, MLP_KW["d_in"], generator=torch.Generator().manual_seed(rank))
    with model.no_sync():
        model(x).pow(2).sum().backward()
    try:
        opt.step()  # forgot the synchronizing micro-batch
        refused = None
    except RuntimeError as e:
        refused = str(e)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()  # discards the accumulated gradient: stepping is fine again
    opt.step()
    untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with model.no_sync():
        model(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()  # the synchronizing backward
    opt.step()
    return refused, untouched


@pytest.mark.parametrize("strategy, use_orig_params", [("FULL_SHARD", False), ("FULL_SHARD", True), ("SHARD_GRAD_OP", False),
                                                      ("NO_SHARD", True)])
def test_step_on_an_unreduced_no_sync_gradient_names_the_fix(ranks, strategy, use_orig_params):
    """torch FSDP1 fails there with a bare size mismatch inside the optimizer
    ('The size of tensor a (33) must match the size of tensor b (66)'); under
    NO_SHARD it steps each rank on its own gradient, and the replicas diverge."""
    for refused, untouched in ranks.run(2, _step_inside_no_sync, strategy, use_orig_params):
        assert refused is not None and refused.startswith("zeroshard: SGD.step() on unit "), refused
        assert "accumulated inside no_sync() and not yet reduced across ranks" in refused, refused
        assert "Fix: run the last micro-batch's forward and backward outside no_sync()" in refused, refused
        assert untouched


class Skipping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks = torch.nn.Linear(5, 7), torch.nn.ModuleList(Block(7, 13) for _ in range(3))

    def forward(self, x, skip=None):
        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            x = x if i == skip else b(x)
        return x


def _unit_skipped_by_the_synchronizing_backward(rank, world_size, strategy, use_orig_params):
    torch.manual_seed(0)
    model = zs.FSDP(Skipping(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params,
                    sharding_strategy=zs.ShardingStrategy[strategy])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    with model.no_sync():
        model(x).pow(2).sum().backward()  # every block accumulates locally
    model(x, skip=1).pow(2).sum().backward()  # synchronizing, but blocks.1 does not run
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"unit 'blocks.1 \(Block\)'.*not yet reduced.*a unit it skips"):
        opt.step()
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("strategy, use_orig_params", [("FULL_SHARD", True), ("FULL_SHARD", False), ("NO_SHARD", False)])
def test_a_unit_the_synchronizing_backward_skips_is_refused_at_step(ranks, strategy, use_orig_params):
    """With use_orig_params its parameters got slices of the unreduced full-size
    gradient cut at shard offsets, the right shapes, and the step applied them
    silently (torch FSDP1 asserts); under NO_SHARD each rank stepped on its own
    gradient (torch FSDP1 too)."""
    assert all(ranks.run(2, _unit_skipped_by_the_synchronizing_backward, strategy, use_orig_params))


def _summon_between_micro_steps(rank, world_size, strategy):
    x = torch.randn(4, MLP_KW["d_in"], generator=torch.Generator().manual_seed(rank))
    seen = {}
    for engine in ("zeroshard", "torch"):
        model = _build(engine, strategy, use_orig_params=True)
        with model.no_sync():
            model(x).pow(2).sum().backward()
        accumulated = _grads(model, True)
        with type(model).summon_full_params(model):  # e.g. a full state dict between micro-steps
            pass
        after_summon = _grads(model, True)
        refusal = None
        if engine == "zeroshard":  # torch asserts "Expects tensor to be sharded" here, leaving its state undefined
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
            with pytest.raises(RuntimeError, match=r"summon_full_params\(with_grads=True\) on unit '<root> \(MLP\)'") as e:
                with zs.FSDP.summon_full_params(model, with_grads=True):
                    pass
            refusal = str(e.value)
            assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes  # left as it was
            assert all(torch.equal(a, b) for a, b in zip(_grads(model, True).values(), accumulated.values()))
        model(x).pow(2).sum().backward()  # the synchronizing micro-step
        seen[engine] = (accumulated, after_summon, _grads(model, True), refusal)
    return seen


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_summon_between_no_sync_micro_steps_keeps_the_accumulated_grads(ranks, strategy):
    """Leaving summon_full_params re-pointed the original parameters' .grad at
    shard-offset slices of the unreduced full-size gradient: flat, wrong
    stretches, until the next forward. torch FSDP1 leaves them as the no_sync
    backward made them; so does zeroshard now. with_grads=True there has no
    shard to gather: torch asserts, zeroshard refuses on every rank before
    touching the unit."""
    for seen in ranks.run(2, _summon_between_micro_steps, strategy):
        for i, what in enumerate(("after the no_sync backward", "after summon_full_params", "after the synchronizing backward")):
            ours, ref = seen["zeroshard"][i], seen["torch"][i]
            assert ours.keys() == ref.keys()
            for name in ours:
                a, b = ours[name], ref[name]
                assert (a is None) == (b is None), (what, name)
                if a is not None:
                    assert a.shape == b.shape and torch.equal(a, b), f"{what}, {name}: {tuple(a.shape)} vs torch {tuple(b.shape)}"
        assert "Fix: run a synchronizing backward" in seen["zeroshard"][3]


def _a_rank_with_nothing_to_learn(rank, world_size, strategy, use_orig_params, skip, edit=False):
    g = torch.Generator().manual_seed(rank)
    xs = [[torch.randn(4, MLP_KW["d_in"], generator=g) for _ in range(2)] for _ in range(3)]
    seen = {}
    for engine in ("zeroshard", "torch"):
        model = _build(engine, strategy, use_orig_params)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outs = []
        for step in xs:
            with model.no_sync():
                out = model(step[0])
                if rank == 1:  # e.g. every token masked in this micro-batch
                    if not skip:
                        torch.zeros((), requires_grad=True).backward()  # a loss that does not reach the model
                else:
                    out.pow(2).mean().backward()
            if edit:  # every rank, between the micro-steps (the kept units' old values are used, as torch)
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for p in model.parameters():
                        p.mul_(0.5)
            out = model(step[1])
            outs.append(out.detach())
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        with tfsdp.FullyShardedDataParallel.summon_full_params(model) if engine == "torch" else \
                zs.FSDP.summon_full_params(model):
            seen[engine] = (outs, [p.detach().clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(seen["zeroshard"][0] + seen["zeroshard"][1],
                                                 seen["torch"][0] + seen["torch"][1]))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_a_rank_whose_no_sync_micro_step_does_not_reach_the_model(ranks, use_orig_params, skip):
    """ZeRO-2 under no_sync: rank 1 has nothing to learn from in its micro-batch (a constant
    loss, or a backward skipped for it). Its forward flag stayed set where rank 0's backward
    cleared it, so only rank 1 ran the next forward's stale-unit all-reduce: gloo aborted the
    process ('Received data size doesn't match'). torch FSDP1 trains on; so does zeroshard,
    with torch's outputs and parameters."""
    assert all(ranks.run(2, _a_rank_with_nothing_to_learn, "SHARD_GRAD_OP", use_orig_params, skip, timeout=90))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_an_edit_after_a_skipped_no_sync_backward_does_not_abort(ranks, use_orig_params):
    """The review of fae6b22: the rank that skipped saw the edit and ran the stale-unit
    all-reduce alone; gloo aborted ('Received data size doesn't match'). With the FlatParameter
    zeroshard trains as torch FSDP1; with use_orig_params an edit of the full views is not
    compared with torch (the ranks see different objects there: the one that skipped its
    backward writes its edit back)."""
    same_as_torch = ranks.run(2, _a_rank_with_nothing_to_learn, "SHARD_GRAD_OP", use_orig_params, True, True, timeout=90)
    assert all(same_as_torch) or use_orig_params


def _manual_update_after_a_no_sync_forward(rank, world_size, strategy, use_orig_params):
    model = _build("zeroshard", strategy, use_orig_params)
    x = torch.randn(4, MLP_KW["d_in"], generator=torch.Generator().manual_seed(rank))
    with model.no_sync():
        model(x)  # a metric with grad mode on: no backward comes
    with torch.no_grad():  # a manual update (no optimizer step): zeros, so the next output must be 0
        for p in model.parameters():
            p.zero_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = float(model(x).abs().max())
    return out, any("changed in place, not by an optimizer step" in str(w.message) for w in caught)


@pytest.mark.parametrize("strategy,use_orig_params", [("FULL_SHARD", False), ("FULL_SHARD", True),
                                                      ("SHARD_GRAD_OP", False), ("SHARD_GRAD_OP", True)])
def test_a_manual_update_after_a_no_sync_forward_is_written_back_or_said(ranks, strategy, use_orig_params):
    """After a forward inside no_sync a rank cannot know whether the others ran its backward,
    so no collective may depend on what it sees (a rank's check alone aborted gloo). An edit
    of the full views a ZeRO-2 unit exposes is written back (computed with); a shard changed
    otherwise leaves the kept unit's old values in use, as in torch FSDP1, and is said."""
    for out, said in ranks.run(2, _manual_update_after_a_no_sync_forward, strategy, use_orig_params):
        if (strategy, use_orig_params) == ("SHARD_GRAD_OP", True):
            assert out == 0.0 and not said
        else:
            assert said


class _Gain(torch.nn.Module):
    """The root's own parameter is one scalar: rank 1's root shard holds only padding."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor([1.5]))
        self.a, self.b = Block(4, 6), Block(4, 6)

    def forward(self, x):
        return self.b(self.a(x)) * self.gain


def _hand_written_sgd_after_a_no_sync_metric(rank, world_size):
    torch.manual_seed(0)
    model = zs.FSDP(_Gain(), use_orig_params=True, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    with model.no_sync():
        model(x).abs().mean()  # a metric with grad mode on
    with torch.no_grad():  # skips parameters without a gradient: rank 1's empty gain slice
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
    return float(model(x).detach().abs().sum())


def test_a_rank_seeing_no_change_after_a_no_sync_forward_does_not_hang(ranks):
    """The review of fae6b22: rank 0 saw its root shard change, rank 1 (padding only) did
    not, and rank 0 alone ran the stale-unit all-reduce: a hang."""
    assert len(ranks.run(2, _hand_written_sgd_after_a_no_sync_metric, timeout=60)) == 2
