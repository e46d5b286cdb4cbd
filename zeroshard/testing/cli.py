"""The command line of the parity toolkit: ``python -m zeroshard.testing parity module:factory``.

Spawns N gloo ranks on this machine and runs :func:`zeroshard.testing.assert_parity`
on them: the model that ``module:factory`` builds, trained for a few steps by
zeroshard and by torch FSDP1 under the same configuration, compared bit for bit
(forward outputs, gradient shards, parameter shards after each optimizer step,
the final FULL state dict). Prints a report; exit status 0 when everything was
equal, 1 at the first difference (named: step, output/grad/param, parameter,
max |diff|), 2 for usage errors (options, a factory that cannot be imported, raises,
returns no module, or builds a model whose input cannot be guessed without --input).

    python -m zeroshard.testing parity mymodels:make_model --world-size 2 \\
        --strategy FULL_SHARD --wrap-class Block --steps 3

``module`` is imported on every rank (the current directory is on the path);
``--wrap-class NAME`` is looked up in the factory's module (or ``pkg.mod:NAME``).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

import torch

from ..cli_args import positive_float, positive_int
from .parity import ParityError, assert_parity, default_input
from .ranks import spawn


def resolve(spec: str, default_module: str | None = None):
    """``pkg.mod:name`` (or ``name`` within ``default_module``) -> the object."""
    module, _, name = spec.rpartition(":")
    module = module or default_module
    if not module or not name:
        raise ValueError(f"expected module:name, got {spec!r}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class _FactoryProblem(Exception):
    """The factory raised, returned something else than a module, or its model's input cannot be guessed:
    a usage error (exit 2), not a difference between the engines (exit 1)."""


def _checked(make_model, spec: str, guess_input: bool):
    def build():
        try:
            model = make_model()
        except Exception as e:  # noqa: BLE001 - whatever the user's factory raises
            raise _FactoryProblem(f"the factory {spec} raised {type(e).__name__}: {e}") from e
        if not isinstance(model, torch.nn.Module):
            raise _FactoryProblem(f"the factory {spec} returned {type(model).__name__}, not an nn.Module")
        if guess_input:
            try:
                default_input(model)
            except ValueError as e:
                raise _FactoryProblem(f"{e} (on the command line: --input module:fn)") from e
        return model
    return build


def cli_rank(rank, world_size, args: dict):
    """What each rank runs for ``python -m zeroshard.testing parity`` (args: its parsed options)."""
    if args["cwd"] not in sys.path:
        sys.path.insert(0, args["cwd"])
    factory_module = args["factory"].rpartition(":")[0]
    make_model = _checked(resolve(args["factory"]), args["factory"], guess_input=not args["input"])
    classes = {resolve(c, factory_module) for c in args["wrap_class"]}
    policy = {"none": None, "module": classes or None, "transformer": ("transformer", classes) if classes else None,
              "size": args["min_num_params"] or 1000}[args["wrap"] or ("module" if classes else "none")]
    mp = None
    if args["mixed_precision"] or args["reduce_dtype"]:  # --reduce-dtype alone: reductions only, as MixedPrecision allows
        mp = {"param_dtype": args["mixed_precision"], "reduce_dtype": args["reduce_dtype"] or args["mixed_precision"],
              "buffer_dtype": args["mixed_precision"]}
    kw = dict(steps=args["steps"], sharding_strategy=args["strategy"], auto_wrap_policy=policy,
              use_orig_params=args["use_orig_params"], backward_prefetch=None if args["prefetch"] == "NONE" else args["prefetch"],
              forward_prefetch=args["forward_prefetch"], limit_all_gathers=args["limit_all_gathers"], mixed_precision=mp,
              clip_grad_norm=args["clip"], seed=args["seed"])
    if args["input"]:
        kw["make_input"] = resolve(args["input"], factory_module)
    if args["loss"]:
        kw["loss_fn"] = resolve(args["loss"], factory_module)
    if args["lr"] is not None:
        kw["make_optimizer"] = functools.partial(torch.optim.AdamW, lr=args["lr"])
    try:
        return {"ok": True, "report": str(assert_parity(make_model, **kw))}
    except ParityError as e:
        return {"ok": False, "report": str(e), "name": e.name, "what": e.what, "step": e.step}
    except _FactoryProblem as e:  # before any collective, on every rank alike
        return {"ok": False, "usage": str(e)}


def _usage_problem(args: dict) -> str | None:
    """What makes these options unusable, found here before any rank starts."""
    if args["wrap"] in ("module", "transformer") and not args["wrap_class"]:
        return f"--wrap {args['wrap']} needs at least one --wrap-class NAME"
    if args["wrap"] in ("size", "none") and args["wrap_class"]:  # it would be ignored: a different run than asked for
        return f"--wrap-class wraps by class; --wrap {args['wrap']} does not: drop one of them"
    if args["min_num_params"] is not None and args["wrap"] != "size":
        return "--min-num-params is the threshold of --wrap size: add --wrap size, or drop it"
    if args["cwd"] not in sys.path:
        sys.path.insert(0, args["cwd"])
    factory_module = args["factory"].rpartition(":")[0]
    for what, spec, default in [("factory", args["factory"], None), *(("--wrap-class", c, factory_module) for c in args["wrap_class"]),
                                ("--input", args["input"], factory_module), ("--loss", args["loss"], factory_module)]:
        if spec is None:
            continue
        try:
            found = resolve(spec, default)
        except Exception as e:  # noqa: BLE001 - any import or lookup failure is the user's spec
            return f"cannot find the {what} {spec!r} ({type(e).__name__}: {e})"
        if what == "--wrap-class" and not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
            return f"--wrap-class {spec!r} is {type(found).__name__} {found!r}, not an nn.Module class"
    return None


def _max_norm(text: str) -> float:
    """--clip: a max norm > 0; inf compares the norms without clipping."""
    value = float(text)
    if not value > 0:  # also nan
        raise argparse.ArgumentTypeError(f"{text} must be > 0 (inf: compare the norms without clipping)")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zeroshard.testing", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("parity", help="compare zeroshard with torch FSDP1 on your model, bit for bit")
    q.add_argument("factory", help="module:function returning an nn.Module (called once, under torch.manual_seed(seed))")
    q.add_argument("--world-size", type=positive_int, default=2)
    q.add_argument("--steps", type=positive_int, default=3)
    q.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    q.add_argument("--wrap", choices=["none", "module", "transformer", "size"], default=None,
                   help="auto-wrap policy (default: module if --wrap-class is given, else none)")
    q.add_argument("--wrap-class", action="append", default=[], metavar="NAME", help="unit class for module/transformer wrapping")
    q.add_argument("--min-num-params", type=positive_int, default=None, help="threshold for --wrap size (default 1000)")
    q.add_argument("--use-orig-params", action="store_true")
    q.add_argument("--prefetch", default="BACKWARD_PRE", choices=["BACKWARD_PRE", "BACKWARD_POST", "NONE"])
    q.add_argument("--forward-prefetch", action="store_true")
    q.add_argument("--no-limit-all-gathers", dest="limit_all_gathers", action="store_false")
    q.add_argument("--mixed-precision", choices=["bfloat16", "float16"], default=None, help="param and buffer dtype")
    q.add_argument("--reduce-dtype", choices=["bfloat16", "float16", "float32"], default=None)
    q.add_argument("--clip", type=_max_norm, default=None, help="also compare clip_grad_norm_(CLIP) each step")
    q.add_argument("--input", default=None, metavar="[module:]fn", help="make_input(rank, step) (default: guessed from the first layer)")
    q.add_argument("--loss", default=None, metavar="[module:]fn", help="loss_fn(output, batch) (default: mean of squares)")
    q.add_argument("--lr", type=positive_float, default=None, help="AdamW learning rate (default 1e-2)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--timeout", type=positive_float, default=300.0, help="seconds before the ranks are stopped")
    args = vars(p.parse_args(argv))
    args["cwd"] = os.getcwd()
    problem = _usage_problem(args)
    if problem:
        p.print_usage(sys.stderr)
        print(f"python -m zeroshard.testing parity: error: {problem}", file=sys.stderr)
        return 2
    try:
        results = spawn(cli_rank, args["world_size"], args, timeout=args["timeout"])
    except (RuntimeError, TimeoutError) as e:
        print(f"zeroshard.testing parity: the run failed before a verdict:\n{e}", file=sys.stderr)
        return 1
    verdict = results[0]
    if "usage" in verdict:
        p.print_usage(sys.stderr)
        print(f"python -m zeroshard.testing parity: error: {verdict['usage']}", file=sys.stderr)
        return 2
    print(verdict["report"])
    return 0 if verdict["ok"] else 1
