"""Train zeroshard and torch FSDP1 side by side on one rank pool and compare
with ``torch.equal``: forward outputs, gradients (after accumulation), the
clip_grad_norm_ result, and parameters after each AdamW step.

A case is a dict (see ``DEFAULTS``); the same dict builds both engines, so a
difference can only come from the engines.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import torch
import torch.distributed.fsdp as tfsdp
import torch.distributed.fsdp.wrap as twrap

import zeroshard as zs
from models import Block, TransformerBlock, batch, build

DEFAULTS = dict(
    model="mlp", strategy="FULL_SHARD", use_orig_params=False, backward_prefetch="BACKWARD_PRE",
    forward_prefetch=False, limit_all_gathers=True, policy="module", steps=3, accum=2, clip=0.05,
    no_sync=False, lr=1e-2, min_num_params=100, model_kwargs={}, mp=None, hybrid=None, optim="adamw",
    comm_hook=None, ignored=(), unit_strategies=(), freeze=(),
)


def _lambda_fn(m):
    from models import LoRALinear

    if isinstance(m, LoRALinear):
        return True
    # Nested units: blocks and, inside transformer blocks, their MLPs.
    return isinstance(m, (Block, TransformerBlock, torch.nn.Sequential))


def _policy(lib, case):
    blocks = {Block, TransformerBlock}
    name = case["policy"]
    if name == "module":
        return lib.ModuleWrapPolicy(blocks)
    if name == "transformer":
        return functools.partial(lib.transformer_auto_wrap_policy, transformer_layer_cls=blocks)
    if name == "size":
        return functools.partial(lib.size_based_auto_wrap_policy, min_num_params=case["min_num_params"])
    if name == "lambda":
        return functools.partial(lib.lambda_auto_wrap_policy, lambda_fn=_lambda_fn)
    if name == "always":
        return lib.always_wrap_policy
    if name == "custom":
        return lib.CustomPolicy(functools.partial(_custom_fn, tfsdp if lib is twrap else zs))
    if name == "per_block":  # CustomPolicy: block i gets case["unit_strategies"][i] (None: not a unit)
        return lib.CustomPolicy(functools.partial(_per_block, tfsdp if lib is twrap else zs, case["unit_strategies"]))
    if name == "bn_block":
        from models import BNBlock

        return lib.ModuleWrapPolicy({BNBlock})
    return None


def _per_block(enums, strategies, m):
    if not isinstance(m, Block) or strategies[m.unit_index] is None:
        return False
    return {"sharding_strategy": getattr(enums.ShardingStrategy, strategies[m.unit_index])}


def _custom_fn(enums, m):
    """CustomPolicy: blocks become SHARD_GRAD_OP units, the head a NO_SHARD
    unit (per-unit keyword overrides), every nn.Sequential a unit with the root's keywords."""
    if isinstance(m, (Block, TransformerBlock)):
        return {"sharding_strategy": enums.ShardingStrategy.SHARD_GRAD_OP}
    if isinstance(m, torch.nn.Linear) and m.out_features == 3:
        return {"sharding_strategy": enums.ShardingStrategy.NO_SHARD}
    return isinstance(m, torch.nn.Sequential)


_GROUPS = {}


def _hybrid_groups(engine, how):
    """2 x 2 ranks: shard within {0,1} and {2,3}, replicate across {0,2} and {1,3}."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if engine == "zeroshard" and how == "group_size":
        return {"fsdp_group_size": 2}
    if how == "mesh":
        if "mesh" not in _GROUPS:
            _GROUPS["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        return {"device_mesh": _GROUPS["mesh"]}
    if "tuple" not in _GROUPS:
        rank, made = dist.get_rank(), {}
        for ranks in ([0, 1], [2, 3], [0, 2], [1, 3]):
            made[tuple(ranks)] = dist.new_group(ranks)
        shard = made[(0, 1)] if rank < 2 else made[(2, 3)]
        replicate = made[(0, 2)] if rank % 2 == 0 else made[(1, 3)]
        _GROUPS["tuple"] = (shard, replicate)
    return {"process_group": _GROUPS["tuple"]}


def _wrap(engine, model, case):
    for i, blk in enumerate(getattr(model, "blocks", ())):
        blk.unit_index = i  # for the per_block policy
    if engine == "torch":
        cls, lib, enums, extra = tfsdp.FullyShardedDataParallel, twrap, tfsdp, {"device_id": torch.device("cpu")}
    else:
        cls, lib, enums, extra = zs.FullyShardedDataParallel, zs.wrap, zs, {}
    if case["ignored"]:  # FQNs of parameters kept out of sharding (ignored_states)
        extra["ignored_states"] = [model.get_parameter(n) for n in case["ignored"]]
    if case["hybrid"] is not None:  # "tuple" | "mesh" | "group_size" (zeroshard only; torch gets the tuple)
        extra.update(_hybrid_groups(engine, case["hybrid"]))
    mp = case["mp"]
    if mp is not None:
        extra["mixed_precision"] = enums.MixedPrecision(**{k: getattr(torch, v) if isinstance(v, str) else v for k, v in mp.items()})
    kw = dict(
        sharding_strategy=getattr(enums.ShardingStrategy, case["strategy"]),
        use_orig_params=case["use_orig_params"],
        backward_prefetch=getattr(enums.BackwardPrefetch, case["backward_prefetch"]) if case["backward_prefetch"] else None,
        forward_prefetch=case["forward_prefetch"],
        limit_all_gathers=case["limit_all_gathers"],
        **extra,
    )
    if case["policy"] == "manual":
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = cls(blk, **kw)
        return cls(model, **kw)
    return cls(model, auto_wrap_policy=_policy(lib, case), **kw)


def sum_hook(state, grad, output=None):
    """A custom hook: sums instead of averaging (so ignoring the hook shows)."""
    import torch.distributed as dist

    if output is None:
        dist.all_reduce(grad, group=state)
    else:
        dist.reduce_scatter_single(output, grad, group=state)


@contextlib.contextmanager
def _cpu_record_stream():
    """torch's fp16/bf16_compress_hook end with ``record_stream`` on the
    decompressed tensor, which a CPU tensor refuses ("unknown parameter type").
    With it a no-op for CPU tensors (there are no streams to order), the rest
    is torch's own hook, including FSDP1's special case for it (no casts to
    reduce_dtype before it or to the parameter dtype after it)."""
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if self.device.type != "cpu":
            original(self, stream)

    torch.Tensor.record_stream = record_stream
    try:
        yield
    finally:
        torch.Tensor.record_stream = original


def _register_hook(engine, model, case):
    """case["comm_hook"]: "default" (torch's reduce_scatter_hook / allreduce_hook on
    both engines), "zeroshard" (torch's hooks on torch, zeroshard's own on
    zeroshard), "bf16" / "fp16" (zeroshard's compression hooks against torch's,
    see _cpu_record_stream), "sum" (a custom hook)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks as th

    name, pg = case["comm_hook"], model.process_group
    if name == "sum":
        return model.register_comm_hook(pg, sum_hook)
    lib = zs.comm_hooks if engine == "zeroshard" and name != "default" else th
    if name in ("bf16", "fp16"):
        return model.register_comm_hook(lib.LowPrecisionState(pg), getattr(lib, f"{name}_compress_hook"))
    hook = lib.allreduce_hook if case["strategy"] == "NO_SHARD" else lib.reduce_scatter_hook
    model.register_comm_hook(lib.DefaultState(pg), hook)


def _grads_equal(where, named_a, named_b):
    for (na, a), (nb, b) in zip(named_a, named_b):
        assert na == nb, f"{where}: parameter names differ: {na} vs {nb}"
        if a.grad is None or b.grad is None:
            assert a.grad is None and b.grad is None, f"{where}: {na}: grad None on one side only"
            continue
        assert a.grad.dtype == b.grad.dtype, f"{where}: grad of {na} is {a.grad.dtype} vs {b.grad.dtype}"
        assert torch.equal(a.grad, b.grad), f"{where}: grad of {na} differs, max |diff| {(a.grad - b.grad).abs().max()}"


def run_case(rank: int, world_size: int, overrides: dict) -> dict:
    case = {**DEFAULTS, **overrides}
    with _cpu_record_stream() if case["comm_hook"] in ("bf16", "fp16") else contextlib.nullcontext():
        return _train_and_compare(rank, case)


def _train_and_compare(rank: int, case: dict) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = build(case["model"], **case["model_kwargs"])
        for name in case["freeze"]:  # submodules frozen before wrapping (whole units)
            base.get_submodule(name).requires_grad_(False)
        ref = _wrap("torch", copy.deepcopy(base), case)
        ours = _wrap("zeroshard", copy.deepcopy(base), case)
        if case["comm_hook"] is not None:
            _register_hook("torch", ref, case)
            _register_hook("zeroshard", ours, case)
    names_ref = [n for n, _ in ref.named_parameters()]
    names_ours = [n for n, _ in ours.named_parameters()]
    assert names_ref == names_ours, f"named_parameters differ:\n{names_ref}\n{names_ours}"
    # SGD steps a full-precision parameter with a low-precision grad
    # (keep_low_precision_grads); AdamW's state updates need equal dtypes.
    make_opt = torch.optim.SGD if case["optim"] == "sgd" else torch.optim.AdamW
    opt_ref = make_opt(ref.parameters(), lr=case["lr"])
    opt_ours = make_opt(ours.parameters(), lr=case["lr"])
    norms = []
    for step in range(case["steps"]):
        for micro in range(case["accum"]):
            x = batch(case["model"], rank, step * case["accum"] + micro, case["model_kwargs"].get("d_in", 5))
            last = micro == case["accum"] - 1
            ctx_ref = ref.no_sync() if case["no_sync"] and not last else contextlib.nullcontext()
            ctx_ours = ours.no_sync() if case["no_sync"] and not last else contextlib.nullcontext()
            for model, ctx, tag in ((ref, ctx_ref, "ref"), (ours, ctx_ours, "ours")):
                with ctx:
                    out = model(x)
                    out.float().pow(2).mean().backward()
                    if tag == "ref":
                        out_ref = out.detach()
                    else:
                        assert torch.equal(out_ref, out), f"step {step}.{micro}: forward output differs"
        where = f"step {step}"
        _grads_equal(where, ref.named_parameters(), ours.named_parameters())
        if case["clip"]:
            n_ref, n_ours = ref.clip_grad_norm_(case["clip"]), ours.clip_grad_norm_(case["clip"])
            assert torch.equal(n_ref, n_ours), f"{where}: clip_grad_norm_ {n_ref} vs {n_ours}"
            norms.append(n_ours.item())
            _grads_equal(where + " after clipping", ref.named_parameters(), ours.named_parameters())
        opt_ref.step()
        opt_ours.step()
        opt_ref.zero_grad()
        opt_ours.zero_grad()
        for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
            assert torch.equal(a, b), f"{where}: parameter {n} differs after AdamW"
        state_ref = sorted(n for n, p in ref.named_parameters() if p in opt_ref.state)
        state_ours = sorted(n for n, p in ours.named_parameters() if p in opt_ours.state)
        assert state_ref == state_ours, f"{where}: optimizer state exists for {state_ref} vs {state_ours}"
    return {"norms": norms, "params": sum(p.numel() for p in ours.parameters()),
            "with_state": sorted(n for n, p in ours.named_parameters() if p in opt_ours.state)}


def wrapped_with_adamw(model_name, use_orig_params, strategy="FULL_SHARD", hybrid=None, engines=("torch", "zeroshard"), seed=0,
                       ignored=(), mp=None):
    """The same seeded model wrapped by each engine, each with its AdamW (lr 1e-2)."""
    case = {**DEFAULTS, "model": model_name, "use_orig_params": use_orig_params, "strategy": strategy, "hybrid": hybrid,
            "ignored": list(ignored), "mp": mp}
    base = build(model_name, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = [_wrap(e, copy.deepcopy(base), case) for e in engines]
    return models, [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]


def trained_with_adamw(rank, model_name, use_orig_params, strategy="FULL_SHARD", steps=3, **kwargs):
    """``wrapped_with_adamw``'s models after ``steps`` training steps each on this rank's batches."""
    models, opts = wrapped_with_adamw(model_name, use_orig_params, strategy, **kwargs)
    for step in range(steps):
        for m, o in zip(models, opts):
            train_step(m, o, model_name, rank, step)
    return models, opts


def train_step(model, opt, model_name, rank, step):
    """One forward/backward/AdamW step on this rank's batch for ``step``."""
    model(batch(model_name, rank, step)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def assert_same_value(a, b, where):
    """torch.equal with dtype and shape for tensors, == for anything else."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


def same_on_every_rank(tensors) -> bool:
    """Whether ``tensors`` (a rank's parameters or gradients) are bit-identical on every rank of the world:
    replicas that must not drift apart (collective)."""
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], t) for t in everyone)
