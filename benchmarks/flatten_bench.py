"""Throughput of the flatten/unflatten copies behind ZeRO-3/FSDP's FlatParameter.

flatten builds the FlatParameter / flat gradient buffer from many parameters;
unflatten materializes per-parameter tensors (state dicts, summon_full_params).
Compares, in GB/s (payload bytes counted once / median time):

  copy          one flat.copy_(src) of the same bytes: the practical memory-bandwidth limit
  py flatten    torch.cat(tensors, out=flat)
  py unflatten  torch.split_with_sizes_copy(flat, sizes, out=outs)
  ext flatten   zeroshard.ext.flatten_into (extension backend), one-shot: every call
                unpacks and re-checks the tensor list
  ext unflatten zeroshard.ext.unflatten_into (extension backend), one-shot
  plan flatten  zeroshard.ext.CopyPlan(tensors, offsets).flatten_into: the table checked
                once and replayed, as a FlatParamHandle / ZeRO-1 partition repeats it
  plan unflatten  CopyPlan.unflatten_into

Usage: python benchmarks/flatten_bench.py [--quick] [--device cuda] [--tensors 1000 --mb 4] [--floor]

--floor (CPU) adds what no flatten/unflatten of these tensors can beat, built
from benchmarks/flatten_floor.cpp with no checks at all:

  runs fl/unfl    the run table copied by csrc/copy_cpu.h's loop alone, the table
                  built once: the bound for a CopyPlan replay
  unpack fl/unfl  the same after unpacking the Python lists as every one-shot call
                  must (csrc/py_args.h): the bound for a one-shot call

A/B of host-side changes: each `--csrc NAME=PATH` JIT-builds the csrc folder PATH
(flatten.cpp, plan.cpp; with --device cuda flatten_cuda.cu too) as its own module
and times its one-shot and plan calls in the same round-robin, printed as
microseconds a call, e.g.

  git archive HEAD csrc | tar -x -C /tmp/old
  python benchmarks/flatten_bench.py --tensors 1000 --mb 4 --csrc old=/tmp/old/csrc --csrc new=csrc
"""

import argparse
import os
import statistics
import time

import torch

from zeroshard import ext

MB = 1 << 20


def random_sizes(n, total_numel, gen):
    """n sizes >= 1 summing to total_numel, spread over ~3 orders of magnitude."""
    w = torch.exp(torch.rand(n, generator=gen, dtype=torch.float64) * 7)
    sizes = (w / w.sum() * (total_numel - n)).floor().long() + 1
    sizes[-1] += total_numel - int(sizes.sum())
    return sizes.tolist()


BURST = 5  # calls timed back to back
SETTLE_S = 0.005  # untimed calls of the same op first, for at least this long (and two calls)


def timer(device):
    """Returns time_it(fn) -> seconds a call: untimed calls of fn for SETTLE_S,
    then BURST timed ones.

    Each op is timed in its own steady state, as a training loop repeats it.
    Timed right after another op, it pays for what that op left: copy_ after an
    unflatten reads a source the outputs evicted (4 MB fits in this CPU's L3 and
    an H100's L2), and on the 2-core box any op after torch.cat's or split's
    thousand tiny parallel regions ran up to 1.8x slower for its next ~2 ms
    (measured: 197, 134, 129, ... 108 us for successive calls of a 106 us op),
    so the order, not the op, set the ratios. On CUDA the burst's launches
    overlap its kernels; benchmarks/flatten_kernels.py times single calls."""

    def settle(fn):
        t0, calls = time.perf_counter(), 0
        while calls < 2 or time.perf_counter() - t0 < SETTLE_S:
            fn()
            calls += 1

    if device.type == "cuda":

        def time_it(fn):
            settle(fn)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(BURST):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3 / BURST

    else:

        def time_it(fn):
            settle(fn)
            t0 = time.perf_counter()
            for _ in range(BURST):
                fn()
            return (time.perf_counter() - t0) / BURST

    return time_it


def build_csrc(name, path, cu=None):
    """The csrc folder PATH's host code (flatten.cpp, plan.cpp) as module NAME, flags as
    setup.py's; with CU (a flatten_cuda.cu), a CUDA build of it and those kernels
    (benchmarks/flatten_kernels.py --cu builds through here too)."""
    from torch.utils.cpp_extension import load

    path = os.path.abspath(path)
    sources = [os.path.join(path, "flatten.cpp"), os.path.join(path, "plan.cpp")]
    flags = ["-O3", "-g0", "-fopenmp"]
    kw = {}
    if cu is not None:
        sources.append(os.path.abspath(cu))
        flags.append("-DZEROSHARD_WITH_CUDA")
        kw["extra_cuda_cflags"] = ["-O3", "-DZEROSHARD_WITH_CUDA", "-Xptxas", "-v"]  # ptxas prints registers, spills
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    directory = os.path.join(root, "build", "flatten_ab", name + ("_cuda" if cu else ""))
    os.makedirs(directory, exist_ok=True)
    return load(name=f"zs_ab_{name}" + ("_cuda" if cu else ""), sources=sources, extra_include_paths=[path],
                extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=directory, **kw)


def build_floor():
    """benchmarks/flatten_floor.cpp, flags as setup.py's (see --floor)."""
    from torch.utils.cpp_extension import load

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    directory = os.path.join(root, "build", "flatten_floor")
    os.makedirs(directory, exist_ok=True)
    return load(name="zs_flatten_floor", sources=[os.path.join(here, "flatten_floor.cpp")],
                extra_include_paths=[os.path.join(root, "csrc")], extra_cflags=["-O3", "-g0", "-fopenmp"],
                extra_ldflags=["-fopenmp"], build_directory=directory)


def bench_case(n, nbytes, device, reps, builds=None, floor=None):
    gen = torch.Generator().manual_seed(n * 7 + nbytes)
    numel = nbytes // 4
    sizes = random_sizes(n, numel, gen)
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    tensors = [torch.randn(s, generator=gen).to(device) for s in sizes]
    src = torch.cat(tensors)  # the same bytes as one tensor, for the copy_ baseline
    flat = torch.empty(numel, device=device)
    outs = [torch.empty(s, device=device) for s in sizes]
    plan_in, plan_out = ext.CopyPlan(tensors, offsets), ext.CopyPlan(outs, offsets)
    time_it = timer(device)

    ops = {
        "copy": lambda: flat.copy_(src),
        "py flatten": lambda: torch.cat(tensors, out=flat),
        "py unflatten": lambda: torch.split_with_sizes_copy(flat, sizes, out=outs),
        "ext flatten": lambda: ext.flatten_into(tensors, offsets, flat),
        "ext unflatten": lambda: ext.unflatten_into(flat, offsets, outs),
        "plan flatten": lambda: plan_in.flatten_into(flat),
        "plan unflatten": lambda: plan_out.unflatten_into(flat),
    }
    for name, mod in (builds or {}).items():  # --csrc: the raw modules, as ext calls them
        p_in, p_out = mod.Plan(tensors, offsets), mod.Plan(outs, offsets)
        ops[f"{name} fl"] = lambda m=mod: m.flatten_into(tensors, offsets, flat)
        ops[f"{name} unfl"] = lambda m=mod: m.unflatten_into(flat, offsets, outs)
        ops[f"{name} plan fl"] = lambda p=p_in: p.flatten_into(flat)
        ops[f"{name} plan unfl"] = lambda p=p_out: p.unflatten_into(flat)
    if floor is not None:
        t_in, t_out = floor.Table(tensors, offsets, flat), floor.Table(outs, offsets, flat)
        ops["runs fl"] = lambda: t_in.copy(True)
        ops["runs unfl"] = lambda: t_out.copy(False)
        ops["unpack fl"] = lambda: t_in.unpack_copy(tensors, offsets, True)
        ops["unpack unfl"] = lambda: t_out.unpack_copy(outs, offsets, False)
    # Round-robin over the variants so that load from other processes (a shared
    # 2-core box) hits all of them alike and the ratios stay meaningful.
    times = {name: [] for name in ops}
    for _ in range(reps):
        for name, fn in ops.items():
            times[name].append(time_it(fn))
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    # Every variant must produce the same bytes (guards against benchmarking a no-op).
    variants = [f"{name} {op}" for name in builds or {} for op in ("fl", "plan fl", "unfl", "plan unfl")]
    variants += [f"{op} {way}" for op in ("runs", "unpack") for way in ("fl", "unfl")] if floor is not None else []
    for key in variants:
        if key.endswith("unfl"):
            for o in outs:
                o.zero_()
            ops[key]()
            assert all(torch.equal(o, t) for o, t in zip(outs, tensors)), key
        else:
            flat.zero_()
            ops[key]()
            assert torch.equal(flat, src), key
    ext.flatten_into(tensors, offsets, flat)
    assert torch.equal(flat, src)
    ext.unflatten_into(flat, offsets, outs)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    flat.zero_()
    plan_in.flatten_into(flat)
    assert torch.equal(flat, src)
    for o in outs:
        o.zero_()
    plan_out.unflatten_into(flat)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    assert plan_in.rebuilds == plan_out.rebuilds == 1
    return gbps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads")
    p.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000], help="tensor counts")
    p.add_argument("--mb", type=int, nargs="+", default=[4, 256], help="payloads, MB")
    p.add_argument("--csrc", action="append", default=[], metavar="NAME=PATH",
                   help="also time a csrc folder's build (repeatable)")
    p.add_argument("--floor", action="store_true",
                   help="also time the copy loop with no checks (CPU; see above)")
    args = p.parse_args()
    if args.floor and torch.device(args.device).type != "cpu":
        p.error("--floor times the CPU copy loop: use it with --device cpu")
    if any("=" not in spec for spec in args.csrc):
        p.error("--csrc takes NAME=PATH, e.g. --csrc new=csrc")
    cuda = torch.device(args.device).type == "cuda"
    builds = {name: build_csrc(name, path, os.path.join(path, "flatten_cuda.cu") if cuda else None)
              for name, path in (spec.split("=", 1) for spec in args.csrc)}
    floor = build_floor() if args.floor else None
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    os.environ.pop("ZEROSHARD_DISABLE_EXT", None)
    backend = ext.ext_backend(device)
    print(
        f"device={device} backend={backend} torch={torch.__version__} "
        f"threads={torch.get_num_threads()} fp32"
        + ("" if backend != "python" else "  (extension NOT active: ext columns are the fallback)")
    )
    print()
    cols = ["copy", "py flatten", "ext flatten", "plan flatten",
            "py unflatten", "ext unflatten", "plan unflatten"]
    ratios = {  # name: (numerator, denominator)
        "ext/copy fl": ("ext flatten", "copy"), "ext/copy unfl": ("ext unflatten", "copy"),
        "plan/copy fl": ("plan flatten", "copy"), "plan/copy unfl": ("plan unflatten", "copy"),
        "ext/py fl": ("ext flatten", "py flatten"), "ext/py unfl": ("ext unflatten", "py unflatten"),
        "plan/py fl": ("plan flatten", "py flatten"), "plan/py unfl": ("plan unflatten", "py unflatten"),
    }
    if floor is not None:
        cols += ["runs fl", "unpack fl", "runs unfl", "unpack unfl"]
        ratios.update({"runs/copy fl": ("runs fl", "copy"), "unpack/copy fl": ("unpack fl", "copy"),
                       "runs/copy unfl": ("runs unfl", "copy"), "unpack/copy unfl": ("unpack unfl", "copy")})
    rows = []
    for nbytes in (mb * MB for mb in args.mb):
        reps = 5 if args.quick else 60
        if nbytes >= 64 * MB and not args.quick:
            reps = 10
        for n in args.tensors:
            rows.append((n, nbytes, bench_case(n, nbytes, device, reps, builds, floor)))
            print(f"  measured {n} tensors x {nbytes // MB} MB", flush=True)
    print("\nGB/s (payload bytes / median time, 1 GB = 1e9 B; higher is better)\n")
    print("| tensors | payload | " + " | ".join(cols) + " |")
    print("|" + "---:|" * (2 + len(cols)))
    for n, nbytes, g in rows:
        print(f"| {n} | {nbytes // MB} MB | " + " | ".join(f"{g[c]:.1f}" for c in cols) + " |")
    print("\nRatios (target: every ext or plan /copy >= 0.8x, every /py >= 1.0x)\n")
    print("| tensors | payload | " + " | ".join(ratios) + " |")
    print("|" + "---:|" * (2 + len(ratios)))
    for n, nbytes, g in rows:
        print(f"| {n} | {nbytes // MB} MB | "
              + " | ".join(f"{g[a] / g[b]:.2f}x" for a, b in ratios.values()) + " |")
    if builds:
        ab = [f"{name} {op}" for name in builds for op in ("fl", "unfl", "plan fl", "plan unfl")]
        print("\n--csrc builds, microseconds a call (median; copy for scale)\n")
        print("| tensors | payload | copy | " + " | ".join(ab) + " |")
        print("|" + "---:|" * (3 + len(ab)))
        for n, nbytes, g in rows:
            print(f"| {n} | {nbytes // MB} MB | " + " | ".join(f"{nbytes / g[c] / 1e3:.1f}" for c in ["copy"] + ab) + " |")


if __name__ == "__main__":
    main()
