"""Per-rank memory of the model states under each ZeRO stage: the memory model of the
ZeRO paper (Rajbhandari et al., 2020, section 5 and Table 1) for Adam on N ranks.
Activations are outside it; zeroshard's gathered-parameter working set is reported apart.

``ZeRO paper`` rows -- mixed-precision Adam: 2 bytes of fp16/bf16 params, 2 of grads and
K = 12 of fp32 optimizer state (master copy + momentum + variance) per parameter; each
stage shards one more of the three over N ranks:

    ZeRO-1 (P_os)     : 2Ψ + 2Ψ + 12Ψ/N = 4Ψ + 12Ψ/N
    ZeRO-2 (P_os+g)   : 2Ψ + (2+12)Ψ/N  = 2Ψ + 14Ψ/N   (SHARD_GRAD_OP)
    ZeRO-3 (P_os+g+p) : (2+2+12)Ψ/N     = 16Ψ/N        (FULL_SHARD)
    DDP               : 16Ψ                            (NO_SHARD)

With ``--mixed-precision none`` all is fp32: params 4, grads 4, Adam exp_avg+exp_avg_sq 8
(the fp32 param is its own master), so ZeRO-1 = 8Ψ + 8Ψ/N, ZeRO-2 = 4Ψ + 12Ψ/N,
ZeRO-3 = 16Ψ/N, DDP = 16Ψ: the same 16 bytes, split (4, 4, 8) instead of (2, 2, 12).

``zeroshard FSDP1-style`` rows -- what zeroshard (like torch FSDP1) keeps: the master
shard *is* the parameter, in its own dtype (fp32); MixedPrecision only sets the dtype of
the gathered compute copy. So the persistent state is 4 + 4 + 8 = 16 bytes per element,
sharded (16Ψ/N) for FULL_SHARD and SHARD_GRAD_OP (FSDP1 shards ZeRO-2's params at rest
too), replicated for NO_SHARD, plus a transient working set in the compute dtype:
FULL_SHARD: the root unit (gathered from forward through backward) + the largest
chain of nested units (a unit computes inside its ancestors, all gathered) + the
largest other unit (a prefetch: limit_all_gathers, on by default, allows one while
fewer than prefetch.MAX_LIVE_PREFETCH_UNITS = 2 are gathered; without it the bound does
not hold); SHARD_GRAD_OP: every unit (gathered from forward to the end of backward);
NO_SHARD: nothing if it computes on the shard, else every unit's cast copy (autograd
holds them until backward). FULL_SHARD's needs unit sizes: give ``--model``, or call
:func:`estimate_model`, which runs the engine's own wrapping (wrap.wrap_submodules) and layout
(flat_param.build_layout) code without a process group. A unit's unsharded gradient
(at most two at a time: one in its reduce-scatter while the next is computed) is not counted.

``--offload`` (CPUOffload): params, grads and optimizer state live on CPU; GPU bytes per
rank are then only the working set.

``--hpz-group-size k`` (ZeRO++ hpZ, see ``hpz``): FULL_SHARD keeps a secondary shard of
every non-root unit from its forward to its backward, partitioned over k ranks — up to
Σ padded/k elements (compute dtype) more per rank at the start of backward — and runs the
backward all-gathers over k ranks: Σ padded·c·(k−1)/k bytes per rank inside the group
instead of Σ padded·c·(N−1)/N across all N (:func:`comm_volume`, :func:`hpz_tradeoff`).

    python -m zeroshard.estimate --params 7e9 --world-size 64 --strategy all
    python -m zeroshard.estimate --model mypkg.models:build --wrap-class Block --world-size 8
    python -m zeroshard.estimate --params 7e9 --world-size 64 --hpz-group-size 8
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from .bucket import unit_strategy
from .flat_param import build_layout, collect_params
from .validation import check_uniform
from .fully_sharded import FullyShardedDataParallel
from .prefetch import MAX_LIVE_PREFETCH_UNITS
from .options import ShardingStrategy
from .cli_args import check_choice, check_count, parameter_count, positive_int
from .wrap import ModuleWrapPolicy, wrap_submodules

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD")
STAGE = {"FULL_SHARD": "ZeRO-3", "SHARD_GRAD_OP": "ZeRO-2", "ZERO1": "ZeRO-1", "NO_SHARD": "DDP"}
# Which of (params, grads, optimizer) each stage shards in the paper's model.
SHARDED = {"FULL_SHARD": (1, 1, 1), "SHARD_GRAD_OP": (0, 1, 1), "ZERO1": (0, 0, 1), "NO_SHARD": (0, 0, 0)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank of each model-state component, and the formula behind them."""

    strategy: str
    accounting: str
    params: float
    grads: float
    optim: float
    formula: str
    working_set: float | None = None  # transient gathered parameters; None = unknown

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim


def bytes_per_param(mixed_precision: str, accounting: str = "paper") -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per parameter."""
    if accounting == "paper" and mixed_precision != "none":
        return 2, 2, 12  # fp16/bf16 param + grad; fp32 master + momentum + variance (K = 12)
    return 4, 4, 8  # fp32 param + grad; Adam's two moments (the param is its own master)


def _check_psi(where: str, psi) -> None:
    if isinstance(psi, bool) or not isinstance(psi, (int, float)) or not math.isfinite(psi) or psi <= 0:
        raise ValueError(f"{where}: psi (the parameter count) must be a finite number > 0, got {psi!r}")


def model_states(psi: float, world_size: int, strategy: str, mixed_precision: str = "bf16",
                 accounting: str = "paper", offload: bool = False) -> ModelStates:
    """Per-rank model-state bytes of a ``psi``-parameter model on ``world_size`` ranks. With
    ``offload`` the shards live on CPU, so even a NO_SHARD unit computing in their dtype copies
    them to the GPU: its working set is then counted."""
    where = "zeroshard.estimate.model_states"
    _check_psi(where, psi)
    check_count(where, "world_size", world_size)
    check_choice(where, "strategy", strategy, STRATEGIES)
    check_choice(where, "mixed_precision", mixed_precision, tuple(DTYPES))
    check_choice(where, "accounting", accounting, ("paper", "zeroshard"))
    p, g, k = bytes_per_param(mixed_precision, accounting)
    if accounting != "paper" and strategy == "ZERO1":
        raise ValueError("zeroshard has no ZeRO-1 strategy; use accounting='paper' for ZERO1")
    # FSDP1 shards the parameter at rest for SHARD_GRAD_OP too (its gathered copy is transient).
    sh = SHARDED[strategy if accounting == "paper" or strategy == "NO_SHARD" else "FULL_SHARD"]
    parts = [c * psi / world_size if s else c * psi for c, s in zip((p, g, k), sh)]
    formula = " + ".join(f"{c}Ψ/N" if s else f"{c}Ψ" for c, s in zip((p, g, k), sh))
    ws = None
    if accounting == "zeroshard" and strategy != "FULL_SHARD":
        c = DTYPES[mixed_precision].itemsize if DTYPES[mixed_precision] else 4
        ws = 0 if strategy == "NO_SHARD" and c == p and not offload else c * psi
    label = "ZeRO paper" if accounting == "paper" else "zeroshard FSDP1-style"
    return ModelStates(strategy, label, parts[0], parts[1], parts[2], formula, ws)


@dataclass(frozen=True)
class UnitEstimate:
    name: str  # module path in the unwrapped model ("" = root)
    numel: int  # flat numel (alignment padding included, world-size padding not)
    padded_numel: int  # all-gathered buffer size: shard_numel * world_size
    shard_numel: int  # elements each rank keeps
    trainable: bool
    sharded: bool = True  # False: NO_SHARD or persistent (param_persistence_threshold): padded = shard = numel


@dataclass(frozen=True)
class ModelEstimate:
    units: list[UnitEstimate]
    strategy: str
    world_size: int
    psi: int  # unique parameters: the units', and ignored modules' (whole on every rank)
    param_bytes: int  # per rank, master dtype: the (sharded) FlatParameters
    grad_bytes: int  # their gradients
    optim_bytes: int  # Adam's exp_avg + exp_avg_sq
    working_set_bytes: int  # transient gathered parameters, compute dtype
    offload: bool = False
    compute_itemsize: int = 4  # bytes per gathered element
    hpz_group_size: int | None = None
    secondary_bytes: int = 0  # hpZ: secondary shards held from forward to backward (peak)

    @property
    def sharded_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    @property
    def gpu_bytes(self) -> int:
        return self.working_set_bytes + self.secondary_bytes + (0 if self.offload else self.sharded_bytes)

    @property
    def cpu_bytes(self) -> int:
        return self.sharded_bytes if self.offload else 0


def estimate_model(model: nn.Module, world_size: int, auto_wrap_policy=None, strategy="FULL_SHARD",
                   param_dtype: torch.dtype | None = None, use_orig_params: bool = False,
                   ignored_modules=None, offload: bool = False, hpz_group_size: int | None = None,
                   param_persistence_threshold: int | None = None) -> ModelEstimate:
    """The engine's units and layouts for ``model``, computed without a process group.

    Per-rank bytes use Adam (2 states) on the master shard; with use_orig_params=True
    that is an upper bound, since the optimizer's views exclude alignment padding.
    """
    strategy = strategy.name if isinstance(strategy, ShardingStrategy) else strategy
    where = "zeroshard.estimate.estimate_model"
    check_choice(where, "strategy", strategy, ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"))
    check_count(where, "world_size", world_size)
    if hpz_group_size is not None:
        check_count(where, "hpz_group_size", hpz_group_size)
        if world_size % hpz_group_size:  # as the engine refuses it
            raise ValueError(f"{where}: hpz_group_size {hpz_group_size} must divide world_size {world_size}")
        if strategy != "FULL_SHARD" and world_size > 1:  # (it was ignored) as the engine refuses it
            raise ValueError(f"{where}: hpz_group_size needs strategy='FULL_SHARD', not {strategy!r}: only ZeRO-3 "
                             "gathers again for backward. Fix: use FULL_SHARD, or drop hpz_group_size.")
    if param_persistence_threshold is not None:
        check_count(where, "param_persistence_threshold", param_persistence_threshold, low=0)
    if world_size == 1:
        strategy = "NO_SHARD"  # the engine switches too: nothing to shard over
    ignored = {m for root in (ignored_modules or ()) for m in root.modules()}
    recorded: list[nn.Module] = []
    if auto_wrap_policy is not None:
        # The engine's own traversal; make_unit records the module and leaves the
        # tree untouched, so the same policy decisions (and numel counts) result.
        def make_unit(m, **kwargs):
            recorded.append(m)
            return m

        # Any constructor keyword may be overridden per unit (CustomPolicy);
        # mixed_precision=None: the estimate registers no fp32 hooks on the model.
        keywords = dict.fromkeys(inspect.signature(FullyShardedDataParallel.__init__).parameters)
        wrap_submodules(model, auto_wrap_policy, keywords, make_unit, ignored, lambda m: m in recorded)
    unit_set = set(recorded) | {model}
    order = {m: i for i, m in enumerate(model.modules())}
    names = {m: n for n, m in model.named_modules()}
    units, owner, sharded = [], {}, strategy != "NO_SHARD"
    gathered, state = [], [0, 0, 0]  # (is_root, bytes, casts) per unit; param/grad/optim bytes
    for m in sorted(unit_set, key=order.__getitem__):  # fsdp_modules() (pre-order) order
        entries, aliases = collect_params(m, skip=unit_set | ignored)
        if entries:  # what the engine refuses at construction (mixed requires_grad without use_orig_params, dtypes)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_uniform(entries, use_orig_params, names[m] or type(m).__name__)
        for _, _, fqn, p in entries:
            if p in owner:  # the engine refuses a parameter owned by two units
                raise ValueError(f"parameter '{fqn}' is shared by units '{owner[p]}' and '{names[m]}'")
            owner[p] = names[m]
        if not entries:
            units.append(UnitEstimate(names[m], 0, 0, 0, False))
            continue
        dtype = entries[0][3].dtype
        compute = param_dtype or dtype
        numel = sum(e[3].numel() for e in entries)
        whole = not sharded or unit_strategy(ShardingStrategy[strategy], numel, param_persistence_threshold).name == "NO_SHARD"
        # With use_orig_params the engine pads even a whole unit's aligned layout to a multiple of the
        # world size (as torch FSDP1); such a unit's shard is all of it.
        layout = build_layout(entries, aliases, world_size if use_orig_params or not whole else 1, 0,
                              16 // compute.itemsize if use_orig_params else 0)
        u = UnitEstimate(names[m], layout.numel, layout.padded_numel, layout.padded_numel if whole else layout.shard_numel,
                         any(e[3].requires_grad for e in entries), not whole)
        units.append(u)
        held = u.shard_numel * dtype.itemsize
        # The master param; its grad and Adam's exp_avg + exp_avg_sq only when trainable.
        state = [state[0] + held, state[1] + held * u.trainable, state[2] + 2 * held * u.trainable]
        # A unit kept whole computes on its shard unless it must cast or move it (autograd holds the copies to backward).
        copy = u.padded_numel * compute.itemsize if not whole or compute != dtype or offload else 0
        gathered.append((m is model, copy, whole, names[m]))
    if strategy == "FULL_SHARD":  # units kept whole hold their copies together, like the root
        working = sum(b for is_root, b, whole, _ in gathered if is_root or whole) + _largest_live(
            [(name, b) for is_root, b, whole, name in gathered if not is_root and not whole])
    else:  # SHARD_GRAD_OP keeps every unit gathered to backward; NO_SHARD's copies (if any) live as long
        working = sum(b for _, b, _, _ in gathered)
    # Ignored modules' parameters stay whole on every rank, with their gradients and optimizer state.
    loose = {p for m in ignored for p in m.parameters(recurse=False) if p not in owner}
    for p in loose:
        held = p.numel() * p.element_size()
        state = [state[0] + held, state[1] + held * p.requires_grad, state[2] + 2 * held * p.requires_grad]
    itemsize = (param_dtype or next((p.dtype for p in owner), torch.float32)).itemsize
    hpz = hpz_group_size if strategy == "FULL_SHARD" else None  # (a world of 1 is NO_SHARD, as in the engine)
    secondary = sum(u.padded_numel // hpz * itemsize for u in units[1:] if u.sharded) if hpz else 0
    return ModelEstimate(units, strategy, world_size, sum(p.numel() for p in (*owner, *loose)), *state, working, offload,
                         itemsize, hpz, secondary)


def _largest_live(units: list[tuple[str, int]]) -> int:
    """FULL_SHARD's most gathered bytes of non-root units (name, bytes) at once: a unit and its
    ancestors (nested units compute inside one another) plus the largest prefetched others."""
    best = 0
    for name, _ in units:
        chain = {n for n, _ in units if n == name or name.startswith(n + ".")}
        others = sorted((b for n, b in units if n not in chain), reverse=True)[:MAX_LIVE_PREFETCH_UNITS - 1]
        best = max(best, sum(b for n, b in units if n in chain) + sum(others))
    return best


def _ring(nbytes: float, group_size: int) -> float:
    return nbytes * (group_size - 1) / group_size


def comm_volume(est: ModelEstimate) -> dict:
    """Bytes one rank sends per step, by collective: {name: (bytes, group size)}.

    FULL_SHARD gathers every unit in forward and all but the root in backward
    (over the hpZ group when ``est.hpz_group_size`` is set); gradients are
    reduce-scattered in the compute dtype (MixedPrecision's default
    reduce_dtype); a unit with nothing to train reduces nothing (but is counted
    as gathered again in backward, which a frozen unit whose inputs need no
    gradient is not). The same ring accounting as ``zeroshard.comm_stats()``.
    """
    n, c = est.world_size, est.compute_itemsize
    whole = sum(u.numel for u in est.units if not u.sharded and u.trainable) * c
    if est.strategy == "NO_SHARD":
        return {"all_reduce": (2 * _ring(whole, n), n)}
    padded = [u.padded_numel * c if u.sharded else 0 for u in est.units]
    reduced = sum(b for b, u in zip(padded, est.units) if u.trainable)
    out = {"forward all_gather": (_ring(sum(padded), n), n), "reduce_scatter": (_ring(reduced, n), n)}
    if est.strategy == "FULL_SHARD":
        g = est.hpz_group_size or n
        out["backward all_gather"] = (_ring(sum(padded[1:]), g), g)
    if whole:  # persistent units: their gradients are all-reduced
        out["all_reduce"] = (2 * _ring(whole, n), n)
    return out


def hpz_tradeoff(psi: float, world_size: int, k: int, itemsize: int = 2, psi_root: float = 0.0) -> dict:
    """ZeRO++ hpZ in closed form for Ψ gathered elements (Ψ_root of them in the
    root unit, which backward does not re-gather): extra memory per rank and
    the backward all-gather's bytes per rank, without and with hpZ."""
    where = "zeroshard.estimate.hpz_tradeoff"
    _check_psi(where, psi)
    check_count(where, "world_size", world_size)
    check_count(where, "k", k)
    if world_size % k:
        raise ValueError(f"{where}: k = {k} must divide world_size {world_size} (hpZ's groups partition the ranks)")
    rest = (psi - psi_root) * itemsize
    return {"secondary_bytes": rest / k,
            "backward_bytes_zero3": _ring(rest, world_size), "backward_bytes_hpz": _ring(rest, k),
            "group_sizes": (world_size, k)}


def _fmt(b) -> str:
    return "—" if b is None else f"{int(round(b)):,} ({b / 2**30:.2f} GiB)"


def table(rows: list[ModelStates], offload: bool) -> str:
    """Markdown table of ``rows``; GPU/CPU split per rank when offloading."""
    head = ["strategy", "stage", "accounting", "formula", "params", "grads", "optimizer",
            "model states/rank", "working set (transient)", "GPU/rank", "CPU/rank"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        # Table 1 models no working set; zeroshard's FULL_SHARD one needs the unit sizes.
        known = r.working_set is not None
        ws = _fmt(r.working_set) if known else "not modeled" if r.accounting == "ZeRO paper" else "needs --model"
        gpu = _fmt((0 if offload else r.total) + (r.working_set or 0)) + ("" if known else " + working set")
        cells = [r.strategy, STAGE[r.strategy], r.accounting, r.formula, _fmt(r.params), _fmt(r.grads), _fmt(r.optim),
                 _fmt(r.total), ws, gpu, _fmt(r.total if offload else 0)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _hpz_table(a, psi, model, policy) -> str:
    """The hpZ trade-off for FULL_SHARD: from the real units with --model, else Ψ
    (an upper bound: the root unit, which backward does not re-gather, is unknown)."""
    k, n = a.hpz_group_size, a.world_size
    if n == 1:  # the engine shards nothing on one rank (NO_SHARD): no secondary shards either
        return "ZeRO++ hpZ: no effect at --world-size 1 (one rank holds the whole model; nothing is gathered)."
    dtype = DTYPES[a.mixed_precision]
    c = dtype.itemsize if dtype else 4
    if model is not None:
        kw = dict(offload=a.offload, param_persistence_threshold=a.param_persistence_threshold)
        est = estimate_model(model, n, policy, "FULL_SHARD", dtype, hpz_group_size=k, **kw)
        plain = comm_volume(estimate_model(model, n, policy, "FULL_SHARD", dtype, **kw))["backward all_gather"][0]
        extra, hpz = est.secondary_bytes, comm_volume(est)["backward all_gather"][0]
    else:
        t = hpz_tradeoff(psi, n, k, c)
        extra, plain, hpz = t["secondary_bytes"], t["backward_bytes_zero3"], t["backward_bytes_hpz"]
    return "\n".join([
        f"ZeRO++ hpZ, secondary shards over k = {k} of N = {n} ranks (FULL_SHARD, per rank):", "",
        "| | memory held from forward to backward | backward all-gather sent | over |", "|---|---|---|---|",
        f"| ZeRO-3 | 0 | {_fmt(plain)} | N = {n} ranks |",
        f"| hpZ | {_fmt(extra)} | {_fmt(hpz)} | k = {k} ranks (intra-group) |"])


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(prog="python -m zeroshard.estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parameter_count, help="number of parameters Ψ (e.g. 7e9)")
    ap.add_argument("--model", help="module:function returning an nn.Module (built on the meta device)")
    ap.add_argument("--wrap-class", help="class name for ModuleWrapPolicy (with --model)")
    ap.add_argument("--world-size", type=positive_int, required=True)
    ap.add_argument("--strategy", default="all", choices=[*STRATEGIES, "all"])
    ap.add_argument("--mixed-precision", default="bf16", choices=list(DTYPES))
    ap.add_argument("--offload", action="store_true", help="params/grads/optimizer state on CPU")
    ap.add_argument("--hpz-group-size", type=positive_int, help="ZeRO++ hpZ: secondary shards over k ranks (FULL_SHARD)")
    ap.add_argument("--param-persistence-threshold", type=positive_int, help="units of at most N elements kept whole (with --model)")
    a = ap.parse_args(argv)
    if (a.params is None) == (a.model is None):
        ap.error("give exactly one of --params and --model")
    if a.wrap_class is not None and a.model is None:
        ap.error("--wrap-class wraps the classes of a --model: give --model (with --params there are no modules)")
    if a.param_persistence_threshold is not None and a.model is None:
        ap.error("--param-persistence-threshold needs the units' sizes: give --model")
    if a.hpz_group_size is not None:
        if a.world_size % a.hpz_group_size:
            ap.error(f"--hpz-group-size {a.hpz_group_size} must divide --world-size {a.world_size}")
        if a.strategy not in ("FULL_SHARD", "all"):
            ap.error(f"--hpz-group-size: hpZ re-gathers for backward, which only FULL_SHARD does (not {a.strategy})")
    strategies = STRATEGIES if a.strategy == "all" else (a.strategy,)
    lines, model_est = [], {}  # strategy -> ModelEstimate from the real layouts
    if a.model:
        mod, _, fn = a.model.partition(":")
        try:
            build = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError, ValueError) as e:
            ap.error(f"--model {a.model}: {e} (expected module:function, importable from here)")
        try:
            with torch.device("meta"):  # sizes only: no memory for the weights
                model = build()
        except Exception as e:  # the user's factory: say which option led there
            ap.error(f"--model {a.model}: calling {fn}() failed: {type(e).__name__}: {e}")
        if not isinstance(model, torch.nn.Module):
            ap.error(f"--model {a.model}: {fn}() returned {type(model).__name__}, not an nn.Module")
        classes = {type(m) for m in model.modules() if type(m).__name__ == a.wrap_class}
        if a.wrap_class and not classes:
            ap.error(f"no module of class {a.wrap_class} in the model")
        policy = ModuleWrapPolicy(classes) if classes else None
        try:  # a model the engine would refuse (a parameter shared by two units)
            model_est = {s: estimate_model(model, a.world_size, policy, s, DTYPES[a.mixed_precision], offload=a.offload,
                                           param_persistence_threshold=a.param_persistence_threshold)
                         for s in strategies if s != "ZERO1"}
            est = next(iter(model_est.values()), None) or estimate_model(model, a.world_size, policy)
        except ValueError as e:
            ap.error(f"--model {a.model}: {e}")
        psi = est.psi
        if not psi:
            ap.error(f"--model {a.model}: the model has no parameters (nothing to shard)")
        lines += [f"Units of {a.model} on {a.world_size} ranks ({est.strategy}):", "",
                  "| unit | numel | padded numel | shard numel/rank |", "|---|---|---|---|"]
        lines += [f"| {u.name or '(root)'} | {u.numel:,} | {u.padded_numel:,} | {u.shard_numel:,} |" for u in est.units]
        lines.append("")
    else:
        psi = a.params
    rows = []
    for s in strategies:
        rows.append(model_states(psi, a.world_size, s, a.mixed_precision, "paper"))
        if s == "ZERO1":
            continue  # zeroshard has no ZeRO-1 strategy: paper row only
        r = model_states(psi, a.world_size, s, a.mixed_precision, "zeroshard", a.offload)
        if s in model_est:  # exact per-rank bytes from the real layouts (padding included)
            e = model_est[s]
            r = ModelStates(s, r.accounting + " (model layout)", e.param_bytes, e.grad_bytes, e.optim_bytes,
                            r.formula, e.working_set_bytes)
        rows.append(r)
    lines.append(f"Model-state memory per rank: Ψ = {psi:,.0f}, N = {a.world_size}, "
                 f"mixed precision = {a.mixed_precision}, offload = {a.offload}")
    lines += ["", table(rows, a.offload)]
    if a.hpz_group_size:
        lines += ["", _hpz_table(a, psi, model if a.model else None, policy if a.model else None)]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
