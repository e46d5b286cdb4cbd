"""The CUDA flatten/unflatten kernels alone, and A/B of kernel sources (needs a GPU).

flatten_bench.py times single calls, host work included. This script also times
each copy inside a CUDA graph (10 calls captured, replayed back to back), which
leaves the kernel alone: what the GPU spends, without Python, argument checks or
the launch. Three columns per operation, microseconds (median):

  graph    one call's share of a graph replay (the kernel)
  single   one call from an idle GPU, launch included (event-timed, as flatten_bench)
  host     the Python call itself, until it returns (perf_counter)

Operations: copy_ of the same bytes (the physical limit), torch.cat /
split_with_sizes_copy (the Python path), and for each extension module its
CopyPlan (`plan fl` / `plan unfl`) and one-shot calls (`fl` / `unfl`).

Without --cu the installed zeroshard._C is timed. Each `--cu NAME=PATH` JIT-builds
PATH (a flatten_cuda.cu) with csrc/flatten.cpp and csrc/plan.cpp as its own module
(nvcc and ninja needed; ptxas prints registers and spills), so a kernel change can
be compared with the committed one in one run, e.g.

  git show HEAD~1:csrc/flatten_cuda.cu > /tmp/old.cu
  python benchmarks/flatten_kernels.py --cu old=/tmp/old.cu --cu new=csrc/flatten_cuda.cu

PATH may also be a whole csrc folder, to compare host-side changes (argument
checks, the one-shot calls' unpacking): `--cu old=/tmp/old_csrc --cu new=csrc`.
`--build-only` builds and exits (run one per module in parallel, then time).

Every module's output is checked byte for byte against torch.cat before timing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flatten_bench import build_csrc, random_sizes  # the same sizes as the single-call benchmark (this folder is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20
CASES = [  # (tensors, payload bytes, dtype)
    (1000, 4 * MB, torch.float32), (100, 4 * MB, torch.float32), (10, 4 * MB, torch.float32),
    (10, 256 * MB, torch.float32), (100, 256 * MB, torch.float32), (1000, 256 * MB, torch.float32),
    (1000, 256 * MB, torch.bfloat16), (1000, 4 * MB, torch.uint8),
]


def build(name: str, path: str):
    """JIT-build PATH as module NAME: a flatten_cuda.cu (with this checkout's host code)
    or a whole csrc folder (its host code too, to A/B host-side changes)."""
    if os.path.isdir(path):
        return build_csrc(name, path, os.path.join(path, "flatten_cuda.cu"))
    return build_csrc(name, os.path.join(ROOT, "csrc"), path)


def graph_us(fn, inner=10, reps=30):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / inner)
    return statistics.median(times)


def single_us(fn):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3, host * 1e6


def case(mods, n, nbytes, dtype, reps):
    gen = torch.Generator().manual_seed(n * 7 + nbytes)
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    sizes = random_sizes(n, numel, gen)
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    tensors = [torch.randn(s, generator=gen).to(dtype).cuda() for s in sizes]
    src = torch.cat(tensors)
    flat = torch.empty(numel, dtype=dtype, device="cuda")
    outs = [torch.empty(s, dtype=dtype, device="cuda") for s in sizes]
    ops = {
        "copy": lambda: flat.copy_(src),
        "cat": lambda: torch.cat(tensors, out=flat),
        "split": lambda: torch.split_with_sizes_copy(flat, sizes, out=outs),
    }
    for name, m in mods.items():
        pin, pout = m.Plan(tensors, offsets), m.Plan(outs, offsets)
        ops[f"{name} plan fl"] = lambda p=pin: p.flatten_into(flat)
        ops[f"{name} plan unfl"] = lambda p=pout: p.unflatten_into(flat)
        ops[f"{name} fl"] = lambda m=m: m.flatten_into(tensors, offsets, flat)
        ops[f"{name} unfl"] = lambda m=m: m.unflatten_into(flat, offsets, outs)
    for name in mods:  # every module writes the right bytes, both paths, both directions
        for kind in ("fl", "plan fl"):
            flat.zero_()
            ops[f"{name} {kind}"]()
            assert torch.equal(flat.view(torch.uint8), src.view(torch.uint8)), (name, kind)
        for kind in ("unfl", "plan unfl"):
            for o in outs:
                o.zero_()
            ops[f"{name} {kind}"]()
            assert all(torch.equal(o, t) for o, t in zip(outs, tensors)), (name, kind)
    graph = {k: graph_us(fn) for k, fn in ops.items()}
    single = {k: [] for k in ops}
    host = {k: [] for k in ops}
    for _ in range(reps):  # round-robin, so drift hits every op alike
        for k, fn in ops.items():
            t, h = single_us(fn)
            single[k].append(t)
            host[k].append(h)
    print(f"\n{n} tensors, {nbytes // MB} MB, {str(dtype).replace('torch.', '')}\n")
    print("| op | graph us | single us | host us |")
    print("|---|---:|---:|---:|")
    for k in ops:
        print(f"| {k} | {graph[k]:.1f} | {statistics.median(single[k]):.1f} | {statistics.median(host[k]):.1f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cu", action="append", default=[], metavar="NAME=PATH",
                   help="build PATH (a flatten_cuda.cu or a csrc folder) as module NAME; repeatable")
    p.add_argument("--reps", type=int, default=15, help="single-call rounds")
    p.add_argument("--build-only", action="store_true", help="build the --cu modules and exit")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flatten_kernels.py needs a CUDA device; benchmarks/flatten_bench.py runs on CPU")
    if args.cu:
        mods = {}
        for spec in args.cu:
            name, sep, path = spec.partition("=")
            if not sep or not name.isidentifier() or not (path.endswith(".cu") or os.path.isdir(path)):
                raise SystemExit(f"--cu takes NAME=PATH with PATH a .cu file or a csrc folder, got {spec!r}")
            mods[name] = build(name, path)
        if args.build_only:
            return
    else:
        from zeroshard import ext

        if ext.ext_backend("cuda") != "cuda":
            raise SystemExit("zeroshard._C has no CUDA kernels here: rebuild it where nvcc is found, or pass --cu")
        mods = {"zs": ext._C}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for n, nbytes, dtype in CASES:
        case(mods, n, nbytes, dtype, args.reps)


if __name__ == "__main__":
    main()
