"""Parity testing: a sharded model must compute exactly what torch FSDP1 computes.

This is the acceptance test of a ZeRO-3 engine. Sharding changes where
parameters, gradients and optimizer states *live* (1/N of each per rank,
gathered around each unit's forward and backward, reduce-scattered after it),
not what is computed. Built from the same weights and fed the same batches,
zeroshard and torch FSDP1 must agree bit for bit (``torch.equal``, no
tolerance) at every point a user can observe:

  forward outputs  after each forward, every output tensor
  gradients        after each backward, every parameter's gradient shard
                   (what the reduce-scatter left on this rank)
  grad norm        the value ``clip_grad_norm_`` returns (when asked for)
  parameters       after each optimizer step, every parameter shard
  state dict       at the end, the FULL state dict, key by key

``assert_parity`` runs both engines on the *current* process group, so call it
on every rank (``zeroshard.testing.spawn`` or a ``RankPool`` give you ranks).
With ``use_orig_params=False`` a unit's parameters are one FlatParameter; its
shard is cut back into the original parameters (zeroshard's layout equals
torch's element for element) so that a difference is reported under the
parameter it is in, not as ``_flat_param``.

Every rank must raise the same error at the same point, or the ranks that did
not see the difference would wait forever in the next collective: each check
ends with one ``all_gather_object`` of the ranks' first mismatch.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

ENGINES = ("torch", "zeroshard")  # torch first: the reference runs each step before zeroshard does
MP_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype", "keep_low_precision_grads",
             "cast_forward_inputs", "cast_root_forward_inputs")


class ParityError(AssertionError):
    """The first tensor on which zeroshard and torch FSDP1 differ.

    ``step`` (None: before training), ``what`` ("output", "grad", "param",
    "clip_grad_norm_", "state_dict", "parameter names"), ``name`` (the
    parameter's name in the unwrapped model, or "output[i]"),
    ``max_abs_diff`` (None when shapes or dtypes differ), ``rank``.
    """

    def __init__(self, step, what, name, max_abs_diff, rank, detail=""):
        self.step, self.what, self.name = step, what, name
        self.max_abs_diff, self.rank, self.detail = max_abs_diff, rank, detail
        where = "before training" if step is None else "the end" if what == "state_dict" else f"step {step}"
        diff = "" if max_abs_diff is None else f": max |diff| {max_abs_diff:.3e}"
        extra = f" ({detail})" if detail else ""
        super().__init__(f"zeroshard vs torch FSDP1 differ at {where}, {what} of '{name}' on rank {rank}{diff}{extra}")

    def __reduce__(self):  # picklable, so it crosses process boundaries intact
        return ParityError, (self.step, self.what, self.name, self.max_abs_diff, self.rank, self.detail)


@dataclass
class ParityReport:
    """What was compared (all of it equal): counts per kind, summed over ranks
    and steps (a parameter split over two shards counts once per rank)."""

    world_size: int
    steps: int
    config: dict
    outputs: int = 0
    grads: int = 0
    params: int = 0
    state_dict_entries: int = 0
    grad_norms: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items())
        lines = [f"zeroshard vs torch FSDP1: bit-identical over {self.steps} steps on {self.world_size} ranks ({cfg})",
                 "  compared with torch.equal (counts over all ranks and steps):",
                 f"  forward outputs            {self.outputs}",
                 f"  gradient shards            {self.grads}",
                 f"  parameter shards           {self.params}",
                 f"  FULL state dict entries    {self.state_dict_entries}"]
        if self.grad_norms:
            lines.append(f"  clip_grad_norm_ results    {len(self.grad_norms)} (last {self.grad_norms[-1]:.6g})")
        if self.losses:
            lines.append(f"  loss {self.losses[0]:.6g} -> {self.losses[-1]:.6g}")
        lines.append(f"  {self.seconds:.2f} s on rank 0")
        return "\n".join(lines)


# ------------------------------------------------------------------ defaults
def default_input(model: nn.Module, batch: int = 4, seq: int = 8) -> Callable[[int, int], torch.Tensor]:
    """``make_input(rank, step)`` guessed from the model's first layer (the
    first module, in registration order, with parameters of its own): random
    features for a Linear, token ids for an Embedding. Each rank and step gets
    different data, so the gradient reduction has something to average."""
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Linear):
        return functools.partial(_random_batch, "features", (batch, first.in_features), None)
    if isinstance(first, nn.Embedding):
        return functools.partial(_random_batch, "tokens", (batch, seq), first.num_embeddings)
    raise ValueError("zeroshard.testing.assert_parity: cannot guess an input for a model whose first layer is neither "
                     "nn.Linear nor nn.Embedding. Fix: pass make_input=lambda rank, step: <the model's input>.")


def _random_batch(kind, shape, high, rank, step):
    g = torch.Generator().manual_seed(10_007 * step + rank + 1)
    if kind == "tokens":
        return torch.randint(0, high, shape, generator=g)
    return torch.randn(shape, generator=g)


def default_loss(output, batch) -> torch.Tensor:
    """Mean of squares of every floating output tensor (in fp32)."""
    tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and torch.is_floating_point(t)]
    return sum(t.float().pow(2).mean() for t in tensors)


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


# ------------------------------------------------------------------ building
def _name(value) -> str | None:
    return None if value is None else getattr(value, "name", value)


def _show(value) -> str:
    """A configuration value as a short string (class names, enum names)."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(_show(v) for v in value)) + "}" if isinstance(value, (set, frozenset)) else \
            "(" + ", ".join(_show(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_show(v)}" for k, v in value.items()) + "}"
    return str(_name(value)).replace("torch.", "")


def _policy(spec, wrap_lib):
    """A wrap spec for both libraries: None, an int (size-based, min_num_params),
    a set of module classes (ModuleWrapPolicy), ("transformer", classes), or a
    callable with the policy protocol (passed to both engines as is)."""
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise TypeError("zeroshard.testing: auto_wrap_policy=True/False is ambiguous; pass None, an int, classes or a policy")
    if isinstance(spec, int):
        return functools.partial(wrap_lib.size_based_auto_wrap_policy, min_num_params=spec)
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "transformer":
        return functools.partial(wrap_lib.transformer_auto_wrap_policy, transformer_layer_cls=set(spec[1]))
    if isinstance(spec, (set, frozenset, list, tuple)) and all(isinstance(c, type) for c in spec):
        return wrap_lib.ModuleWrapPolicy(set(spec))
    if callable(spec):
        return spec
    raise TypeError(f"zeroshard.testing: unsupported auto_wrap_policy spec {spec!r}")


def _mixed_precision(mp) -> dict | None:
    if mp is None:
        return None
    if dataclasses.is_dataclass(mp):
        mp = {f: getattr(mp, f) for f in MP_FIELDS if hasattr(mp, f)}
    return {k: getattr(torch, v) if isinstance(v, str) and k.endswith("dtype") else v for k, v in mp.items()}


def wrap_with(engine: str, model: nn.Module, config: dict):
    """Wrap ``model`` with zeroshard or torch FSDP1 under ``config`` (assert_parity's keywords)."""
    if engine == "torch":
        import torch.distributed.fsdp as lib
        import torch.distributed.fsdp.wrap as wrap_lib

        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        kw = {"device_id": device}  # torch FSDP1 refuses CPU modules without it
    else:
        import zeroshard as lib
        from zeroshard import wrap as wrap_lib

        kw = {}
    bp = _name(config["backward_prefetch"])
    kw.update(
        sharding_strategy=getattr(lib.ShardingStrategy, _name(config["sharding_strategy"])),
        auto_wrap_policy=_policy(config["auto_wrap_policy"], wrap_lib),
        backward_prefetch=getattr(lib.BackwardPrefetch, bp) if bp else None,
        forward_prefetch=config["forward_prefetch"], limit_all_gathers=config["limit_all_gathers"],
        use_orig_params=config["use_orig_params"],
    )
    extra = config["fsdp_kwargs"]
    kw.update(extra(model) if callable(extra) else extra)
    mp = _mixed_precision(config["mixed_precision"])
    if mp is not None:
        kw["mixed_precision"] = lib.MixedPrecision(**mp)
    if config["group"] is not None:
        kw["process_group"] = config["group"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch FSDP1 on CPU warns about its device; not our concern here
        return lib.FullyShardedDataParallel(model, **kw)


# ------------------------------------------------------------------ comparing
def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _pieces(ours: nn.Module) -> list[tuple[str, str, tuple[int, int] | None]]:
    """(name in named_parameters, reported name, (start, numel) in it or None = all).

    A FlatParameter is cut into the original parameters that fall inside this
    rank's shard (the whole flat buffer for NO_SHARD)."""
    from ..fully_sharded import FullyShardedDataParallel

    flat_handles = {id(u._handle.flat_param): u._handle for u in FullyShardedDataParallel.fsdp_modules(ours)
                    if u._handle is not None and not u._handle.use_orig_params}
    out = []
    for name, p in ours.named_parameters():
        h = flat_handles.get(id(p))
        if h is None:
            out.append((name, _clean(name), None))
            continue
        prefix = _clean(name)[: -len("_flat_param")]
        for info, sl in zip(h.layout.params, h.layout.shard_slices):
            if not h.sharded:
                out.append((name, prefix + info.fqn, (info.offset, info.numel)))
            elif sl is not None:
                out.append((name, prefix + info.fqn, (sl.offset_in_shard, sl.numel_in_shard)))
    return out


def _cut(t: torch.Tensor | None, where):
    if t is None or where is None:
        return t
    return t.detach().reshape(-1)[where[0] : where[0] + where[1]]


def compare(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[bool, float | None, str]:
    """(equal, max |a - b| or None, detail) for the reference ``a`` and ``b``."""
    if a is None or b is None:
        if a is None and b is None:
            return True, 0.0, ""
        return False, None, f"None in {'torch FSDP1' if a is None else 'zeroshard'} only"
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, None, f"torch FSDP1 {a.dtype}{list(a.shape)} vs zeroshard {b.dtype}{list(b.shape)}"
    if torch.equal(a, b):
        return True, 0.0, ""
    a, b = a.detach(), b.detach()
    differ = a != b
    if a.is_floating_point():  # a NaN in both engines at the same place is no difference (a masked position)
        differ &= ~(a.isnan() & b.isnan())
        if not differ.any():
            return True, 0.0, ""
    diff = (a.double() - b.double()).abs()[differ]
    return False, diff.max().item(), f"{int(differ.sum())} of {a.numel()} elements differ"


def _first_mismatch(step, what, named_pairs, rank):
    """The first (name, ref, ours) pair that differs, as a mismatch record; plus the count compared."""
    n = 0
    for name, a, b in named_pairs:
        n += 1
        same, diff, detail = compare(a, b)
        if not same:
            return (step, what, name, diff, rank, detail), n
    return None, n


def _agree(mismatch, group):
    """Collective: every rank raises the lowest rank's mismatch, or none does."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mismatch, group=group)
    first = next((m for m in gathered if m is not None), None)
    if first is not None:
        raise ParityError(*first)


def _call(model, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _clone(batch):
    return tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, batch)


# ------------------------------------------------------------------ the test
def assert_parity(
    make_model: Callable[[], nn.Module],
    *,
    steps: int = 3,
    sharding_strategy: Any = "FULL_SHARD",
    auto_wrap_policy: Any = None,
    use_orig_params: bool = False,
    backward_prefetch: Any = "BACKWARD_PRE",
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    mixed_precision: Any = None,
    clip_grad_norm: float | None = None,
    make_input: Callable[[int, int], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    seed: int = 0,
    group=None,
    fsdp_kwargs: dict | Callable[[nn.Module], dict] | None = None,
    after_backward: Callable[[str, nn.Module, int], None] | None = None,
) -> ParityReport:
    """Train ``make_model()`` for ``steps`` steps under zeroshard and under torch
    FSDP1 with the same configuration; raise :class:`ParityError` (an
    AssertionError) at the first tensor that differs. Collective: call it on
    every rank of ``group`` (default: the whole world).

    ``sharding_strategy`` / ``backward_prefetch``: a name ("FULL_SHARD",
    "BACKWARD_POST", None) or either library's enum. ``auto_wrap_policy``: None,
    an int (size-based min_num_params), a set of module classes
    (ModuleWrapPolicy), ``("transformer", classes)`` or a policy callable.
    ``mixed_precision``: a dict of MixedPrecision fields (dtypes or their
    names) or a zeroshard MixedPrecision. ``make_input(rank, step)`` returns
    the forward's argument (a tuple: positional args, a dict: keywords);
    ``loss_fn(output, batch)`` the scalar to backpropagate. ``fsdp_kwargs`` go
    to both constructors: a dict, or a function of the unwrapped model
    returning one (for ``ignored_modules``, which names that model's own
    submodules). ``after_backward(engine, model, step)`` runs after
    each backward ("torch" first, then "zeroshard"): a place to inspect or to
    perturb (the toolkit's own tests perturb one gradient there).
    """
    t0 = time.perf_counter()
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    config = dict(sharding_strategy=sharding_strategy, auto_wrap_policy=auto_wrap_policy, use_orig_params=use_orig_params,
                  backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                  mixed_precision=mixed_precision, group=None if group is dist.group.WORLD else group,
                  fsdp_kwargs=fsdp_kwargs or {})
    torch.manual_seed(seed)
    base = make_model()
    make_input = make_input or default_input(base)
    loss_fn = loss_fn or default_loss
    make_optimizer = make_optimizer or default_optimizer
    models = {e: wrap_with(e, copy.deepcopy(base), config) for e in ENGINES}
    del base
    # What was set: values other than None / False / {}, and the two whose default is on (prefetch, the rate limit).
    shown = {k: _show(v) for k, v in config.items() if k not in ("group", "fsdp_kwargs")
             and (v not in (None, False, {}) or k in ("backward_prefetch", "limit_all_gathers"))}
    if world == 1 and shown.get("sharding_strategy") not in (None, "NO_SHARD"):
        shown["sharding_strategy"] += " (NO_SHARD on 1 rank, in both engines)"
    report = ParityReport(world_size=world, steps=steps, config=shown)

    names = {e: [_clean(n) for n, _ in models[e].named_parameters()] for e in ENGINES}
    bad = None
    if names["torch"] != names["zeroshard"]:
        i = next((i for i, (a, b) in enumerate(zip(names["torch"], names["zeroshard"])) if a != b),
                 min(len(names["torch"]), len(names["zeroshard"])))
        first = (names["torch"] + ["<none>"])[i], (names["zeroshard"] + ["<none>"])[i]
        bad = (None, "parameter names", first[1], None, rank, f"torch FSDP1 has '{first[0]}' at position {i}")
    _agree(bad, group)

    opts = {e: make_optimizer(models[e].parameters()) for e in ENGINES}
    params = {e: dict(models[e].named_parameters()) for e in ENGINES}
    pieces = _pieces(models["zeroshard"])
    for step in range(steps):
        batch = make_input(rank, step)
        outs, norms = {}, {}
        for e in ENGINES:
            torch.manual_seed(seed + 1 + step)  # dropout and other random ops draw the same numbers in both
            out = _call(models[e], _clone(batch))
            loss = loss_fn(out, batch)
            loss.backward()
            if after_backward is not None:
                after_backward(e, models[e], step)
            outs[e] = [t.detach() for t in tree_flatten(out)[0] if torch.is_tensor(t)]
            if e == "zeroshard":
                report.losses.append(loss.item())
        if len(outs["torch"]) != len(outs["zeroshard"]):
            _agree((step, "output", "output", None, rank, f"{len(outs['torch'])} vs {len(outs['zeroshard'])} tensors"), group)
        label = (lambda i: "output") if len(outs["torch"]) == 1 else (lambda i: f"output[{i}]")
        bad, n = _first_mismatch(step, "output", ((label(i), a, b) for i, (a, b) in enumerate(zip(outs["torch"], outs["zeroshard"]))), rank)
        report.outputs += n
        _agree(bad, group)
        bad, n = _first_mismatch(step, "grad", ((shown_name, _cut(params["torch"][pn].grad, w), _cut(params["zeroshard"][pn].grad, w))
                                                for pn, shown_name, w in pieces), rank)
        report.grads += n
        _agree(bad, group)
        if clip_grad_norm is not None:
            for e in ENGINES:
                norms[e] = models[e].clip_grad_norm_(clip_grad_norm)
            bad, _ = _first_mismatch(step, "clip_grad_norm_", [("total norm", norms["torch"], norms["zeroshard"])], rank)
            _agree(bad, group)
            report.grad_norms.append(norms["zeroshard"].item())
        for e in ENGINES:
            opts[e].step()
            opts[e].zero_grad()
        bad, n = _first_mismatch(step, "param", ((shown_name, _cut(params["torch"][pn], w), _cut(params["zeroshard"][pn], w))
                                                 for pn, shown_name, w in pieces), rank)
        report.params += n
        _agree(bad, group)

    with warnings.catch_warnings():  # torch's NO_SHARD "full_state_dict will be returned", once per call
        warnings.simplefilter("ignore")
        sds = {e: models[e].state_dict() for e in ENGINES}  # FULL_STATE_DICT, the default of both
    keys = {e: [_clean(k) for k in sds[e]] for e in ENGINES}
    bad = None
    if keys["torch"] != keys["zeroshard"]:
        only = sorted(set(keys["torch"]) ^ set(keys["zeroshard"])) or ["<order>"]
        bad = (steps, "state_dict", only[0], None, rank, "keys differ")
    else:
        bad, report.state_dict_entries = _first_mismatch(
            steps, "state_dict", ((k, a, b) for k, a, b in zip(keys["torch"], sds["torch"].values(), sds["zeroshard"].values())), rank)
    _agree(bad, group)
    counts = torch.tensor([report.outputs, report.grads, report.params, report.state_dict_entries], dtype=torch.float64)
    dist.all_reduce(counts, group=group)  # the report counts every rank's comparisons
    report.outputs, report.grads, report.params, report.state_dict_entries = (int(c) for c in counts.tolist())
    report.seconds = time.perf_counter() - t0
    return report
