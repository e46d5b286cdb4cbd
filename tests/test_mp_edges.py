"""Mixed-precision and wrapping edges compared with torch FSDP1 on gloo ranks
(found by a side-by-side review of hybrid sharding and mixed precision):
what the root hands its module (torch's ``_to_kwargs`` container rules),
which units cast inputs, ignored modules' buffers under ``buffer_dtype``,
``FSDP_USE_FULL_PREC_IN_EVAL=1``, and settings torch refuses (nested units
that disagree, ``process_group`` with ``device_mesh``, LOCAL with a mesh)."""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import os
import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.distributed.fsdp.wrap as twrap
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import zeroshard as zs
from models import Block

ENGINES = {"torch": (tfsdp, twrap, {"device_id": torch.device("cpu")}), "zeroshard": (zs, zs.wrap, {})}


def _fsdp(engine, module, **kw):
    lib, _, extra = ENGINES[engine]
    if "sharding_strategy" in kw:
        kw["sharding_strategy"] = getattr(lib.ShardingStrategy, kw["sharding_strategy"])
    if isinstance(kw.get("mixed_precision"), dict):
        kw["mixed_precision"] = lib.MixedPrecision(**kw["mixed_precision"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib.FullyShardedDataParallel(module, **extra, **kw)


# ------------------------------------------------------------ root inputs
NT = collections.namedtuple("NT", "a b")


class MyDict(dict):
    pass


class MyTuple(tuple):
    pass


class MyList(list):
    pass


@dataclasses.dataclass
class DC:
    a: torch.Tensor
    n: int = 3


@dataclasses.dataclass
class DCNoInit:
    a: torch.Tensor
    b: torch.Tensor = dataclasses.field(init=False, default=None)


def summary(o) -> str:
    """What a module received: container classes and tensor dtypes."""
    if torch.is_tensor(o):
        return f"T[{o.dtype}]"
    if isinstance(o, PackedSequence):
        return f"Packed[{o.data.dtype}]"
    if dataclasses.is_dataclass(o):
        return f"{type(o).__name__}({', '.join(summary(getattr(o, f.name)) for f in dataclasses.fields(o))})"
    if isinstance(o, dict):
        return f"{type(o).__name__}{{{', '.join(f'{k}: {summary(v)}' for k, v in o.items())}}}"
    if isinstance(o, (list, tuple, set)):
        items = sorted(map(summary, o)) if isinstance(o, set) else list(map(summary, o))
        return f"{type(o).__name__}({', '.join(items)})"
    return f"{type(o).__name__}:{o!r}"


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, arg, kw=None):
        self.seen = (summary(arg), summary(kw))
        if isinstance(arg, list):
            arg.append("appended")  # the caller's list must not see it (torch hands on a copy)
        return self.lin(x.to(self.lin.weight.dtype))


def _inputs():
    t = torch.ones(2, 4)
    return {
        "scalars": [3, True, torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.float64)],
        "set": {t.clone()},
        "dict_subclass": MyDict(a=t.clone()),
        "ordered_dict": collections.OrderedDict(a=t.clone()),
        "defaultdict": collections.defaultdict(list, a=t.clone()),
        "tuple_subclass": MyTuple([t.clone()]),
        "size": torch.Size([2, 4]),
        "list_subclass": MyList([t.clone()]),
        "namedtuple": NT(t.clone(), 1),
        "packed": pack_padded_sequence(torch.ones(3, 2, 4), [3, 2]),
        "dataclass": DC(t.clone()),
        "dataclass_init_false": DCNoInit(t.clone()),
        "list": [t.clone()],
        "empty": (),
    }


def _root_inputs(rank, world_size):
    for mp in (None, {"param_dtype": torch.bfloat16}):
        torch.manual_seed(0)
        base = Recorder()
        models = [_fsdp(e, copy.deepcopy(base), mixed_precision=mp) for e in ENGINES]
        for name in _inputs():
            seen = []
            for m in models:
                arg = _inputs()[name]
                try:
                    m(torch.ones(2, 4), arg, kw=arg)
                    seen.append((m.module.seen, summary(arg)))
                except (TypeError, ValueError) as e:
                    seen.append(type(e).__name__)
            assert seen[0] == seen[1], (mp, name, seen)
    return True


def test_root_inputs_reach_the_module_as_under_torch(ranks):
    """Containers rebuilt (lists copied, tuple / list subclasses and torch.Size
    made plain, dict subclasses kept) and, under mixed precision, cast as
    torch casts them: sets too, PackedSequence not; the same errors where
    torch fails (a defaultdict, a dataclass with an init=False field)."""
    assert all(ranks.run(2, _root_inputs))


# ------------------------------------------------------- which units cast
class Scale(nn.Module):  # no parameters of its own
    def forward(self, x):
        self.seen = x.dtype
        return x * 2


class TwoParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(4, 4), Scale()

    def forward(self, x):
        self.seen = x.dtype
        return self.lin(x.to(self.lin.weight.dtype)).float() + self.scale(x.float())


def _cast_inputs(rank, world_size):
    torch.manual_seed(0)
    base, x = TwoParts(), torch.randn(2, 4)
    for cast_root in (False, True):
        res = []
        for engine in ENGINES:
            mp = {"param_dtype": torch.bfloat16, "cast_forward_inputs": True, "cast_root_forward_inputs": cast_root}
            net = copy.deepcopy(base)
            net.lin, net.scale = _fsdp(engine, net.lin, mixed_precision=mp), _fsdp(engine, net.scale, mixed_precision=mp)
            m = _fsdp(engine, net, mixed_precision=mp)
            y = m(x)
            res.append((m.module.seen, m.module.scale.module.seen, y))
        (ra, sa, ya), (rb, sb, yb) = res
        assert (ra, sa) == (rb, sb) and torch.equal(ya, yb), (cast_root, res)
        assert sb == torch.float32 and rb == (torch.bfloat16 if cast_root else torch.float32)
    return True


def test_cast_forward_inputs_only_in_units_with_parameters(ranks):
    """torch FSDP1 casts a unit's inputs only if the unit has a FlatParameter:
    neither a parameter-free unit nor a root whose parameters all sit in nested units."""
    assert all(ranks.run(2, _cast_inputs))


# ------------------------------------------------------- ignored buffers
class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.scale


class WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 4), Norm(4)
        self.register_buffer("root_buf", torch.ones(4))

    def forward(self, x):
        return self.norm(self.lin(x)).float() * self.root_buf


def _ignored_buffers(rank, world_size, how):
    torch.manual_seed(0)
    base, x = WithNorm(), torch.randn(2, 4)
    res = []
    for engine in ENGINES:
        net = copy.deepcopy(base)
        m = _fsdp(engine, net, mixed_precision={"buffer_dtype": torch.bfloat16}, **{how: [net.norm]})
        y = m(x)
        sd = m.state_dict()
        res.append((net.norm.scale.dtype, net.root_buf.dtype, sd["norm.scale"].dtype, sd["root_buf"].dtype, y))
    assert res[0][:4] == res[1][:4] == (torch.float32, torch.bfloat16, torch.float32, torch.float32), res
    assert torch.equal(res[0][4], res[1][4])
    return True


@pytest.mark.parametrize("how", ["ignored_modules", "ignored_states"])
def test_buffer_dtype_leaves_ignored_modules_buffers(ranks, how):
    assert all(ranks.run(2, _ignored_buffers, how))


# ------------------------------------ state-dict buffers are copies, as torch
class Counted(nn.Module):
    """An int counter, a float buffer and BatchNorm statistics: all change every step."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.count += 1
        with torch.no_grad():
            self.ema.add_(1.0)
        return self.bn(self.lin(x))


def _buffers_after_another_step(rank, world_size, wrap, sd_type, buffer_dtype):
    mp = {"param_dtype": torch.bfloat16} | ({"buffer_dtype": torch.bfloat16} if buffer_dtype else {})
    x, seen = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)), {}
    for engine, (lib, wrap_lib, _) in ENGINES.items():
        torch.manual_seed(0)
        kw = {"auto_wrap_policy": wrap_lib.ModuleWrapPolicy({Counted})} if wrap else {}
        m = _fsdp(engine, nn.Sequential(Counted(), Counted()), mixed_precision=mp, **kw)
        m(x).float().sum().backward()
        with lib.FullyShardedDataParallel.state_dict_type(m, getattr(lib.StateDictType, sd_type)):
            sd = m.state_dict()
        m(x).float().sum().backward()  # moves every buffer in place
        seen[engine] = {k: v for k, v in sd.items() if k.split(".")[-1] in
                        ("count", "ema", "running_mean", "running_var", "num_batches_tracked")}
    assert seen["torch"].keys() == seen["zeroshard"].keys() and len(seen["torch"]) == 10
    return {k: (v.dtype == seen["zeroshard"][k].dtype and torch.equal(v, seen["zeroshard"][k]))
            for k, v in seen["torch"].items()}


@pytest.mark.parametrize("sd_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@pytest.mark.parametrize("wrap,buffer_dtype", [(False, True), (True, True), (True, False)])
def test_state_dict_buffers_do_not_move_on_with_training_as_torch(ranks, sd_type, wrap, buffer_dtype):
    """With buffer_dtype, torch FSDP1's state dict holds clones of the buffers (int
    counters and BatchNorm statistics in a unit of their own too); zeroshard's
    entries were the live buffers, so a dict kept in memory moved on with training.
    Without it both hand out the live buffers, as nn.Module does."""
    for got in ranks.run(2, _buffers_after_another_step, wrap, sd_type, buffer_dtype):
        assert all(got.values()), got


# ------------------------------------------- FSDP_USE_FULL_PREC_IN_EVAL=1
class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(d, 16)
        self.blocks = nn.ModuleList(Block(16, 24) for _ in range(2))
        self.out = nn.Linear(16, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        h = self.inp(x) * self.scale.to(x.dtype)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _full_prec_in_eval(rank, world_size, strategy, use_orig_params, keep_low):
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16, "buffer_dtype": torch.bfloat16,
          "keep_low_precision_grads": keep_low}
    torch.manual_seed(0)
    base = Net()
    x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * s + rank)) for s in range(4)]
    seen = []
    for engine in ENGINES:
        with _env("FSDP_USE_FULL_PREC_IN_EVAL", "1"):
            m = _fsdp(engine, copy.deepcopy(base), mixed_precision=mp, sharding_strategy=strategy,
                      use_orig_params=use_orig_params, auto_wrap_policy=ENGINES[engine][1].ModuleWrapPolicy({Block}))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        trace = []

        def step(inp):
            y = m(inp)
            y.float().pow(2).mean().backward()
            trace.append([None if p.grad is None else (p.grad.dtype, p.grad.clone()) for p in m.parameters()])
            opt.step()
            opt.zero_grad()
            trace.append([y.dtype, m.module.scale.dtype])

        step(x[0])  # train: bf16
        m.eval()
        with torch.no_grad():
            y = m(x[1])
        trace.append([y.dtype, y, m.module.scale.dtype])  # eval: fp32 output, fp32 buffers
        step(x[2])  # a backward in eval mode: full-precision reduction
        m.train()
        step(x[3])  # train again: bf16 buffers
        trace.append([p.detach().clone() for p in m.parameters()])
        m(x[0])  # a forward with no backward: the root (SHARD_GRAD_OP: every unit) stays gathered in bf16,
        m.eval()
        with torch.no_grad():
            y = m(x[1])
        trace.append([y.dtype, y])  # and eval gathers it again in fp32 (torch breaks at a later backward: not tested)
        seen.append(trace)
    assert seen[0][2][0] == torch.float32 and seen[0][2][2] == torch.float32  # torch really ran eval in fp32
    for a, b in zip(*seen):
        for u, v in zip(a, b):
            if torch.is_tensor(u):
                assert u.dtype == v.dtype and torch.equal(u, v)
            elif isinstance(u, tuple):
                assert u[0] == v[0] and torch.equal(u[1], v[1])
            else:
                assert u == v
    return True


@pytest.mark.parametrize("strategy,use_orig_params,keep_low", [
    ("FULL_SHARD", False, False), ("SHARD_GRAD_OP", True, False), ("NO_SHARD", False, True), ("FULL_SHARD", True, True)])
def test_full_precision_in_eval(ranks, strategy, use_orig_params, keep_low):
    """torch FSDP1's FSDP_USE_FULL_PREC_IN_EVAL=1: eval forwards (and backwards)
    run in fp32 with fp32 buffers, then training goes back to bf16; outputs,
    gradients and parameters equal torch's throughout."""
    assert all(ranks.run(2, _full_prec_in_eval, strategy, use_orig_params, keep_low))


# ------------------------------------------------------ refused settings
def _refusals(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed as dist

    for engine in ENGINES:
        for attr in ("use_orig_params", "limit_all_gathers"):
            net = nn.Sequential(Block(4, 8), Block(4, 8))
            net[0] = _fsdp(engine, net[0], **{attr: True})
            m = _fsdp(engine, net, **{attr: False})
            with pytest.raises(ValueError, match="homogeneous" if engine == "torch" else f"disagree on {attr}"):
                m(torch.ones(2, 4))
        mesh = init_device_mesh("cpu", (world_size,))
        with pytest.raises(ValueError, match="process_group and device_mesh"):
            _fsdp(engine, Block(4, 8), process_group=dist.group.WORLD, device_mesh=mesh)
        lib = ENGINES[engine][0]
        m = _fsdp(engine, Block(4, 8), device_mesh=mesh)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with lib.FullyShardedDataParallel.state_dict_type(m, lib.StateDictType.LOCAL_STATE_DICT):
            for call in (m.state_dict, lambda: m.load_state_dict({}), lambda: lib.FullyShardedDataParallel.optim_state_dict(m, opt)):
                with pytest.raises(RuntimeError, match="LOCAL_STATE_DICT"):
                    call()
    return True


def test_settings_torch_refuses_are_refused(ranks):
    """Nested units disagreeing on use_orig_params / limit_all_gathers,
    process_group with device_mesh, and LOCAL_STATE_DICT with a device_mesh."""
    assert all(ranks.run(2, _refusals))


# ------------------------------------------------ LOCAL state dicts and summon under mixed precision
def _local_buffers(rank, world_size, root_strategy, block_strategy):
    from models import MLP, batch

    seen = []
    for engine, (lib, wrap_lib, _) in ENGINES.items():
        torch.manual_seed(0)
        model = MLP()
        for b in model.blocks:
            b.register_buffer("bscale", torch.linspace(0.9, 1.1, 7))
        policy = wrap_lib.CustomPolicy(
            lambda m: {"sharding_strategy": getattr(lib.ShardingStrategy, block_strategy)} if isinstance(m, Block) else False)
        m = _fsdp(engine, model, auto_wrap_policy=policy, sharding_strategy=root_strategy,
                  mixed_precision=dict(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
        m(batch("mlp", rank, 0)).float().pow(2).mean().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with lib.FullyShardedDataParallel.state_dict_type(m, lib.StateDictType.LOCAL_STATE_DICT):
                sd = m.state_dict()
        seen.append({k: v for k, v in sd.items() if "scale" in k})
    ref, ours = seen
    assert list(ref) == list(ours)
    return {k: (str(ours[k].dtype), ref[k].dtype == ours[k].dtype and torch.equal(ref[k], ours[k])) for k in ref}


@pytest.mark.parametrize("root_strategy,block_strategy", [("FULL_SHARD", "NO_SHARD"), ("NO_SHARD", "FULL_SHARD")])
def test_local_state_dict_buffers_under_buffer_dtype_as_torch(ranks, root_strategy, block_strategy):
    """torch saves a NO_SHARD unit through its FULL hook, which casts buffer_dtype
    buffers back in the unit's whole subtree; zeroshard saved them in bf16."""
    for got in ranks.run(2, _local_buffers, root_strategy, block_strategy):
        assert all(same for _, same in got.values()), got
        assert got["blocks.0.bscale"][0] == "torch.float32", got


def _summon_low_precision_grads(rank, world_size):
    from models import MLP, batch

    seen = []
    for engine in ENGINES:
        torch.manual_seed(0)
        m = _fsdp(engine, MLP(), sharding_strategy="NO_SHARD", use_orig_params=True,
                  mixed_precision=dict(param_dtype=torch.float16, keep_low_precision_grads=True))
        m(batch("mlp", rank, 0)).float().pow(2).mean().backward()
        with ENGINES[engine][0].FullyShardedDataParallel.summon_full_params(m, with_grads=True):
            seen.append([(p.dtype, None if p.grad is None else p.grad.clone()) for p in m.parameters()])
    for (da, ga), (db, gb) in zip(*seen):
        assert da == db == torch.float32 and (ga is None) == (gb is None)
        assert ga is None or (ga.dtype == gb.dtype == torch.float16 and torch.equal(ga, gb))
    return True


def test_summon_with_grads_shows_low_precision_grads_as_torch(ranks):
    """NO_SHARD + use_orig_params + keep_low_precision_grads: zeroshard raised on
    assigning the fp16 gradient to the fp32 parameter."""
    assert ranks.run(2, _summon_low_precision_grads) == [True, True]


# ------------------------------------------- a buffer reassigned in forward
class EMANorm(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.ema = self.ema * 0.9 + y.detach().mean(0).to(self.ema.dtype) * 0.1  # a new tensor, not in place
        return y - self.ema


def _reassigned_buffer(rank, world_size):
    mp = {"param_dtype": torch.bfloat16, "buffer_dtype": torch.bfloat16}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    seen = []
    for engine in ENGINES:
        torch.manual_seed(0)
        with _env("FSDP_USE_FULL_PREC_IN_EVAL", "1"):
            m = _fsdp(engine, nn.Sequential(EMANorm(), EMANorm()), mixed_precision=mp,
                      auto_wrap_policy=ENGINES[engine][1].ModuleWrapPolicy({EMANorm}))
        m(x).float().sum().backward()
        sd = {k: v.clone() for k, v in m.state_dict().items() if k.endswith("ema")}
        m.eval()
        with torch.no_grad():
            y = m(torch.ones(4, 6))
        seen.append((sd, y))
    (sd_ref, y_ref), (sd, y) = seen
    assert list(sd) == list(sd_ref) and all(v.dtype == torch.float32 for v in sd.values())
    assert all(torch.equal(sd[k], sd_ref[k]) for k in sd) and y.dtype == y_ref.dtype and torch.equal(y, y_ref)
    return True


def test_a_buffer_reassigned_in_forward_keeps_its_original_dtype(ranks):
    """buffer_dtype=bf16 and a module that reassigns its buffer (an EMA): the
    original dtype was remembered on the tensor, which the reassignment
    replaced, so the state dict returned bf16 (torch: fp32) and an eval forward
    under FSDP_USE_FULL_PREC_IN_EVAL=1 used the bf16 buffer (other outputs).
    torch remembers it by buffer name; so does zeroshard now."""
    assert all(ranks.run(2, _reassigned_buffer))


class Ids(nn.Module):
    """A frozen integer parameter (token ids, a permutation), read as indices."""

    def __init__(self):
        super().__init__()
        self.ids = nn.Parameter(torch.tensor([3, 257, 1001, 4099]), requires_grad=False)

    def forward(self, x):
        self.seen = self.ids.detach().clone()
        return x + self.ids.to(x.dtype).sum() * 0


class Phase(nn.Module):
    """A complex weight (a learned phase), trained."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j, 0.5j, 2 + 0j], dtype=torch.complex64))

    def forward(self, x):
        self.seen = self.w.detach().clone()
        return (x.to(torch.complex64) * self.w).real


def _non_float_units(rank, world_size, use_orig_params):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Ids(), Phase())
    ids, w = model[1].ids.clone(), model[2].w.detach().clone()
    model = zs.FSDP(model, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Ids, Phase}), use_orig_params=use_orig_params,
                    mixed_precision=zs.MixedPrecision(param_dtype=torch.bfloat16))
    model(torch.randn(2, 4)).sum().backward()
    inner = [m for m in model.modules() if isinstance(m, (Ids, Phase))]
    norm = model.clip_grad_norm_(1.0)
    return (torch.equal(inner[0].seen, ids), torch.equal(inner[1].seen, w), norm.dtype == torch.float32 and norm.isfinite().item())


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_integer_and_complex_units_stay_out_of_mixed_precision(ranks, use_orig_params):
    """MixedPrecision(param_dtype=bf16) cast them with the float units: ids [3, 257, 1001, 4099]
    computed as [3, 256, 1000, 4096], a complex weight lost its imaginary part (torch FSDP1
    refuses such units). clip_grad_norm_ over a complex gradient failed in vector_norm."""
    assert ranks.run(2, _non_float_units, use_orig_params) == [(True, True, True)] * 2


class _ScaledInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 1.0 + 2 ** -12))  # 1.0 in bf16

    def forward(self, x):
        self.seen = self.scale.dtype
        return self.lin(x) * self.scale


class _PermutedRoot(nn.Module):
    """The root's only own parameter is a frozen integer permutation."""

    def __init__(self):
        super().__init__()
        self.perm = nn.Parameter(torch.tensor([2, 0, 3, 1]), requires_grad=False)
        self.inner = _ScaledInner()

    def forward(self, x):
        return self.inner(x[:, self.perm])


def _full_precision_eval_buffers(rank, world_size, cast_in_eval):
    torch.manual_seed(0)
    with _env("FSDP_USE_FULL_PREC_IN_EVAL", "1"):
        m = zs.FSDP(_PermutedRoot(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({_ScaledInner}),
                    mixed_precision=zs.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
        m(torch.randn(2, 4)).float().sum().backward()
        m.zero_grad(set_to_none=True)
        m.eval()
        with torch.no_grad():
            m(torch.randn(2, 4))
        seen = [m.module.inner.seen]
        if cast_in_eval:  # a cast while the buffers are in their own dtype
            m.double()
            with torch.no_grad():
                m(torch.randn(2, 4, dtype=torch.float64))
            seen.append(m.module.inner.seen)
            with zs.FSDP.state_dict_type(m, zs.StateDictType.FULL_STATE_DICT):
                sd = m.state_dict()
            seen.append((sd["inner.lin.weight"].dtype, sd["inner.scale"].dtype))
    return seen


def test_full_precision_eval_with_an_integer_root(ranks):
    """The root unit (integer, outside mixed precision) decided for the model: its eval left
    the inner unit's buffer in bf16 beside fp32 weights (1 + 2**-12 became 1.0)."""
    assert ranks.run(2, _full_precision_eval_buffers, False) == [[torch.float32]] * 2
    # model.double() in eval: the buffer was used in fp32 beside fp64 weights, and saved in fp32
    assert ranks.run(2, _full_precision_eval_buffers, True) == \
        [[torch.float32, torch.float64, (torch.float64, torch.float64)]] * 2


class _ScaledBlock(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x + self.lin(x) * self.scale


def _buffer_dtype_under_checkpoint_wrapper(rank, world_size, own_unit):
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    dicts = []
    for lib, extra in ((tfsdp, {"device_id": torch.device("cpu")}), (zs, {})):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 6), _ScaledBlock(), nn.Linear(6, 3))
        kw = dict(auto_wrap_policy=lib.wrap.ModuleWrapPolicy({_ScaledBlock})) if own_unit else {}
        m = lib.FullyShardedDataParallel(net, mixed_precision=lib.MixedPrecision(param_dtype=torch.bfloat16,
                                                                                  buffer_dtype=torch.bfloat16), **kw, **extra)
        apply_activation_checkpointing(m, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper),
                                       check_fn=lambda mod: isinstance(mod, _ScaledBlock))
        m(torch.randn(4, 5)).float().sum().backward()
        dicts.append(m.state_dict())
    ref, ours = dicts
    assert list(ref) == list(ours)
    for k in ref:
        assert ref[k].dtype == ours[k].dtype and torch.equal(ref[k], ours[k]), (k, ref[k].dtype, ours[k].dtype)
    return True


@pytest.mark.parametrize("own_unit", [False, True])
def test_buffer_dtype_buffers_under_a_checkpoint_wrapper_save_in_their_own_dtype(ranks, own_unit):
    """The wrapper's hook drops '_checkpoint_wrapped_module.' from the keys, so the lookup of the
    buffers' original dtypes missed them: saved in bf16 where torch saves fp32 (the fuzz's finding)."""
    assert all(ranks.run(2, _buffer_dtype_under_checkpoint_wrapper, own_unit))
