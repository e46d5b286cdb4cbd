"""use_orig_params=True: what a user does to the original parameters between
steps reaches the shards, as torch FSDP1's writeback does (found through
torch's _NamedOptimizer, whose eager state init assigns p.grad = zeros).
Each edit is made to both engines' models after a step and compared with torch
FSDP1 on 2 gloo ranks: gradients (and which are None), parameters after an
AdamW step, and forward outputs."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from models import batch
from parity import same_on_every_rank, wrapped_with_adamw as _engines


def _assign_grads(model, opt):
    opt.zero_grad(set_to_none=True)
    for p in model.parameters():  # e.g. a named optimizer's init_state: grads that are not views of the flat grad
        p.grad = torch.ones_like(p)


def _drop_some_grads(model, opt):
    for p in list(model.parameters())[:3]:  # the rest keep accumulating
        p.grad = None


def _replace_data(model, opt):
    for p in list(model.parameters())[::2]:
        p.data = p.data * 2  # new storage, same shape


def _new_parameter(model, opt):
    name = "_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.l1"
    lin = dict(model.named_modules())[name]
    lin.weight = nn.Parameter(lin.weight.detach() * 3)  # this rank's slice, as the old one was


EDITS = {f.__name__[1:]: f for f in (_assign_grads, _drop_some_grads, _replace_data, _new_parameter)}


def _grads(model):
    return [(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()]


def _same(a, b, where):
    assert len(a) == len(b), where
    for (na, ta), (nb, tb) in zip(a, b):
        assert na == nb and (ta is None) == (tb is None), (where, na, ta is None, tb is None)
        assert ta is None or torch.equal(ta, tb), (where, na, (ta - tb).abs().max().item())


def _edit_then_train(rank, world_size, strategy, edit):
    (ref, ours), opts = _engines("mlp", True, strategy)
    models = (ref, ours)
    seen = {}
    for m, o in zip(models, opts):
        m(batch("mlp", rank, 0)).float().pow(2).mean().backward()
        o.step()  # no zero_grad: the next backward accumulates onto these grads
        EDITS[edit](m, o)
        with torch.no_grad():  # the pre-forward unshard writes the edits back; no backward follows
            seen.setdefault("eval", []).append(m(batch("mlp", rank, 1)))
        seen.setdefault("after_eval", []).append(_grads(m))
        out = m(batch("mlp", rank, 2))
        out.float().pow(2).mean().backward()
        seen.setdefault("out", []).append(out)
        seen.setdefault("grads", []).append(_grads(m))
        o.step()
        seen.setdefault("params", []).append([(n, p.detach().clone()) for n, p in m.named_parameters()])
    assert torch.equal(*seen["eval"]) and torch.equal(*seen["out"]), edit
    for key in ("after_eval", "grads", "params"):
        _same(*seen[key], f"{edit}: {key}")
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edits_between_steps_match_torch(ranks, strategy, edit):
    assert all(ranks.run(2, _edit_then_train, strategy, edit))


def _bad_shape(rank, world_size):
    (ref, ours), _ = _engines("mlp", True, engines=("torch", "zeroshard"))
    errors = []
    for m in (ref, ours):
        for p in m.parameters():
            if p.numel():
                p.data = torch.zeros(p.numel() + 1)
        try:
            m(batch("mlp", rank, 0))
        except RuntimeError as e:
            errors.append(str(e))
    assert len(errors) == 2, errors  # torch: "Cannot writeback when the parameter shape changes"
    assert "must keep the shape" in errors[1] and "Fix:" in errors[1], errors[1]
    return True


def test_replaced_parameter_of_another_shape_is_refused(ranks):
    assert all(ranks.run(2, _bad_shape))


def _no_sync_with_a_frozen_parameter(rank, world_size, strategy):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    grads = []
    for lib, extra in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        net[1].weight.requires_grad_(False)  # a partly frozen unit
        model = lib.FullyShardedDataParallel(net, use_orig_params=True, **extra,
                                             sharding_strategy=getattr(lib.ShardingStrategy, strategy))
        torch.manual_seed(10 + rank)
        xs = [torch.randn(4, 8) for _ in range(4)]
        seen = []
        with model.no_sync():  # accumulates the unsharded gradient; the frozen weight's view is zeros,
            for x in xs[:3]:  # with NO_SHARD dropped after each forward (so only the last micro-batch's shows)
                model(x).pow(2).sum().backward()
                seen += _grads(model)
        model(xs[3]).pow(2).sum().backward()
        grads.append(seen + _grads(model))
    _same(*grads, f"no_sync {strategy}")
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_no_sync_accumulation_with_a_frozen_parameter(ranks, strategy):
    assert all(ranks.run(2, _no_sync_with_a_frozen_parameter, strategy))


def _replace_tied(rank, world_size):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    raised = []
    for lib, extra in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        net[1].weight = net[0].weight  # tied
        model = lib.FullyShardedDataParallel(net, use_orig_params=True, **extra)
        model(torch.randn(2, 4))
        inner = model.module
        inner[1].weight = nn.Parameter(torch.zeros_like(inner[1].weight))  # replaces one name of the pair
        try:
            model(torch.randn(2, 4))
        except (NotImplementedError, RuntimeError) as e:  # torch: NotImplementedError
            raised.append(str(e))
    assert len(raised) == 2 and "tied" in raised[1] and "Fix:" in raised[1], raised
    return True


def test_replacing_a_tied_parameter_is_refused(ranks):
    assert all(ranks.run(2, _replace_tied))


# --------------------------------------------- the original parameters around forward and backward
def _l2(model):
    return sum(p.float().pow(2).sum() for p in model.parameters())


def _penalty_outside_forward(rank, world_size, strategy, when, micro=1, mp=None):
    """An L2 penalty over model.parameters() computed before the forward (it
    reaches the original parameters through their own AccumulateGrad nodes) or
    after it (where ZeRO-2 exposes the unsharded parameters the forward used),
    with ``micro`` backwards accumulating into each step."""
    (ref, ours), opts = _engines("mlp", True, strategy, mp=mp)
    if mp is not None:  # AdamW cannot step fp32 parameters with the bf16 grads keep_low_precision_grads gives
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    seen = {}
    for m, o in zip((ref, ours), opts):
        for step in range(3):
            for k in range(micro):
                reg = _l2(m) if when == "before" else None
                out = m(batch("mlp", rank, micro * step + k))
                if when == "after":
                    reg = _l2(m)
                (out.float().pow(2).mean() + 0.01 * reg).backward()
            # torch leaves an empty .grad where this rank holds none of a parameter; zeroshard None
            seen.setdefault("grads", []).append([(n, None if p.grad is None or p.numel() == 0 else p.grad.clone())
                                                 for n, p in m.named_parameters()])
            seen.setdefault("reg", []).append(reg.detach())
            o.step()
            o.zero_grad()
        seen.setdefault("params", []).append([(n, p.detach().clone()) for n, p in m.named_parameters()])
    n = len(seen["reg"]) // 2
    for i in range(n):
        assert torch.equal(seen["reg"][i], seen["reg"][n + i]), (when, i)
        _same(seen["grads"][i], seen["grads"][n + i], f"{when}: grads at step {i}")
    _same(*seen["params"], f"{when}: params")
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_penalty_on_the_original_parameters_matches_torch(ranks, strategy, when):
    """Before: its gradient used to be dropped (the end of backward pointed
    .grad at the flat gradient over it). After, under SHARD_GRAD_OP: the penalty
    used to read this rank's 1-D shards instead of the full parameters."""
    assert all(ranks.run(2, _penalty_outside_forward, strategy, when))


@pytest.mark.parametrize("strategy,mp", [("FULL_SHARD", None), ("SHARD_GRAD_OP", None), ("NO_SHARD", None),
                                         ("FULL_SHARD", dict(param_dtype="bfloat16", reduce_dtype="bfloat16",
                                                             keep_low_precision_grads=True))])
def test_penalty_with_accumulated_micro_batches_matches_torch(ranks, strategy, mp):
    """Two backwards per step: the second backward's penalty reaches the
    grads while the reduction is in flight. NO_SHARD used to count it twice
    (it was added into the buffer being all-reduced), the sharded strategies
    added it before the reduced gradient instead of after (a 1-ulp drift), and
    keep_low_precision_grads dropped it (it went into the low-precision copy)."""
    assert all(ranks.run(2, _penalty_outside_forward, strategy, "before", 2, mp))


def _freeze_a_unit_then_unfreeze(rank, world_size, strategy):
    (ref, ours), opts = _engines("mlp", True, strategy)
    seen = {}
    for m, o in zip((ref, ours), opts):
        block = [u for u in m.modules() if type(u).__name__.endswith("FullyShardedDataParallel") and u is not m][1]
        block.requires_grad_(False)
        for step in range(4):
            if step == 2:
                block.requires_grad_(True)
            m(batch("mlp", rank, step)).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
        seen.setdefault("types", []).append([type(t).__name__ for t in block.module._parameters.values()])
        seen.setdefault("params", []).append([(n, p.detach().clone()) for n, p in m.named_parameters()])
    assert seen["types"][0] == seen["types"][1] == ["Parameter"] * len(seen["types"][0]), seen["types"]
    _same(*seen["params"], "params")
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_a_unit_frozen_for_some_steps_trains_after_unfreezing_as_in_torch(ranks, strategy):
    """NO_SHARD: a wholly frozen unit runs no post-backward; its modules used to
    keep plain tensor views in place of the parameters, so unfreezing trained nothing."""
    assert all(ranks.run(2, _freeze_a_unit_then_unfreeze, strategy))


class WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        self.empty = nn.Parameter(torch.empty(0))  # e.g. a bias of a zero-width layer
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        return self.lin(x) * self.a + self.empty.sum()


def _zero_element_parameter(rank, world_size):
    import warnings

    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs
    seen = []
    for lib, kw in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = lib.FullyShardedDataParallel(WithEmpty(), use_orig_params=True, **kw)
        opt = torch.optim.AdamW(m.parameters())
        m(torch.ones(2, 5) * (rank + 1)).sum().backward()
        empty = next(p for n, p in m.named_parameters() if n.endswith("empty"))
        grad = None if empty.grad is None else tuple(empty.grad.shape)
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with lib.FullyShardedDataParallel.state_dict_type(m, lib.StateDictType.FULL_STATE_DICT, None,
                                                              lib.FullOptimStateDictConfig(offload_to_cpu=False)):
                osd = lib.FullyShardedDataParallel.optim_state_dict(m, opt)
        seen.append((grad, empty in opt.state, {k: {n: (tuple(v.shape), v.clone()) if torch.is_tensor(v) else v
                                                    for n, v in st.items()} for k, st in osd["state"].items()}))
    (g_ref, st_ref, osd_ref), (g, st, osd) = seen
    assert (g, st) == (g_ref, st_ref), ((g, st), (g_ref, st_ref))
    assert osd.keys() == osd_ref.keys()
    for k in osd:
        # torch's FULL dict drops the zero-element parameter's 'step' (a quirk: its optimizer has one); zeroshard keeps it.
        extra = {"step"} if k == "empty" else set()
        assert set(osd[k]) == set(osd_ref[k]) | extra, (k, list(osd[k]), list(osd_ref[k]))
        for n, v in ((n, v) for n, v in osd[k].items() if n in osd_ref[k]):
            ref = osd_ref[k][n]
            assert (v[0] == ref[0] and torch.equal(v[1], ref[1])) if isinstance(v, tuple) else v == ref, (k, n)
    return g is not None


def test_a_zero_element_parameter_gets_its_empty_grad_where_torch_gives_one(ranks):
    """torch puts a numel-0 parameter in the shard holding elements on both sides
    of its offset (rank 0 here): an empty .grad there, so optimizer state; the
    other rank None. zeroshard left it None on every rank, so the optimizer
    state differed from torch's."""
    assert ranks.run(2, _zero_element_parameter) == [True, False]


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _ReadsChildWeight(nn.Module):
    """The root's forward reads its child unit's parameter after the child ran (weight reuse across modules)."""

    def __init__(self, d=6):
        super().__init__()
        self.child, self.lin = _Block(d), nn.Linear(d, d)

    def forward(self, x):
        h = self.child(x)
        return self.lin(h) + nn.functional.linear(h, self.child.fc2.weight.to(h.dtype))  # (bf16 under mixed precision)


def _parent_reads_child_weight(rank, world_size, use_orig_params):
    import torch.distributed as dist

    import zeroshard as zs

    def build():
        torch.manual_seed(0)
        return _ReadsChildWeight()

    plain, m = build(), build()
    kw = dict(use_orig_params=use_orig_params, sharding_strategy=zs.ShardingStrategy.NO_SHARD)
    m.child = zs.FSDP(m.child, **kw)
    m = zs.FSDP(m, **kw)
    x = batch("mlp", rank, 0, d_in=6)
    plain(x).pow(2).mean().backward()
    m(x).pow(2).mean().backward()
    want = plain.child.fc2.weight.grad.clone()
    dist.all_reduce(want)  # DDP's average: what every replica must apply
    want /= world_size
    if use_orig_params:
        with zs.FSDP.summon_full_params(m, with_grads=True):
            full = m.child.fc2.weight.grad.clone()
        assert torch.equal(m.child.fc2.weight.grad, full)
    else:  # NO_SHARD: the FlatParameter's gradient is the whole one
        h = m.child._handle
        info = h.layout.params[2]  # fc1.weight, fc1.bias, fc2.weight, ...
        assert info.name == "weight" and info.module is m.child.module.fc2
        full = info.unflat(h.flat_param.grad[info.offset : info.offset + info.numel])
    assert same_on_every_rank([full]), "replicas got different gradients"
    return (full - want).abs().max().item()


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_no_shard_parent_reading_a_child_parameter_gets_the_averaged_gradient(ranks, use_orig_params):
    """NO_SHARD with use_orig_params=True added the parent's part of the child's
    weight gradient after the all-reduce, unreduced: each replica applied its
    own data's term and the replicas drifted apart for good (torch FSDP1 drops
    the term). It is averaged with the rest, as DDP (and use_orig_params=False,
    where it reaches the FlatParameter through autograd) does: bit-equal to
    the plain model's all-reduced average on 2 ranks. (The pre-backward
    gather wrote the term into the flat gradient as a user's .grad edit and
    the end of backward added it again.)"""
    assert ranks.run(2, _parent_reads_child_weight, use_orig_params) == [0.0, 0.0]


def _parent_reads_child_weight_steps(rank, world_size, mode):
    """3 SGD steps (``bf16``: bf16 mixed precision; ``no_sync``: each step two micro-batches, the
    first under no_sync); returns (replicas equal, max |param - DDP-style reference|)."""
    import torch.distributed as dist

    import zeroshard as zs

    def build():
        torch.manual_seed(0)
        return _ReadsChildWeight()

    plain, m = build(), build()
    kw = dict(use_orig_params=True, sharding_strategy=zs.ShardingStrategy.NO_SHARD)
    if mode.startswith("bf16"):
        kw["mixed_precision"] = zs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    m.child = zs.FSDP(m.child, **kw)
    m = zs.FSDP(m, **kw)
    opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in (plain, m)]
    micro = 2 if mode.endswith("no_sync") else 1
    for step in range(3):
        for k in range(micro):
            x = batch("mlp", rank, micro * step + k, d_in=6)
            plain(x).float().pow(2).mean().backward()
            with m.no_sync() if k < micro - 1 else contextlib.nullcontext():
                m(x).float().pow(2).mean().backward()
        for p in plain.parameters():
            p.grad.div_(world_size)
            dist.all_reduce(p.grad)
        for o in opts:
            o.step()
            o.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), m.parameters()))
    return same_on_every_rank(m.parameters()), diff


@pytest.mark.parametrize("mode", ["bf16", "no_sync", "bf16_no_sync"])
def test_no_shard_parent_reading_a_child_parameter_over_steps(ranks, mode):
    """bf16: the term reached the weight after the child's pre-backward gather and
    was added after the all-reduce, unreduced (replicas 0.08 apart after 4 steps).
    no_sync: the writeback that took the term created the flat gradient and then
    took fc2.bias's still-empty .grad for a user's `p.grad = None`, dropping its
    accumulated micro-batch (0.12 off). bf16 + no_sync: the term reached the
    weight during a no_sync backward after the gather, and the re-pointed grad
    views overwrote it (torch FSDP1 loses it too). Against fp32 DDP: bf16
    compute measured 5.4e-4 off (allowed 2e-3); fp32 3e-8 (two micro-batches
    summed in another order)."""
    for same, diff in ranks.run(2, _parent_reads_child_weight_steps, mode):
        assert same, "replicas differ"
        assert diff <= (2e-3 if mode.startswith("bf16") else 1e-7), diff


def _replace_a_head(rank, world_size):
    """New Parameters for weights only rank 1 holds a slice of. Of another shape than
    its slice: rank 1 refused it and rank 0 went on into the all-gather (a hang until
    the timeout; torch FSDP1 too). Of its slice's shape (a 1-D bias held whole): taken."""
    import zeroshard as zs
    from models import Block, build

    model = zs.FSDP(build("mlp"), use_orig_params=True, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    model(batch("mlp", rank, 0)).sum().backward()
    held = (model.module.out.weight.numel(), model.module.out.bias.numel())
    model.module.out.bias = torch.nn.Parameter(torch.full((3,), 0.5))
    model(batch("mlp", rank, 1)).sum().backward()  # every rank goes on
    with zs.FSDP.summon_full_params(model):
        bias = model.module.out.bias.detach().clone()
    model.module.out.weight = torch.nn.Parameter(torch.zeros(3, 7))
    try:
        model(batch("mlp", rank, 2))
    except RuntimeError as e:
        return held, bias, str(e)
    return held, bias, None


def test_a_replaced_parameter_held_by_one_rank_is_refused_on_every_rank(ranks):
    results = ranks.run(2, _replace_a_head)
    assert [held for held, _, _ in results] == [(0, 0), (21, 3)], results  # else this test shows nothing
    for _, bias, msg in results:
        assert torch.equal(bias, torch.full((3,), 0.5))
        assert msg and "'out.weight'" in msg and "must keep the shape" in msg, msg


def _functional_call(rank, world_size, use_orig_params, strategy="FULL_SHARD", by_state_dict_names=False):
    import zeroshard as zs

    torch.manual_seed(0)
    model = zs.FSDP(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), use_orig_params=use_orig_params,
                    sharding_strategy=getattr(zs.ShardingStrategy, strategy))
    x = torch.randn(3, 4)
    own = model(x).detach()  # under ZeRO-2 the unit stays gathered, its full views in the parameters' places
    zeros = {n: torch.zeros_like(p) for n, p in model.named_parameters()}  # this rank's shapes
    if by_state_dict_names:  # the plain names (use_orig_params=False: attributes the unit sets, not parameters)
        with zs.FSDP.state_dict_type(model, zs.StateDictType.FULL_STATE_DICT):
            zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    try:
        torch.func.functional_call(model, zeros, (x,))
    except RuntimeError as e:
        return str(e), torch.equal(model(x).detach(), own)  # the model is left as it was
    return None, None


@pytest.mark.parametrize("use_orig_params,strategy,by_names", [(True, "FULL_SHARD", False), (False, "FULL_SHARD", False),
                                                          (True, "SHARD_GRAD_OP", False), (False, "FULL_SHARD", True),
                                                          (False, "NO_SHARD", True)])
def test_functional_call_with_other_tensors_is_refused(ranks, use_orig_params, strategy, by_names):
    """torch.func.functional_call swaps plain tensors into the unit's parameters, but the
    unit computes with its own all-gathered ones: the given values were ignored silently
    (an output equal to the model's own weights'); torch FSDP1 ignores them with
    use_orig_params=False too. Also on a unit kept gathered since a forward (ZeRO-2), and given
    the state dict's names with use_orig_params=False (the attributes the unit sets: they were
    ignored silently, as in torch)."""
    for msg, unchanged in ranks.run(2, _functional_call, use_orig_params, strategy, by_names):
        assert msg and "functional_call" in msg and "would be ignored" in msg and "Fix: call functional_call on the unwrapped" in msg, msg
        assert unchanged


def _data_assigned_after_a_forward_without_backward(rank, world_size):
    import copy

    import zeroshard as zs

    torch.manual_seed(0)
    plain = nn.Linear(4, 4)
    model = zs.FSDP(copy.deepcopy(plain), use_orig_params=True)
    other = zs.FSDP(nn.Linear(4, 4), use_orig_params=True)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.ones(2, 4)
    model(x)  # grad mode, no backward (an EMA model evaluated without no_grad): the root stays gathered
    other(x).sum().backward()
    opt.step()  # any optimizer step in the process makes the kept root stale
    return all(_data_plus_one_as_plain(model, plain, x, grad_forward=False))


def _data_plus_one_as_plain(model, plain, x, grad_forward: bool):
    """``p.data = p.data + 1`` over the wrapped model's parameters, in place on the plain model's:
    (the next forward's output, the FULL state dict) equal to the plain model's?"""
    import zeroshard as zs

    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data + 1.0
        for p in plain.parameters():
            p.add_(1.0)
    with torch.set_grad_enabled(grad_forward):
        out = model(x)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    return torch.equal(out, plain(x)), all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())


def test_data_assigned_while_a_stale_unit_is_kept_reaches_the_shard(ranks):
    """Freeing the stale kept unit re-pointed the parameters at the shard before the
    writeback saw the new .data: the update was lost for good (torch FSDP1 loses it too)."""
    assert all(ranks.run(2, _data_assigned_after_a_forward_without_backward))


def _data_assigned_on_a_kept_unit(rank, world_size, strategy, wrap):
    import copy

    import zeroshard as zs
    from zeroshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    policy = ModuleWrapPolicy({nn.Linear}) if wrap else None
    model = zs.FSDP(copy.deepcopy(plain), use_orig_params=True, auto_wrap_policy=policy,
                    sharding_strategy=getattr(zs.ShardingStrategy, strategy))
    x = torch.ones(2, 4)
    model(x)  # grad mode, no backward: ZeRO-2 units and a FULL_SHARD root stay gathered
    kept = [h.unsharded for h in model._runtime.handles]
    return kept, *_data_plus_one_as_plain(model, plain, x, grad_forward=True)


@pytest.mark.parametrize("strategy,wrap", [("SHARD_GRAD_OP", True), ("SHARD_GRAD_OP", False), ("FULL_SHARD", False)])
def test_data_assigned_while_a_unit_is_kept_gathered_is_computed_with_and_saved(ranks, strategy, wrap):
    """``p.data = ...`` over model.parameters() while units stay gathered after a forward (ZeRO-2
    units, a FULL_SHARD root): the next forward computed with the old values and, under ZeRO-2,
    the state dict lost the change. torch FSDP1 raises an AssertionError under ZeRO-2 and
    loses the change on a FULL_SHARD root (output and state dict)."""
    for kept, same_out, same_sd in ranks.run(2, _data_assigned_on_a_kept_unit, strategy, wrap):
        assert any(kept), kept  # else this test shows nothing
        assert same_out and same_sd


def _data_assigned_between_forward_and_backward(rank, world_size):
    import zeroshard as zs

    torch.manual_seed(0)
    model = zs.FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), use_orig_params=True,
                    sharding_strategy=zs.ShardingStrategy.SHARD_GRAD_OP)
    loss = model(torch.ones(2, 4)).sum()
    with torch.no_grad():
        model.module[0].weight.data = model.module[0].weight.data * 2
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_data_assigned_between_forward_and_backward_of_a_kept_unit_is_refused(ranks):
    """The backward would differentiate the values the forward used and the reshard after it
    would drop the new ones, silently (torch FSDP1 raises an AssertionError)."""
    for msg in ranks.run(2, _data_assigned_between_forward_and_backward):
        assert msg and "'0.weight'" in msg and "between its forward and its backward" in msg and "Fix:" in msg, msg


def _identity_data_assignment(rank, world_size, how):
    import zeroshard as zs

    torch.manual_seed(0)
    from zeroshard.quantize import Int8BlockQuant

    kw = {"mixed_precision": zs.MixedPrecision(param_dtype=torch.bfloat16)} if how == "bf16" else \
        {"quantized_all_gather": Int8BlockQuant(block_size=8)}
    model = zs.FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), use_orig_params=True,
                    sharding_strategy=zs.ShardingStrategy.SHARD_GRAD_OP, **kw)
    x = torch.ones(2, 4)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.FULL_STATE_DICT):
        before = {k: v.clone() for k, v in model.state_dict().items()}
    model(x)  # kept gathered: the parameters are views of the bf16 / dequantized buffer
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()  # changes nothing
    model(x)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.FULL_STATE_DICT):
        after = model.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    # fp32 values a hair away (EMA weights swapped in): each must land whole, though most round to
    # the same bf16 as the gathered copy
    targets = {k: v * (1 + 1e-4) for k, v in before.items()}
    model(x)
    with torch.no_grad():
        for p, t in zip(model.parameters(), targets.values()):  # a Linear stack: state dict order
            p.data = t.clone()
    model(x)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.FULL_STATE_DICT):
        swapped = model.state_dict()
    return unchanged, all(torch.equal(targets[k], swapped[k]) for k in targets)


@pytest.mark.parametrize("how", ["bf16", "int8 all-gather"])
def test_an_identity_data_assignment_on_a_rounded_kept_copy_leaves_the_master_alone(ranks, how):
    """The gathered copy's rounded values (bf16, qwZ's dequantized int8) went into the fp32 shard
    for every replaced view, changing the master by up to 1.4e-3 for `p.data = p.data.clone()`;
    and fp32 values compared in bf16 were mostly taken for no change (diff reviews)."""
    for unchanged, swapped in ranks.run(2, _identity_data_assignment, how):
        assert unchanged and swapped


def _data_edit_after_a_no_sync_forward(rank, world_size):
    import warnings

    import zeroshard as zs

    torch.manual_seed(0)
    model = zs.FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), use_orig_params=True,
                    sharding_strategy=zs.ShardingStrategy.NO_SHARD)
    x = torch.ones(2, 4)
    with model.no_sync():
        model(x)  # grad mode, no backward
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 0.5
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(x)
    return [str(w.message) for w in seen if "changed in place" in str(w.message)]


def test_no_false_stale_warning_for_a_no_shard_unit(ranks):
    """A NO_SHARD unit computes on its shard itself: its new values are used, yet a warning said
    the next forward computes with the values gathered before."""
    assert ranks.run(2, _data_edit_after_a_no_sync_forward) == [[], []]


class _TwoLinears(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.a = nn.Linear(10, 10, bias=bias)
        self.b = nn.Linear(10, 10, bias=bias)

    def forward(self, x):
        return self.b(self.a(x))


def _data_of_a_parameter_held_elsewhere(rank, world_size):
    import zeroshard as zs

    torch.manual_seed(0)
    w = zs.FSDP(_TwoLinears(bias=False), use_orig_params=True)  # on 2 ranks b.weight is all in rank 1's shard
    held = w.b.weight.numel()
    w.b.weight.data = torch.zeros(10, 10)  # the same Parameter, a full-shaped .data
    try:
        w(torch.randn(2, 10))
    except RuntimeError as e:
        return held, str(e)
    return held, None


def test_a_replaced_data_is_refused_on_ranks_without_a_slice_too(ranks):
    """Only the rank holding the slice raised; the other went into the all-gather alone and
    failed there with gloo's error (under NCCL: a hang until the timeout)."""
    results = ranks.run(2, _data_of_a_parameter_held_elsewhere)
    assert sorted(held for held, _ in results) == [0, 100]
    for _, msg in results:
        assert msg and "'b.weight'" in msg and "was replaced by a tensor of shape (10, 10)" in msg, msg


def _data_of_another_dtype(rank, world_size, which, engine, value=0.5, dtype=torch.float16):
    import warnings

    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = (tfsdp.FullyShardedDataParallel(_TwoLinears(), device_id=torch.device("cpu"), use_orig_params=True)
             if engine == "torch" else zs.FSDP(_TwoLinears(), use_orig_params=True))
    with torch.no_grad():
        for name, p in w.named_parameters():
            if which == "all" or name.endswith(f"{which}.weight"):
                p.data = torch.full_like(p, value, dtype=dtype if which == "all" else torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = {k: v.clone() for k, v in w.state_dict().items()}
    if which == "all":
        return {k: v.dtype == dtype and bool((v == torch.tensor(value, dtype=dtype)).all()) for k, v in sd.items()}
    y = w(torch.ones(2, 10))
    return y.dtype, y.detach(), sd


@pytest.mark.parametrize("which", ["a", "b"])
def test_data_of_another_dtype_on_one_parameter_is_written_back_as_torch(ranks, which):
    """p.data = a float64 tensor on the unit's first parameter was taken for a cast of the whole
    unit to float64 (the forward then failed); torch FSDP1 writes the values into its fp32 shard."""
    ref = ranks.run(2, _data_of_another_dtype, which, "torch")
    ours = ranks.run(2, _data_of_another_dtype, which, "zeroshard")
    for (dt, yt, sdt), (dz, yz, sdz) in zip(ref, ours):
        assert dt == dz == torch.float32 and torch.equal(yt, yz)
        assert [k.replace("_fsdp_wrapped_module.", "") for k in sdt] == list(sdz)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(sdt.values(), sdz.values()))


@pytest.mark.parametrize("value, dtype", [(0.5, torch.float16), (1 / 3, torch.float64)])
def test_every_parameter_given_data_of_another_dtype_keeps_its_values(ranks, value, dtype):
    """Taken for a cast (module.half() after wrapping does the same to every parameter), the unit
    used to cast its old shard and point the parameters at it: the values given were lost (and
    then, float64 ones went through the fp32 shard first)."""
    for loaded in ranks.run(2, _data_of_another_dtype, "all", "zeroshard", value, dtype):
        assert loaded and all(loaded.values()), loaded
