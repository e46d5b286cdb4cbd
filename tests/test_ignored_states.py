"""ignored_states: parameters (or modules) kept out of every FlatParameter.

Parity with torch FSDP1 given the same ignored parameters (``torch.equal`` on
outputs, gradients — ignored ones stay local, unreduced, in both engines —
clipped norms and parameters after AdamW), parameter names, FULL state dicts
and the misuse errors."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.nn as nn

import zeroshard as zs
from models import build
from parity import run_case

IGNORED = ("blocks.0.l1.weight", "out.bias", "inp.weight")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_ignored_parameters_match_torch(ranks, world_size, strategy, use_orig_params):
    ranks.run(world_size, run_case, {"ignored": IGNORED, "strategy": strategy, "use_orig_params": use_orig_params})


@pytest.mark.parametrize("policy", ["size", "none"])
def test_ignored_parameters_with_other_policies(ranks, policy):
    ranks.run(2, run_case, {"ignored": IGNORED, "policy": policy, "min_num_params": 50})


def _state_dicts(rank, world_size, use_orig_params):
    base = build("mlp")
    models = []
    for cls, lib in ((tfsdp.FullyShardedDataParallel, tfsdp), (zs.FSDP, zs)):
        m = copy.deepcopy(base)
        kw = {"device_id": torch.device("cpu")} if lib is tfsdp else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            models.append(cls(m, auto_wrap_policy=lib.wrap.ModuleWrapPolicy({type(m.blocks[0])}) if lib is zs else
                              tfsdp.wrap.ModuleWrapPolicy({type(m.blocks[0])}), use_orig_params=use_orig_params,
                              ignored_states=[m.get_parameter(n) for n in IGNORED], **kw))
    ref, ours = models
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert list(sd_ref) == list(sd_ours), (list(sd_ref), list(sd_ours))
    for k in sd_ref:
        assert torch.equal(sd_ref[k], sd_ours[k]), k
    ours.load_state_dict(sd_ours)  # and it loads back
    assert not any(n in {i.fqn for u in zs.FSDP.fsdp_modules(ours) if u._handle for i in u._handle.layout.params}
                   for n in IGNORED)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_state_dict_with_ignored_parameters_matches_torch(ranks, use_orig_params):
    assert all(ranks.run(2, _state_dicts, use_orig_params))


def _modules_and_misuse(rank, world_size):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    a, b = copy.deepcopy(m), copy.deepcopy(m)
    as_states, as_modules = zs.FSDP(a, ignored_states=[a[1]]), zs.FSDP(b, ignored_modules=[b[1]])
    names = [n for n, _ in as_states.named_parameters()]
    assert names == [n for n, _ in as_modules.named_parameters()] and "_fsdp_wrapped_module.1.weight" in names, names
    assert as_states._handle.layout.padded_numel == as_modules._handle.layout.padded_numel
    errors = []
    for kw in ({"ignored_states": [m[0]], "ignored_modules": [m[1]]}, {"ignored_states": [m[0], m[1].weight]},
               {"ignored_states": m[1].weight}, {"ignored_states": m[1]}):
        try:
            zs.FSDP(copy.deepcopy(m), **kw)
        except ValueError as e:
            errors.append(str(e))
    c = copy.deepcopy(m)
    c[1] = zs.FSDP(c[1])
    try:  # torch refuses it too; zeroshard used to shard the unit anyway
        zs.FSDP(c, ignored_modules=[c[1]])
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_ignored_modules_through_ignored_states_and_misuse(ranks):
    errors = ranks.run(2, _modules_and_misuse)[0]
    assert len(errors) == 5 and "not both" in errors[0] and "all nn.Parameters or all nn.Modules" in errors[1], errors
    assert "got a single parameter. Fix: ignored_states=[parameter]" in errors[2], errors  # was "got ['Tensor']"
    assert "got a single module. Fix: ignored_states=[module]" in errors[3], errors  # a TypeError: not iterable
    assert "should not include FSDP modules" in errors[4], errors


class _Inner(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.lin = nn.Linear(7, 7)
        self.lin.weight = shared

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _TiedAcross(nn.Module):
    """``m.weight`` is also ``inner.lin.weight``; the nested unit ignores it."""

    def __init__(self):
        super().__init__()
        self.a, self.m, self.out = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)
        self.inner = _Inner(self.m.weight)

    def forward(self, x):
        return self.out(self.inner(self.m(self.a(x))))


def _nested_ignored_tied(rank, world_size, use_orig_params, how):
    seen = []
    for lib, kw in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        torch.manual_seed(0)
        net = _TiedAcross()
        ignore = {"ignored_states": [net.inner.lin.weight]} if how == "params" else {"ignored_modules": [net.inner.lin]}
        net.inner = lib.FullyShardedDataParallel(net.inner, use_orig_params=use_orig_params, **ignore, **kw)
        model = lib.FullyShardedDataParallel(net, use_orig_params=use_orig_params, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        got = []
        for step in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
            got.append(model(x))
            got[-1].pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sd = model.state_dict()
        seen.append((got, sd))
    (outs_ref, sd_ref), (outs, sd) = seen
    assert all(torch.equal(a, b) for a, b in zip(outs_ref, outs))
    assert list(sd_ref) == list(sd) and all(torch.equal(sd_ref[k], sd[k]) for k in sd)
    return True


@pytest.mark.parametrize("how", ["params", "modules"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_what_a_nested_unit_ignores_its_parent_ignores(ranks, use_orig_params, how):
    """A weight a manually nested unit ignores and its parent also uses (tied)
    stays out of both, as in torch FSDP1 (zeroshard's parent flattened it,
    breaking the tie: a bogus optimizer error or a 1-D weight in forward)."""
    assert all(ranks.run(2, _nested_ignored_tied, use_orig_params, how))


# ------------------------------------------- an ignored module inside a unit
class _Side(nn.Linear):
    """A Linear with a buffer that its reset_parameters() sets too (meta init calls it)."""

    def __init__(self):
        super().__init__(6, 6)
        self.register_buffer("scale", torch.empty(6))
        self.reset_parameters()

    def reset_parameters(self):
        super().reset_parameters()
        if hasattr(self, "scale"):
            with torch.no_grad():
                self.scale.copy_(torch.linspace(0.5, 1.5, 6))


class _WithSide(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.side = nn.Linear(6, 6), _Side()

    def forward(self, x):
        return self.l1(x) + self.side(x) * self.side.scale.to(x.dtype)


class _SideNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.b0, self.out = _WithSide(), nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.b0(x))


def _ignored_inside_a_unit(rank, world_size, meta):
    seen = []
    for lib in (tfsdp, zs):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            m = _SideNet()
        kw = {"device_id": torch.device("cpu")} if lib is tfsdp else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = lib.FullyShardedDataParallel(
                m, auto_wrap_policy=lib.wrap.ModuleWrapPolicy({_WithSide}), ignored_modules=[m.b0.side],
                mixed_precision=lib.MixedPrecision(buffer_dtype=torch.bfloat16), **kw)
        y = model(torch.ones(2, 6))
        side = m.b0.side.weight
        # torch's meta path flattens the re-created side.weight into the unit (then frees it): not read there.
        kept = side.untyped_storage().size() > 0 and any(p is side for p in model.parameters())
        seen.append((y, side.detach().clone() if kept else None, m.b0.side.scale.dtype))
        if lib is zs:
            assert kept, "zeroshard: the ignored module's parameter left ignored, real, a parameter of the model"
    (y_t, w_t, dt_t), (y_z, w_z, dt_z) = seen
    return torch.equal(y_t, y_z) and (meta or torch.equal(w_t, w_z)), dt_t, dt_z


@pytest.mark.parametrize("meta", [True, False])
def test_an_ignored_module_inside_an_auto_wrapped_unit_as_torch(ranks, meta):
    """torch FSDP1 hands its auto-wrapped units the ignored parameters only: a unit
    around an ignored module materializes it (meta init) and casts its buffers.
    zeroshard handed them the modules: the module stayed on meta (the first forward
    failed on a device error naming nothing), and every unit after it got other values.
    Its re-created parameters stay ignored (torch flattens them into the unit)."""
    for same, dt_torch, dt_ours in ranks.run(2, _ignored_inside_a_unit, meta):
        assert same and dt_torch == dt_ours == torch.bfloat16, (same, dt_torch, dt_ours)


def _meta_ignored_parameter(rank, world_size):
    m = build("mlp")
    real = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.out.weight = nn.Parameter(torch.empty_like(m.out.weight, device="meta"))  # the user fills it in later
    model = zs.FSDP(m, ignored_states=[m.out.weight], use_orig_params=True)
    with zs.FSDP.summon_full_params(model):
        kept = all(torch.equal(p, real[n]) for n, p in m.named_parameters() if n != "out.weight")
    with torch.device("meta"):  # all on meta: out is re-created with the unit, its new weight still ignored
        m2 = build("mlp")
    model2 = zs.FSDP(m2, ignored_states=[m2.out.weight])
    renewed = not m2.out.weight.is_meta and any(p is m2.out.weight for p in model2.parameters())
    return kept, m.out.weight.is_meta, renewed


def test_a_meta_ignored_parameter_does_not_reinitialize_the_unit(ranks):
    """As torch FSDP1, ignored parameters do not count when deciding to materialize a
    unit; zeroshard re-initialized a real (pretrained) model for one of them."""
    for kept, still_meta, renewed in ranks.run(2, _meta_ignored_parameter):
        assert kept and still_meta and renewed


def _ignored_module_list(rank, world_size):
    keys = []
    for lib, extra in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        m = build("mlp")
        wrapped = lib.FullyShardedDataParallel(m, ignored_modules=m.blocks, **extra)  # a ModuleList: iterated, as torch
        keys.append(sorted(n for n, p in wrapped.named_parameters() if "blocks" in n))
    return keys


def test_a_module_list_of_ignored_modules_is_iterated_as_torch(ranks):
    """The refusal of a bare Module as ignored_modules first caught ModuleLists too (diff review)."""
    for ref, ours in ranks.run(2, _ignored_module_list):
        assert ref == ours and ref, (ref, ours)
