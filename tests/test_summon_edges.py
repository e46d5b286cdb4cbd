"""Edges of summon_full_params and ignored modules where zeroshard once
differed from torch FSDP1 (found by a side-by-side review), each checked
against torch on 2 gloo ranks: NO_SHARD changes persist whatever writeback
says; with_grads + writeback writes edited gradients back to the shards;
recurse=False on a plain module holding units does nothing; a parameter an
ignored module shares with a managed one stays out of the FlatParameter.
(`_both` passes torch's own ShardingStrategy enum to zeroshard as well: it is
accepted by name, as are torch's BackwardPrefetch and StateDictType.)"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.nn as nn

import zeroshard as zs
from models import batch, build

ENGINES = ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {}))


def _both(make, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = make()
        return [lib.FullyShardedDataParallel(copy.deepcopy(base), **kw, **extra) for lib, extra in ENGINES]


def _full(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: v.clone() for k, v in model.state_dict().items()}


def _no_shard_edits_persist(rank, world_size, use_orig_params):
    models = _both(lambda: build("mlp"), sharding_strategy=tfsdp.ShardingStrategy.NO_SHARD, use_orig_params=use_orig_params)
    before = _full(models[1])
    for (lib, _), m in zip(ENGINES, models):
        m(batch("mlp", rank, 0))  # after a forward too
        with lib.FullyShardedDataParallel.summon_full_params(m, writeback=False), torch.no_grad():
            for p in m.parameters():
                p.add_(1)
    ref, ours = (_full(m) for m in models)
    assert all(torch.equal(ref[k], ours[k]) for k in ref)
    return all(torch.equal(ours[k], before[k] + 1) for k in before if k != "scale")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_no_shard_summon_changes_persist_without_writeback(ranks, use_orig_params):
    assert ranks.run(2, _no_shard_edits_persist, use_orig_params) == [True, True]


def _grads_written_back(rank, world_size):
    models = _both(lambda: build("mlp"), use_orig_params=True)
    for (lib, _), m in zip(ENGINES, models):
        m(batch("mlp", rank, 0)).sum().backward()
        with lib.FullyShardedDataParallel.summon_full_params(m, with_grads=True):
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.mul_(0).add_(3)
    grads = [[(n, p.grad) for n, p in m.named_parameters()] for m in models]
    for (n, a), (_, b) in zip(*grads):
        assert (a is None) == (b is None), n
        assert a is None or torch.equal(a, b), n
    return all(g is None or bool((g == 3).all()) for _, g in grads[1])


def test_with_grads_writeback_reaches_the_shards(ranks):
    """Gradients edited inside summon_full_params(with_grads=True) are this rank's shard afterwards, as in torch."""
    assert ranks.run(2, _grads_written_back) == [True, True]


def _frozen_shard_with_grads(rank, world_size):
    # Linear(4, 4) with a frozen weight: flat = 16 + 4, so rank 0's shard (10) holds only frozen
    # elements and has no gradient, while rank 1's holds the bias's (a LoRA-like unit).
    def make():
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        lin.weight.requires_grad_(False)
        return lin

    models = _both(make, use_orig_params=True)
    seen = []
    for (lib, _), m in zip(ENGINES, models):
        m(batch("mlp", rank, 0)[:, :4]).pow(2).sum().backward()
        with lib.FullyShardedDataParallel.summon_full_params(m, with_grads=True):
            seen.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
        seen.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
        m(batch("mlp", rank, 1)[:, :4]).sum().backward()  # the unit still trains
        seen.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
    half = len(seen) // 2
    for a, b in zip(seen[:half], seen[half:]):
        assert [x is None for x in a] == [x is None for x in b]
        assert all(x is None or torch.equal(x, y) for x, y in zip(a, b))
    return [x is None for x in seen[half + 1]]


def test_with_grads_on_a_rank_whose_shard_has_no_gradient(ranks):
    """A rank whose shard holds only frozen parameters (no flat gradient) sees the full gradients inside
    summon_full_params(with_grads=True) and has no gradient again after it, as in torch: it used to assign
    a shard-sized gradient to the still-gathered parameter and raise on that rank, leaving the other hung."""
    assert ranks.run(2, _frozen_shard_with_grads) == [[True, True], [True, False]]


def _plain_root_recurse_false(rank, world_size):
    shapes = []
    for lib, extra in ENGINES:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m[0] = lib.FullyShardedDataParallel(m[0], **extra)
        with lib.FullyShardedDataParallel.summon_full_params(m, recurse=False):  # m has no FSDP state: nothing happens
            shapes.append([(n.replace("_fsdp_wrapped_module.", ""), tuple(p.shape)) for n, p in m.named_parameters()])
    assert shapes[0] == shapes[1], shapes
    return shapes[1]


def test_summon_recurse_false_on_a_plain_module_does_nothing(ranks):
    assert ranks.run(2, _plain_root_recurse_false)[0][0] == ("0._flat_param", (10,))  # (16 + 4) / 2, not gathered


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(torch.relu(self.a(x)) + self.b(x))


def _shared_with_ignored(rank, world_size, use_orig_params):
    torch.manual_seed(0)
    base = Shared()
    models = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lib, extra in ENGINES:
            m = copy.deepcopy(base)
            models.append(lib.FullyShardedDataParallel(m, ignored_modules=[m.b], use_orig_params=use_orig_params, **extra))
    names = [[(n, tuple(p.shape)) for n, p in m.named_parameters()] for m in models]
    assert names[0] == names[1], names
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    outs = [m(x) for m in models]
    assert torch.equal(*outs)
    for out in outs:
        out.sum().backward()
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), (n, a.grad, b.grad)
    return names[1]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_parameter_shared_with_an_ignored_module_stays_out(ranks, use_orig_params):
    names = ranks.run(2, _shared_with_ignored, use_orig_params)[0]
    assert ("_fsdp_wrapped_module.a.weight", (4, 4)) in names  # a plain (4, 4) parameter, not flattened


def _nested_summon(rank, world_size):
    model = _both(lambda: build("mlp"))[1]
    for inner in (lambda: zs.FSDP.summon_full_params(model).__enter__(), lambda: model.apply(lambda m: None)):
        with zs.FSDP.summon_full_params(model):
            with pytest.raises(RuntimeError, match="entered again inside summon_full_params"):
                inner()
    out = model(batch("mlp", rank, 0))  # the refused attempts left the unit usable
    out.sum().backward()
    return tuple(next(model.parameters()).shape)


def test_summon_inside_summon_is_refused(ranks):
    """torch refuses it too; zeroshard used to free the outer block's buffer and fail obscurely."""
    assert ranks.run(2, _nested_summon) == [(336,), (336,)]


def _unsupported_combinations(rank, world_size):
    raised = []
    for model, lib in zip(_both(lambda: build("mlp")), (tfsdp, zs)):  # use_orig_params=False
        for kw in (dict(rank0_only=True, writeback=True), dict(with_grads=True)):
            with pytest.raises(NotImplementedError) as info:  # a RuntimeError too
                with lib.FullyShardedDataParallel.summon_full_params(model, **kw):
                    pass
            raised.append(type(info.value).__name__)
        # torch's docs: the target need not be an FSDP module; without units, no settings
        assert lib.FullyShardedDataParallel.get_state_dict_type(nn.Linear(2, 2)) is None
    return raised


def test_unsupported_summon_combinations_and_settings_of_a_plain_module_as_in_torch(ranks):
    assert ranks.run(2, _unsupported_combinations) == [["NotImplementedError"] * 4] * 2



def _freed_parameters_are_refused(rank, world_size, strategy):
    """use_orig_params=False: while a unit is sharded its modules' parameter
    attributes have no memory behind them. torch FSDP1 leaves views of the freed
    buffer there (reading one segfaults on CPU), so zeroshard is compared with
    torch only where torch's values are readable; everywhere else it must raise
    a RuntimeError naming the parameter and the fix, and keep training."""
    from models import Block
    models = _both(lambda: build("mlp"), sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy),
                   auto_wrap_policy=tfsdp.wrap.ModuleWrapPolicy({Block}))
    ref, ours = models
    weight = lambda m: m.module.blocks[0].module.l1.weight  # noqa: E731
    def layout(w):  # what can be asked of torch's freed view without reading memory
        return (w.shape, w.dtype, w.device, w.stride(), w.is_contiguous(), w.requires_grad, w.nbytes, len(w),
                w.is_floating_point(), w.is_cuda, w.is_meta, w.type())
    assert layout(weight(ours)) == layout(weight(ref))
    assert repr(ours).count("Linear") == repr(ref).count("Linear")  # still prints and introspects

    def refused():
        with pytest.raises(RuntimeError, match=r"'l1.weight' of unit 'blocks.0 \(Block\)'.*summon_full_params"):
            weight(ours).sum()

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(2):
        outs = [m(batch("mlp", rank, step)) for m in models]
        if strategy == "FULL_SHARD":
            refused()
        else:  # ZeRO-2 keeps the full parameters until backward: readable, as torch's are
            assert torch.equal(weight(ours), weight(ref))
        for out, opt in zip(outs, opts):
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        refused()
        assert layout(weight(ours)) == layout(weight(ref))
    values = []
    for m in models:
        with m.summon_full_params(m):
            values.append(weight(m).clone())
    assert torch.equal(*values)
    lin = copy.deepcopy(ours.module.blocks[0].module.l1)  # copies a placeholder, not freed memory
    assert lin.weight.shape == weight(ours).shape and lin.weight is not weight(ours)
    # A ParameterDict prints each entry's torch.typename (Tensor.type()); it raised on a placeholder.
    dicts = _both(lambda: nn.Sequential(nn.Linear(4, 4), _WithParamDict()), sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy))
    assert repr(dicts[1].module) == repr(dicts[0].module)
    return True


class _WithParamDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.ParameterDict({"a": nn.Parameter(torch.ones(3, 4)), "b": nn.Parameter(torch.zeros(4))})

    def forward(self, x):
        return x @ self.table["a"].T


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_reading_a_freed_parameter_raises_instead_of_reading_freed_memory(ranks, strategy):
    assert all(ranks.run(2, _freed_parameters_are_refused, strategy))


def _summon_between_forward_and_backward(rank, world_size, strategy):
    """use_orig_params: summon_full_params(writeback=True) between a forward
    and its backward, editing nothing or a parameter in place; the backward
    then runs and gives torch FSDP1's gradients and parameters (zeroshard's
    write-back bumped the version counter the forward's views share, and
    autograd refused: "a view ... has been modified inplace")."""
    from models import Block
    models = _both(lambda: build("mlp"), sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy), use_orig_params=True,
                   auto_wrap_policy=tfsdp.wrap.ModuleWrapPolicy({Block}))
    seen = []
    for m in models:
        got = []
        for step, edit in enumerate((False, True)):
            y = m(batch("mlp", rank, step))
            with m.summon_full_params(m, writeback=True):
                if edit:
                    with torch.no_grad():
                        m.module.inp.weight.mul_(0.5)
            y.pow(2).mean().backward()
            got += [p.grad.clone() for p in m.parameters() if p.grad is not None]
            with m.summon_full_params(m):
                got += [p.detach().clone() for p in m.parameters()]
        seen.append(got)
    return len(seen[0]) == len(seen[1]) and all(torch.equal(a, b) for a, b in zip(*seen))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_summon_with_writeback_between_forward_and_backward(ranks, strategy):
    assert all(ranks.run(2, _summon_between_forward_and_backward, strategy))


def _clip_inside_summon(rank, world_size, with_grads, strategy):
    ref, ours = _both(lambda: build("mlp"), use_orig_params=True, sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy),
                      auto_wrap_policy=tfsdp.wrap.ModuleWrapPolicy({type(build("mlp").blocks[0])}))
    errors = []
    for m in (ref, ours):
        m(batch("mlp", rank, 0)).pow(2).mean().backward()
        before = [p.grad.clone() for p in m.parameters() if p.grad is not None]
        try:
            with type(m).summon_full_params(m, with_grads=with_grads):
                m.clip_grad_norm_(1e-3)
        except (ValueError, RuntimeError) as e:
            errors.append(type(e).__name__)
        assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in m.parameters() if p.grad is not None]))
        total = m.clip_grad_norm_(1e-3)  # after the block: as usual
    assert errors == ["ValueError", "RuntimeError"], errors
    return float(total)


@pytest.mark.parametrize("with_grads,strategy", [(True, "FULL_SHARD"), (False, "FULL_SHARD"), (True, "NO_SHARD")])
def test_clip_grad_norm_inside_summon_is_refused_as_in_torch(ranks, with_grads, strategy):
    """torch FSDP1 refuses it (not IDLE). zeroshard clipped: with with_grads the gradients
    were the full copies, so the norm counted each once per rank (sqrt(2) too large on 2
    ranks: 1.03 for 0.73) and clipped by it. Now refused, naming the fix, grads untouched."""
    assert len(set(ranks.run(2, _clip_inside_summon, with_grads, strategy))) == 1


def _rebind_inside_summon(rank, world_size, strategy, use_orig_params):
    """Replacing a parameter inside summon_full_params(writeback=True), by `.data =` or by a new
    nn.Parameter, was dropped at exit, silently (as in torch FSDP1): it no longer viewed the gathered
    buffer the write-back copies from. Now it is written back, exactly as the same edit made in
    place; the module holds the unit's own parameter again (the optimizer's, with use_orig_params);
    with writeback=False it is discarded; one of another shape raises after every unit resharded."""
    from zeroshard.wrap import ModuleWrapPolicy
    from models import Block

    def make():
        model = zs.FSDP(build("mlp", seed=3), auto_wrap_policy=ModuleWrapPolicy({Block}),
                        sharding_strategy=getattr(zs.ShardingStrategy, strategy), use_orig_params=use_orig_params)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    new_w, new_b = torch.full((13, 7), 0.25), torch.linspace(-1, 1, 7)
    results = {}

    def rebind_in_apply(mod):  # FSDP.apply runs fn inside summon_full_params(writeback=True)
        if mod is model.module.blocks[1]:
            mod.l1.weight.data = new_w.clone()
            mod.l2.bias = nn.Parameter(new_b.clone())

    for how in ("in place", ".data =", "Parameter", "apply", "no writeback"):
        model, opt = make()
        held = list(model.parameters())
        if how == "apply":
            model.apply(rebind_in_apply)
        with zs.FSDP.summon_full_params(model, writeback=how != "no writeback"):
            b = model.module.blocks[1]
            if how == "apply":
                pass
            elif how == "in place":
                with torch.no_grad():
                    b.l1.weight.copy_(new_w)
                    b.l2.bias.copy_(new_b)
            elif how == "Parameter":
                b.l1.weight = nn.Parameter(new_w.clone())
                b.l2.bias = nn.Parameter(new_b.clone())
            else:
                b.l1.weight.data = new_w.clone()
                b.l2.bias.data = new_b.clone()
        assert all(p is q for p, q in zip(model.parameters(), held))  # the optimizer's parameters, still the model's
        for step in range(2):
            model(batch("mlp", rank, step)).sum().backward()
            opt.step()
            opt.zero_grad()
        with zs.FSDP.summon_full_params(model):
            results[how] = {n: p.detach().clone() for n, p in model.named_parameters()}
    want, dropped = results["in place"], results["no writeback"]
    for how in (".data =", "Parameter", "apply"):
        assert all(torch.equal(want[n], results[how][n]) for n in want), how
    assert not torch.equal(want["blocks.1.l1.weight"], dropped["blocks.1.l1.weight"])
    model, _ = make()
    with zs.FSDP.summon_full_params(model, writeback=True):  # another unit's gathered parameter: read before any frees
        model.module.blocks[0].l1.weight = model.module.blocks[1].l1.weight  # (it segfaulted, use_orig_params=False)
    with zs.FSDP.summon_full_params(model):
        tied = torch.equal(model.module.blocks[0].l1.weight, model.module.blocks[1].l1.weight)
        assert tied and model.module.blocks[0].l1.weight is not model.module.blocks[1].l1.weight
        old = {i: model.module.blocks[i].l2.weight.detach().clone() for i in (0, 2)}
    with zs.FSDP.summon_full_params(model, writeback=True):  # a swap: both read before either is written (review)
        b0, b2 = model.module.blocks[0], model.module.blocks[2]
        b0.l2.weight, b2.l2.weight = b2.l2.weight, b0.l2.weight
    with zs.FSDP.summon_full_params(model):
        assert torch.equal(model.module.blocks[0].l2.weight, old[2]) and torch.equal(model.module.blocks[2].l2.weight, old[0])
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Another unit's parameter whose own (inner) block has ended: refused by whose it is, alike on every rank
    # (its values were freed, or back to shard views that hold it whole on some ranks only; it segfaulted).
    with pytest.raises(ValueError, match="by a parameter of unit .* whose own block has ended"):
        with zs.FSDP.summon_full_params(model, recurse=False, writeback=True):
            with zs.FSDP.summon_full_params(model.module.blocks[1]):
                stale = model.module.blocks[1].l2.bias
            model.module.inp.bias = stale
    with pytest.raises(ValueError, match=r"replaced inside summon_full_params by \(13, 7\), .* \(meta\)"):
        with zs.FSDP.summon_full_params(model, writeback=True):  # every unit still resharded after
            model.module.blocks[2].l1.weight = nn.Parameter(torch.empty(13, 7, device="meta"))
    with pytest.raises(ValueError, match=r"'l1.weight' of unit .* was replaced inside summon_full_params by \(3, 3\)"):
        with zs.FSDP.summon_full_params(model, writeback=True):
            model.module.blocks[0].l1.weight.data = torch.zeros(3, 3)
    model(batch("mlp", rank, 0)).sum().backward()  # every unit resharded: it trains on
    with zs.FSDP.summon_full_params(model):
        return all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("strategy,use_orig_params", [("FULL_SHARD", False), ("FULL_SHARD", True),
                                                      ("SHARD_GRAD_OP", True), ("NO_SHARD", False)])
def test_a_parameter_replaced_inside_summon_is_written_back(ranks, strategy, use_orig_params):
    assert all(ranks.run(2, _rebind_inside_summon, strategy, use_orig_params))
