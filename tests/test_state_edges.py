"""State dicts where zeroshard once differed from torch FSDP1 (found by a
side-by-side review): taken where training is not idle, LOCAL_STATE_DICT's
format, and the small API edges around them; each compared with torch FSDP1
on 2 gloo ranks."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from models import Block, batch, build
from parity import DEFAULTS, _wrap


def _engines(**overrides):
    case = {**DEFAULTS, "model": "mlp", **overrides}
    base = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [_wrap(e, copy.deepcopy(base), case) for e in ("torch", "zeroshard")]


def _full(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: v.clone() for k, v in model.state_dict().items()}


def _state_dict_between_forward_and_backward(rank, world_size, strategy, use_orig_params, mp):
    models = _engines(strategy=strategy, use_orig_params=use_orig_params, mp=mp)
    seen = []
    for m in models:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(2):
            out = m(batch("mlp", rank, step))
            sd = _full(m)  # the root (ZeRO-3) or every unit (ZeRO-2) still holds what backward needs
            out.float().pow(2).mean().backward()
            grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
            opt.step()
            opt.zero_grad()
            seen.append((out.detach(), sd, grads, [p.detach().clone() for p in m.parameters()]))
    half = len(seen) // 2
    for (out_t, sd_t, g_t, p_t), (out_z, sd_z, g_z, p_z) in zip(seen[:half], seen[half:]):
        assert torch.equal(out_t, out_z)
        assert list(sd_t) == list(sd_z) and all(torch.equal(sd_t[k], sd_z[k]) for k in sd_t)
        assert len(g_t) == len(g_z) and all(torch.equal(a, b) for a, b in zip(g_t, g_z))
        assert all(torch.equal(a, b) for a, b in zip(p_t, p_z))
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("mp", [None, {"param_dtype": "bfloat16"}], ids=["fp32", "bf16"])
def test_state_dict_between_forward_and_backward(ranks, strategy, use_orig_params, mp):
    assert all(ranks.run(2, _state_dict_between_forward_and_backward, strategy, use_orig_params, mp))


def _errors_and_roots(rank, world_size):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    models = _engines()
    # fsdp_modules(root_only=True) before any forward: the lazy init decides, as in torch.
    roots = [lib.FullyShardedDataParallel.fsdp_modules(m, root_only=True) for lib, m in zip((tfsdp, zs), models)]
    assert [len(r) for r in roots] == [1, 1] and all(r[0] is m for r, m in zip(roots, models)), roots
    # clip_grad_norm_ with no gradient anywhere: the same norm and torch's warning.
    seen = []
    for m in models:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            norm = m.clip_grad_norm_(1.0)
        seen.append((norm, [str(x.message) for x in w if "clip_grad_norm_" in str(x.message)]))
    assert torch.equal(seen[0][0], seen[1][0]) and seen[0][1] == seen[1][1] and len(seen[0][1]) == 1, seen
    # A strict load missing a key names it as the plain model does, in torch's words.
    src = build("mlp", seed=5).state_dict()
    errors = []
    for m in models:
        missing = {k: v for k, v in src.items() if k != "blocks.0.l1.weight"}
        wrong = {**src, "out.bias": torch.zeros(4)}
        for sd in (missing, wrong):
            with pytest.raises(RuntimeError) as e:
                m.load_state_dict(sd)
            errors.append(str(e.value))
    assert errors[0] == errors[2] and '"blocks.0.l1.weight"' in errors[0], errors
    assert "out.bias" in errors[3]  # wrong shape: RuntimeError in both, raised before anything is loaded
    return True


def test_load_errors_roots_and_clip_warning_as_torch(ranks):
    assert all(ranks.run(2, _errors_and_roots))


def _state_dict_inside_summon(rank, world_size, use_orig_params):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    models = _engines(use_orig_params=use_orig_params)
    for m in models:  # a trained step first, so the shards differ from the initial values
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(batch("mlp", rank, 0)).float().pow(2).mean().backward()
        opt.step()
    dicts = []
    for lib, m in zip((tfsdp, zs), models):
        outside = _full(m)
        block = dict(m.named_modules())["_fsdp_wrapped_module.blocks.1"]
        for scope in (m, block):  # the whole model summoned, or only one unit of it
            with lib.FullyShardedDataParallel.summon_full_params(scope):
                inside = _full(m)
            assert list(inside) == list(outside) and all(torch.equal(inside[k], outside[k]) for k in outside)
        dicts.append(outside)
        m(batch("mlp", rank, 1)).sum().backward()  # still trains
    assert list(dicts[0]) == list(dicts[1]) and all(torch.equal(dicts[0][k], dicts[1][k]) for k in dicts[0])
    return True


def _state_dict_inside_rank0_only_summon(rank, world_size, use_orig_params):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    for lib, m in zip((tfsdp, zs), _engines(use_orig_params=use_orig_params)):
        with lib.FullyShardedDataParallel.summon_full_params(m, rank0_only=True, writeback=False):
            if rank == 0:
                assert len(_full(m)) == 17
            elif lib is zs:  # torch: an AssertionError; zeroshard: a RuntimeError saying what to do
                with pytest.raises(RuntimeError, match="only rank 0 keeps them"):
                    _full(m)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dict_inside_rank0_only_summon(ranks, use_orig_params):
    assert all(ranks.run(2, _state_dict_inside_rank0_only_summon, use_orig_params))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dict_inside_summon_full_params(ranks, use_orig_params):
    assert all(ranks.run(2, _state_dict_inside_summon, use_orig_params))


def _cast_after_wrapping(rank, world_size, strategy, use_orig_params):
    models = _engines(strategy=strategy, use_orig_params=use_orig_params)
    seen = []
    for m in models:
        m.to(torch.float64)  # after wrapping, before the first forward: torch FSDP1 follows it
        sd = _full(m)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        outs = []
        for step in range(2):
            out = m(batch("mlp", rank, step).double())
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out.detach())
        seen.append((sd, outs, [p.detach().clone() for p in m.parameters()]))
        m(batch("mlp", rank, 2).double()).sum().backward()
        if m is models[1] or strategy != "NO_SHARD":
            # Once gathered or holding gradients, a cast is refused (torch: FULL_SHARD fails in
            # forward; NO_SHARD goes on with float32 parameters and float64 gradients).
            with pytest.raises((ValueError, RuntimeError)):
                m.float()(batch("mlp", rank, 3))
    (sd_t, outs_t, p_t), (sd_z, outs_z, p_z) = seen
    assert list(sd_t) == list(sd_z) and all(sd_t[k].dtype == sd_z[k].dtype and torch.equal(sd_t[k], sd_z[k]) for k in sd_t)
    assert all(o.dtype == torch.float64 and torch.equal(o, q) for o, q in zip(outs_t, outs_z))
    assert all(a.dtype == torch.float64 and torch.equal(a, b) for a, b in zip(p_t, p_z))
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_cast_after_wrapping_as_torch(ranks, strategy, use_orig_params):
    assert all(ranks.run(2, _cast_after_wrapping, strategy, use_orig_params))


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 1.5))

    def forward(self, x):
        self.seen = self.scale.dtype
        return self.lin(x) * self.scale


def _cast_after_a_step_with_buffer_dtype(rank, world_size, use_orig_params):
    import zeroshard as zs

    torch.manual_seed(0)
    m = zs.FSDP(Scaled(), use_orig_params=use_orig_params,
                mixed_precision=zs.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    m.double()  # between steps: zeroshard follows it (torch FSDP1 keeps its float32 shards)
    m(torch.randn(2, 4, dtype=torch.float64)).float().sum().backward()
    sd = _full(m)
    return m.module.seen, sd["lin.weight"].dtype, sd["scale"].dtype


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_cast_after_a_step_keeps_buffers_in_buffer_dtype(ranks, use_orig_params):
    """The buffers left buffer_dtype (computed in float64) and the state dict gave the
    buffer in float32, the dtype remembered at the first forward, beside float64 weights."""
    assert ranks.run(2, _cast_after_a_step_with_buffer_dtype, use_orig_params) == \
        [(torch.bfloat16, torch.float64, torch.float64)] * 2


def _local_value(v):
    if type(v).__name__ == "ShardedTensor":
        shards = v.local_shards()
        return ("ShardedTensor", tuple(v.size()), [tuple(s.metadata.shard_offsets) for s in shards],
                shards[0].tensor if shards else torch.empty(0))
    return (type(v).__name__, tuple(v.shape), [], v)


def _local_like_torch(rank, world_size, strategy, use_orig_params):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    models = _engines(strategy=strategy, use_orig_params=use_orig_params)
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(batch("mlp", rank, 0)).sum().backward()
        opt.step()
        opt.zero_grad()
    dicts = []
    for lib, m in zip((tfsdp, zs), models):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with lib.FullyShardedDataParallel.state_dict_type(m, lib.StateDictType.LOCAL_STATE_DICT):
                dicts.append(m.state_dict())
    ref, ours = dicts
    assert list(ref) == list(ours), (list(ref), list(ours))
    for k in ref:
        (kind_t, size_t, offs_t, t), (kind_z, size_z, offs_z, z) = _local_value(ref[k]), _local_value(ours[k])
        assert (kind_t, size_t, offs_t, t.shape, t.dtype) == (kind_z, size_z, offs_z, z.shape, z.dtype), k
        # use_orig_params pads between parameters with torch's marker 42.0 (zeroshard's was 0).
        assert torch.equal(t, z), (k, (t != z).nonzero().flatten().tolist())
    # Each engine's LOCAL dict loads into the other (torch cannot load its own when sharded with
    # use_orig_params: it rejects the _flat_param keys it wrote; zeroshard takes them).
    pairs = [(ref, models[1], zs)] + ([(ours, models[0], tfsdp)] if not use_orig_params or strategy == "NO_SHARD" else [])
    fresh = _engines(strategy=strategy, use_orig_params=use_orig_params)
    for src, dst, lib in pairs + [(ours, fresh[1], zs)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with lib.FullyShardedDataParallel.state_dict_type(dst, lib.StateDictType.LOCAL_STATE_DICT):
                result = dst.load_state_dict(src)
        assert not result.missing_keys and not result.unexpected_keys, result
    outs = [m(batch("mlp", rank, 1)) for m in (*models, fresh[1])]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_local_state_dict_in_torch_format(ranks, strategy, use_orig_params):
    """LOCAL_STATE_DICT as torch FSDP1 writes it: the plain model's keys in its
    order, each flat shard a ShardedTensor of the unpadded flat parameter (this
    rank's chunk at its offset), the original parameters' shards beside them
    with use_orig_params, full parameters for NO_SHARD; both load either way."""
    assert all(ranks.run(2, _local_like_torch, strategy, use_orig_params))


class _HalfBlock(torch.nn.Module):
    """Its state-dict hook converts a value (as export code does): it must see the full parameter."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(7, 13), torch.nn.Linear(13, 7)
        self._register_state_dict_hook(lambda mod, sd, prefix, meta: sd.__setitem__(
            prefix + "l2.weight", sd[prefix + "l2.weight"].detach().half()))

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


class _NormBlock(_HalfBlock):
    """Its extra state is computed from a parameter, and is not a tensor."""

    def get_extra_state(self):
        return {"l1_norm": float(self.l1.weight.detach().norm())}

    def set_extra_state(self, state):
        self.loaded_norm = state["l1_norm"]


class _HookNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.a, self.b, self.out = torch.nn.Linear(5, 7), _HalfBlock(), _NormBlock(), torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.out(self.b(self.a(self.inp(x))))


def _hooks_see_full_values(rank, world_size, use_orig_params):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    torch.manual_seed(0)
    base, out = _HookNet(), []
    for lib, extra in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = lib.FullyShardedDataParallel(copy.deepcopy(base), use_orig_params=use_orig_params, **extra,
                                             auto_wrap_policy=lib.wrap.ModuleWrapPolicy({_HalfBlock, _NormBlock}))
            out.append(m.state_dict())
    (ref, ours) = out
    assert list(ref) == list(ours)
    for k in ref:
        if torch.is_tensor(ref[k]):
            assert ours[k].dtype == ref[k].dtype and ours[k].device == ref[k].device and torch.equal(ours[k], ref[k]), k
        else:
            assert ours[k] == ref[k], (k, ours[k], ref[k])
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dict_hooks_and_extra_state_see_full_parameters(ranks, use_orig_params):
    """Module state-dict hooks and get_extra_state run with the unit's full
    parameters (torch gathers each unit in its state-dict pre-hook). A walk
    over placeholders handed them meta tensors or this rank's shard, and a
    non-tensor extra state was refused ('dict' has no attribute 'detach')."""
    assert all(ranks.run(2, _hooks_see_full_values, use_orig_params))


def _load_with_checkpoint_wrappers(rank, world_size, kind, use_orig_params):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    import zeroshard as zs
    from models import Block

    forms = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build("mlp")
        if checkpointed:  # CheckpointWrapper(FSDP(Block)): the wrapper around each unit
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        model = zs.FSDP(model, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with zs.FSDP.state_dict_type(model, getattr(zs.StateDictType, kind)):
                sd = model.state_dict()
                result = model.load_state_dict(sd)  # strict
        forms.append({k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items()})
    # The same keys and forms as without the wrappers (row DTensors, ShardedTensor flat shards).
    assert forms[0] == forms[1], (forms[0], forms[1])
    return tuple(map(list, result))


@pytest.mark.parametrize("kind,use_orig_params", [("FULL_STATE_DICT", False), ("SHARDED_STATE_DICT", False),
                                                  ("LOCAL_STATE_DICT", False), ("LOCAL_STATE_DICT", True)])
def test_load_with_checkpoint_wrappers_is_clean(ranks, kind, use_orig_params):
    """A model's own state dict loads strictly with activation-checkpoint
    wrappers around its units (torch: no missing or unexpected keys), and has
    the form it has without them: the wrapper's hooks drop its name from the
    keys, and zeroshard matched the units' keys with it (SHARDED gave plain
    full tensors, LOCAL plain shards, or with use_orig_params no flat entries)."""
    assert ranks.run(2, _load_with_checkpoint_wrappers, kind, use_orig_params) == [([], [])] * 2


class _LegacyBlock(torch.nn.Module):
    """Renames its checkpoints' old key ('old_lin.*') in a load pre-hook, as
    models that renamed a layer do: the hook sees its own module's keys."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)
        self._register_load_state_dict_pre_hook(self._rename)

    def _rename(self, state_dict, prefix, *args):
        for name in ("weight", "bias"):
            if prefix + "old_lin." + name in state_dict:
                state_dict[prefix + "lin." + name] = state_dict.pop(prefix + "old_lin." + name)

    def forward(self, x):
        return self.lin(x).relu()


class _LegacyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = _LegacyBlock(), _LegacyBlock(), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def _load_hooks_and_summoned(rank, world_size, use_orig_params):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    torch.manual_seed(1)
    new = _LegacyNet().state_dict()
    legacy = {k.replace(".lin.", ".old_lin.") if k[:2] in ("a.", "b.") else k: v for k, v in new.items()}
    seen = []
    for lib, extra in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        torch.manual_seed(0)
        m = lib.FullyShardedDataParallel(_LegacyNet(), use_orig_params=use_orig_params, **extra,
                                         auto_wrap_policy=lib.wrap.ModuleWrapPolicy({_LegacyBlock}))
        result = m.load_state_dict(legacy)  # strict: the blocks' hooks must see their own prefix
        after_legacy = _full(m)
        with lib.FullyShardedDataParallel.summon_full_params(m, writeback=True):
            with torch.no_grad():
                m.load_state_dict({k: v + 1 for k, v in new.items()})
        seen.append((list(map(list, result)), after_legacy, _full(m)))
    (ref, ours) = seen
    assert ours[0] == ref[0] == [[], []]
    for got, want in ((ours[1], ref[1]), (ours[2], ref[2])):
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(ours[1][k], new[k]) for k in new)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_load_pre_hooks_see_their_keys_and_load_inside_summon(ranks, use_orig_params):
    """A module's load pre-hook that renames legacy keys works inside units
    (torch FSDP1 gives each unit's subtree its keys with the wrapper's prefix
    in its load pre-hook; zeroshard renamed the keys up front, so the hook
    never saw 'old_lin.*' under its prefix and the strict load failed), and
    load_state_dict inside summon_full_params loads into the summoned
    parameters, as torch's (zeroshard refused it as a nested summon)."""
    assert all(ranks.run(2, _load_hooks_and_summoned, use_orig_params))


class _Extra(torch.nn.Module):
    """A tensor extra state whose shape changes (set_extra_state takes anything)."""

    def __init__(self, n):
        super().__init__()
        self.lin, self.table = torch.nn.Linear(5, 5), torch.arange(float(n))

    def get_extra_state(self):
        return self.table

    def set_extra_state(self, state):
        self.table = state

    def forward(self, x):
        return self.lin(x)


class _FailingLoad(torch.nn.Linear):
    def __init__(self):
        super().__init__(5, 5)
        self._register_load_state_dict_pre_hook(self._fail)

    def _fail(self, *args):
        raise RuntimeError("user hook failed")


def _load_edges(rank, world_size):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    seen = []
    for lib, extra in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        torch.manual_seed(0)
        m = lib.FullyShardedDataParallel(torch.nn.Sequential(_Extra(3), torch.nn.Linear(5, 2)), **extra,
                                         auto_wrap_policy=lib.wrap.ModuleWrapPolicy({_Extra}))
        sd = _full(m)
        sd["0._extra_state"] = torch.arange(5.0)
        m.load_state_dict(sd)
        table = m.module[0].module.table.clone()
        torch.manual_seed(0)
        f = lib.FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(5, 5), _FailingLoad()), **extra,
                                         auto_wrap_policy=lib.wrap.ModuleWrapPolicy({_FailingLoad}))
        with pytest.raises(RuntimeError, match="user hook failed"):
            f.load_state_dict(_full(f))
        grad_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        f(torch.ones(2, 5)).sum().backward()  # still trains
        seen.append((table, grad_mode, [p.grad.clone() for p in f.parameters()]))
    (ref, ours) = seen
    assert torch.equal(ours[0], ref[0]) and ours[1] is ref[1] is True
    assert all(torch.equal(a, b) for a, b in zip(ours[2], ref[2]))
    return True


def test_tensor_extra_state_of_another_shape_and_a_failing_load_hook(ranks):
    """A tensor extra state of another shape loads, as torch's (zeroshard
    refused it as a shape mismatch); a load that fails inside a user hook in
    a nested unit leaves grad mode on and the model training (closing the
    units' summons outermost first left grad mode off)."""
    assert all(ranks.run(2, _load_edges))


def _parent(lib, layout, strategy, use_orig_params, seed):
    """A plain module holding FSDP roots: a GAN-like ModuleDict of two wrapped
    models beside a plain layer, or a plain model whose blocks alone are wrapped."""
    extra = {"device_id": torch.device("cpu")} if lib.__name__.startswith("torch") else {}
    kw = dict(sharding_strategy=getattr(lib.ShardingStrategy, strategy), use_orig_params=use_orig_params, **extra)
    torch.manual_seed(seed)
    if layout == "blocks":
        model = build("mlp", seed=seed)
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = lib.FullyShardedDataParallel(blk, **kw)
        return model, [model]
    gen, disc = (lib.FullyShardedDataParallel(build("mlp", seed=seed + i), **kw) for i in range(2))
    return torch.nn.ModuleDict({"gen": gen, "disc": disc, "head": torch.nn.Linear(3, 2)}), [gen, disc]


def _load_through_parent(rank, world_size, layout, use_orig_params):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    kinds = ["FULL_STATE_DICT", "SHARDED_STATE_DICT"] + ([] if use_orig_params else ["LOCAL_STATE_DICT"])
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for kind in kinds:
            seen = []
            for lib in (tfsdp, zs):
                src, src_models = _parent(lib, layout, strategy, use_orig_params, seed=0)
                opt = torch.optim.SGD(src.parameters(), lr=0.1)
                for m in src_models:
                    m(batch("mlp", rank, 0)).sum().backward()
                opt.step()
                dst, dst_models = _parent(lib, layout, strategy, use_orig_params, seed=5)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with lib.FullyShardedDataParallel.state_dict_type(src, getattr(lib.StateDictType, kind)):
                        saved = src.state_dict()
                    with lib.FullyShardedDataParallel.state_dict_type(dst, getattr(lib.StateDictType, kind)):
                        result = dst.load_state_dict(saved)
                    full = _full(dst)
                    assert not result.missing_keys and not result.unexpected_keys, (lib.__name__, kind, result)
                    assert list(full) == list(_full(src)) and all(torch.equal(v, _full(src)[k]) for k, v in full.items())
                seen.append((full, [m(batch("mlp", rank, 1)) for m in dst_models]))
            (sd_t, out_t), (sd_z, out_z) = seen
            assert list(sd_t) == list(sd_z) and all(torch.equal(sd_t[k], sd_z[k]) for k in sd_t), (strategy, kind)
            assert all(torch.equal(a, b) for a, b in zip(out_t, out_z)), (strategy, kind)
    # strict=False reports what the parent's load reports under torch: the plain model's keys
    reports = []
    for lib in (tfsdp, zs):
        parent, _ = _parent(lib, layout, "FULL_SHARD", use_orig_params, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sd = _full(parent)
            key = next(k for k in sd if "blocks.1." in k)
            del sd[key]
            sd[key.rsplit(".", 1)[0] + ".bogus"], sd["bogus"] = torch.zeros(1), torch.zeros(1)
            result = parent.load_state_dict(sd, strict=False)
            with pytest.raises(RuntimeError) as err:
                parent.load_state_dict(sd)
        reports.append((result.missing_keys, sorted(result.unexpected_keys), str(err.value)))
    assert reports[0] == reports[1] and reports[0][0] == [key], reports
    return True


@pytest.mark.parametrize("layout", ["moduledict", "blocks"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_load_state_dict_through_a_plain_parent(ranks, layout, use_orig_params):
    """nn.Module.load_state_dict on a plain module holding FSDP roots (a GAN's
    two wrapped models in a ModuleDict, or a model whose blocks alone are
    wrapped) loads every unit, FULL, SHARDED and LOCAL, and reports missing and
    unexpected keys as torch FSDP1 does (zeroshard's units ignored a parent's
    walk: nothing loaded, every key reported missing and unexpected)."""
    assert all(ranks.run(2, _load_through_parent, layout, use_orig_params))


def _dcp_state_dict_helpers(rank, world_size, use_orig_params):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)

    import zeroshard as zs

    for full in (True, False):
        options = StateDictOptions(full_state_dict=full)
        models = _engines(use_orig_params=use_orig_params)
        for m in models:
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            m(batch("mlp", rank, 0)).sum().backward()
            opt.step()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if isinstance(m, zs.FSDP):
                    for call in (lambda: get_state_dict(m, opt, options=options), lambda: get_model_state_dict(m),
                                 lambda: set_state_dict(m, opt, model_state_dict={}, optim_state_dict={})):
                        with pytest.raises(RuntimeError, match="does not recognize zeroshard's units.*Fix: "):
                            call()
                    parent = torch.nn.ModuleDict({"gen": m})  # reached through a plain parent too
                    with pytest.raises(RuntimeError, match="does not recognize zeroshard's units"):
                        get_model_state_dict(parent)
                else:  # torch FSDP1, for comparison: the helpers know it
                    msd, osd = get_state_dict(m, opt, options=options)
                    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_torch_dcp_state_dict_helpers_are_refused_clearly(ranks, use_orig_params):
    """torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict
    test for torch's FSDP class; taking zeroshard's units for plain modules,
    they saved each rank's optimizer shards as whole ones, returned flat-param
    keys, and failed to load their own output (unexpected '_flat_param' keys).
    They now raise, naming the zeroshard route, on a unit or a plain parent."""
    assert all(ranks.run(2, _dcp_state_dict_helpers, use_orig_params))


def _subclass_loading_itself(rank, world_size):
    import zeroshard as zs

    class Mine(zs.FSDP):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            return torch.nn.Module.load_state_dict(self, state_dict, strict=strict)

    model = Mine(build("mlp"))
    with pytest.raises(RuntimeError, match="calls nn.Module.load_state_dict on itself"):
        model.load_state_dict(_full(model))  # was a RecursionError
    return True


def test_a_subclass_loading_through_nn_module_is_told_how(ranks):
    assert all(ranks.run(2, _subclass_loading_itself))


class _NeedsItsWeight(torch.nn.Linear):
    """Reads its own weight key unconditionally while loading (legacy-format code does)."""

    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict[prefix + "weight"]  # KeyError if this module is handed a dict without its keys
        super()._load_from_state_dict(state_dict, prefix, *args)


def _parent_walks_units_once(rank, world_size, kind):
    import torch.distributed.fsdp as tfsdp

    import zeroshard as zs

    calls = []
    for lib, extra in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        made = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            inner = torch.nn.Sequential(torch.nn.Linear(4, 6), _NeedsItsWeight(6, 3))
            inner[0]._register_load_state_dict_pre_hook(lambda *a, lib=lib: calls.append(lib.__name__))
            made.append(torch.nn.ModuleDict({"g": lib.FullyShardedDataParallel(inner, **extra)}))
        src, dst = made
        with lib.FullyShardedDataParallel.state_dict_type(src, getattr(lib.StateDictType, kind)):
            sd = src.state_dict()
        with lib.FullyShardedDataParallel.state_dict_type(dst, getattr(lib.StateDictType, kind)):
            result = dst.load_state_dict(sd)
        assert not result.missing_keys and not result.unexpected_keys, result
        assert all(torch.equal(a, b) for a, b in zip(_full(src).values(), _full(dst).values()))
    return calls


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_a_parent_load_walks_each_unit_once(ranks, kind):
    """Through a plain parent, the modules inside a unit are loaded once, as
    under torch FSDP1: the parent's walk used to go on into the unit after it
    had loaded, calling their hooks a second time with no keys (a module that
    reads its own key raised KeyError, a post-hook saw '_flat_param' missing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for calls in ranks.run(2, _parent_walks_units_once, kind):
            assert calls.count("torch.distributed.fsdp") == 1 and calls.count("zeroshard") == 1, calls


class _ViewBlock(torch.nn.Module):
    """Its state-dict hook adds a view of a full parameter (export code does)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)
        self._register_state_dict_hook(lambda mod, sd, prefix, meta: sd.__setitem__(
            prefix + "l2_t", sd[prefix + "l2.weight"].t()))

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


def _hook_views_survive_the_gather(rank, world_size, offload):
    import zeroshard as zs

    torch.manual_seed(0)
    base = torch.nn.Sequential(_ViewBlock(), _ViewBlock())
    plain = base.state_dict()
    m = zs.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({_ViewBlock}))
    cfg = zs.FullStateDictConfig(offload_to_cpu=offload, rank0_only=False)
    with zs.FullyShardedDataParallel.state_dict_type(m, zs.StateDictType.FULL_STATE_DICT, cfg):
        sd = m.state_dict()
    assert list(sd) == list(plain)
    for k, v in sd.items():  # a view left on the freed gather buffer has 0 bytes behind it
        assert v.untyped_storage().nbytes() >= v.numel() * v.element_size() and torch.equal(v, plain[k]), k
    return True


@pytest.mark.parametrize("offload", [False, True])
def test_state_dict_hook_views_are_copied_with_offload_on_cpu(ranks, offload):
    """With offload_to_cpu on a CPU model, a hook's view of a full parameter was kept
    as .cpu() of itself: a view of the unit's all-gather buffer, freed right after
    (torch.load of the saved file then failed; reading it could segfault). torch FSDP1
    itself crashes on such hooks, so the reference is the plain model's state dict."""
    assert all(ranks.run(2, _hook_views_survive_the_gather, offload))


def _key_missing_on_one_rank(rank, world_size):
    import zeroshard as zs

    model = zs.FSDP(build("mlp", seed=0), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    before = _full(model)
    sd = build("mlp", seed=5).state_dict()
    if rank == 1:
        del sd["out.weight"]
    with pytest.raises(RuntimeError, match=r"hold different state dict keys .*'out.weight'.*Fix"):
        model.load_state_dict(sd)
    after = _full(model)
    return all(torch.equal(before[k], after[k]) for k in before)


def test_a_key_missing_on_one_rank_is_refused_on_every_rank_before_loading(ranks):
    """Rank 1 raised torch's 'Missing key(s)' while rank 0 reported success,
    and out.weight was left half old, half new (torch FSDP1 too). Now every
    rank refuses before anything is loaded."""
    assert all(ranks.run(2, _key_missing_on_one_rank))


def _local_load_damaged_on_one_rank(rank, world_size, use_orig_params):
    import zeroshard as zs

    model = zs.FSDP(build("mlp", seed=0), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    source = zs.FSDP(build("mlp", seed=5), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    with zs.FSDP.state_dict_type(source, zs.StateDictType.LOCAL_STATE_DICT):
        sd = source.state_dict()
    if rank == 1:
        sd["blocks.2._flat_param"] = torch.zeros(3)  # the last unit's entry: the others would load first
    before = _full(model)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.LOCAL_STATE_DICT):
        with pytest.raises((ValueError, RuntimeError), match="blocks.2._flat_param"):
            model.load_state_dict(sd)
    after = _full(model)
    return all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_local_load_that_fails_on_one_rank_loads_nothing_anywhere(ranks, use_orig_params):
    """A damaged LOCAL entry on rank 1: 12 of 16 parameters were overwritten
    before it raised there, and rank 0 returned with its part loaded (torch
    FSDP1 too). Every entry is now checked, on every rank, before any write."""
    assert all(ranks.run(2, _local_load_damaged_on_one_rank, use_orig_params))


def _full_dict_under_local(rank, world_size):
    import zeroshard as zs

    model = zs.FSDP(build("mlp", seed=0), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    full = build("mlp", seed=5).state_dict()
    with zs.FSDP.state_dict_type(model, zs.StateDictType.LOCAL_STATE_DICT):
        with pytest.raises(RuntimeError) as e:
            model.load_state_dict(full)
    return str(e.value)


def test_a_full_dict_loaded_under_local_names_the_state_dict_type(ranks):
    """A FULL state dict loaded under LOCAL_STATE_DICT was told 'or pass
    strict=False', which loads none of it."""
    for msg in ranks.run(2, _full_dict_under_local):
        assert "this is a FULL or SHARDED state dict" in msg and "state_dict_type it was saved with" in msg, msg


def _local_kept_and_summoned(rank, world_size, strategy):
    import zeroshard as zs

    F, LOCAL = zs.FullyShardedDataParallel, zs.StateDictType.LOCAL_STATE_DICT
    src = build("mlp", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = _wrap("zeroshard", copy.deepcopy(src), {**DEFAULTS, "strategy": strategy, "use_orig_params": True})
        fresh = _wrap("zeroshard", copy.deepcopy(src), {**DEFAULTS, "strategy": strategy, "use_orig_params": True})
    with F.state_dict_type(m, LOCAL):
        idle = {k: v.clone() if torch.is_tensor(v) and not hasattr(v, "local_shards") else v
                for k, v in m.state_dict().items()}
    idle_shapes = {k: tuple(v.shape) for k, v in idle.items() if torch.is_tensor(v)}
    out = m(batch("mlp", rank, 0))  # grad mode, backward still to come: units kept gathered
    with F.state_dict_type(m, LOCAL):
        kept = m.state_dict()
    assert {k: tuple(v.shape) for k, v in kept.items() if torch.is_tensor(v)} == idle_shapes
    with F.state_dict_type(fresh, LOCAL):
        fresh.load_state_dict(kept)  # used to raise: "'...weight' has shape (8, 8) but the model's is (36,)"
    with F.state_dict_type(m, LOCAL):
        m.load_state_dict(idle)  # into the kept units themselves: refused with the same error before
    del out  # its backward would fail as a plain model's does: the load wrote into tensors it saved
    m(batch("mlp", rank, 1)).float().pow(2).mean().backward()
    fresh(batch("mlp", rank, 1)).float().pow(2).mean().backward()
    for model in (m, fresh):
        with F.summon_full_params(model), F.state_dict_type(model, LOCAL):
            for call in (model.state_dict, lambda: model.load_state_dict(idle)):
                with pytest.raises(RuntimeError, match="inside summon_full_params"):
                    call()  # returned full tensors and no flat shard, a dict nothing loads
    with F.summon_full_params(m), F.summon_full_params(fresh):
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), fresh.parameters()))
    return True


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "FULL_SHARD"])
def test_local_state_dict_with_kept_units_and_inside_summon(ranks, strategy):
    """use_orig_params units kept gathered after a forward (every unit under ZeRO-2, the
    root under ZeRO-3) showed their full parameters, so a LOCAL state_dict() saved full
    tensors (as torch FSDP1 does) that no LOCAL load accepts, and a LOCAL load into them
    refused a good dict. Inside summon_full_params a LOCAL dict was neither LOCAL nor
    loadable (torch raises a ShardedTensor offset error); both calls are refused there."""
    assert all(ranks.run(2, _local_kept_and_summoned, strategy))


def _type_set_on_an_inner_unit(rank, world_size):
    import zeroshard as zs

    model = zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    inner = next(u for u in zs.FSDP.fsdp_modules(model) if u is not model)
    model(batch("mlp", rank, 0)).sum().backward()
    errors = []
    for kind in (zs.StateDictType.SHARDED_STATE_DICT, zs.StateDictType.LOCAL_STATE_DICT):
        with zs.FSDP.state_dict_type(inner, kind):
            for call in (model.state_dict, lambda: model.load_state_dict(_full(model))):
                try:
                    call()
                    errors.append(None)
                except RuntimeError as e:
                    errors.append(str(e))
    return errors


def test_a_state_dict_type_set_on_an_inner_unit_is_refused(ranks):
    """FSDP.state_dict_type(inner_unit, SHARDED/LOCAL) then model.state_dict(): the root's type
    was used for every unit, silently (a FULL dict where the user asked for shards of that unit;
    torch FSDP1 mixes the forms)."""
    for errors in ranks.run(2, _type_set_on_an_inner_unit):
        assert len(errors) == 4
        for msg in errors:
            assert msg and "have different state dict settings" in msg and "on the root" in msg, msg


def _sharded_dict_under_full(rank, world_size):
    import zeroshard as zs

    model = zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    with zs.FSDP.state_dict_type(model, zs.StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    try:
        model.load_state_dict(sharded)  # under the default FULL_STATE_DICT
    except ValueError as e:
        return str(e)
    return None


def test_a_sharded_dict_loaded_under_full_names_the_state_dict_type(ranks):
    """It failed key by key with aten.copy_'s 'got mixed torch.Tensor and DTensor' (torch too)."""
    for msg in ranks.run(2, _sharded_dict_under_full):
        assert msg and "under FULL_STATE_DICT got a sharded entry" in msg and "SHARDED_STATE_DICT)" in msg, msg
