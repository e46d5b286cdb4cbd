"""Training-step time, memory and communication: zeroshard against torch FSDP1, FSDP2 and DDP.

One GPT-like model (pre-LN blocks, tied embedding/head), the same seed-0 init and the same
per-rank batches for every engine; each engine shards one unit per transformer block plus
the root (embeddings, final norm, head). A step is forward + backward + AdamW step.

Engines: zeroshard FULL_SHARD / SHARD_GRAD_OP, torch FSDP1 FULL_SHARD / SHARD_GRAD_OP
(``device_id=cpu``, use_orig_params=False, BACKWARD_PRE), torch FSDP2 (``fully_shard``
per block then root on a CPU device mesh) and DDP.

* Time: ONE process group (ranks of 1 thread each) holds every engine; each round runs one
  step of every engine, the order rotated per round, so drift and noisy neighbours hit all
  engines alike. A step lasts as long as its slowest rank; median over ``--steps`` rounds
  after ``--warmup``. (The large preset needs ~25 GB with all engines: pass ``--engines``.)
* Memory: a fresh process group per engine. glibc serves allocations >= 128 KiB by mmap, so
  RSS follows the tensors held rather than heap retention; after construction, gc +
  malloc_trim and a reset of the kernel's peak RSS (VmHWM, /proc/self/clear_refs), then 3
  steps: "peak RSS train" is VmHWM over them, max over ranks; "lifetime" is ru_maxrss.
* Communication (zeroshard, ``zs.comm_stats``, ring bytes per rank and step) against ZeRO:
  with Ψ the padded parameter count, FULL_SHARD all-gathers 2Ψ − Ψ_root (the root stays
  unsharded from forward to backward, as in torch FSDP1) and reduce-scatters Ψ: the ZeRO
  paper's 3Ψ(N−1)/N·4 bytes less the root's backward gather. SHARD_GRAD_OP: Ψ + Ψ.

Usage: .venv/bin/python benchmarks/train_step.py [--preset small] [--world-size 2]
       [--steps 10] [--warmup 3] [--engines zs-full,fsdp1-full,...] [--quick]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.cli_args import positive_int
from zeroshard.demo import Block, CharGPT
from zeroshard.testing import spawn

PRESETS = {  # d_model, layers, heads, vocab, seq len, sequences per rank
    "tiny": dict(d=64, layers=2, heads=4, vocab=512, seq=32, batch=4),  # ~0.1M, --quick
    "small": dict(d=384, layers=4, heads=6, vocab=8192, seq=128, batch=4),  # ~10M
    "medium": dict(d=512, layers=12, heads=8, vocab=16384, seq=256, batch=8),  # ~46M
    "large": dict(d=1024, layers=14, heads=16, vocab=32768, seq=256, batch=4),  # ~210M
}
ENGINES = {  # key -> label
    "zs-full": "zeroshard FULL_SHARD", "zs-grad-op": "zeroshard SHARD_GRAD_OP",
    "fsdp1-full": "FSDP1 FULL_SHARD", "fsdp1-grad-op": "FSDP1 SHARD_GRAD_OP",
    "fsdp2": "FSDP2 fully_shard", "ddp": "DDP",
}
MB = 1 << 20


def GPT(d, layers, heads, vocab, seq, **_):
    """The demo's GPT (tied embedding/head, one unit per Block)."""
    return CharGPT(vocab, d=d, heads=heads, layers=layers, ctx=seq)


def build(key, cfg, ws):
    torch.manual_seed(0)
    model = GPT(**cfg)
    if key.startswith("zs"):
        strategy = zs.ShardingStrategy.FULL_SHARD if key == "zs-full" else zs.ShardingStrategy.SHARD_GRAD_OP
        return zs.FSDP(model, sharding_strategy=strategy, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                       backward_prefetch=zs.BackwardPrefetch.BACKWARD_PRE, use_orig_params=False)
    if key.startswith("fsdp1"):
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        strategy = ShardingStrategy.FULL_SHARD if key == "fsdp1-full" else ShardingStrategy.SHARD_GRAD_OP
        return FullyShardedDataParallel(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                        backward_prefetch=BackwardPrefetch.BACKWARD_PRE, use_orig_params=False,
                                        device_id=torch.device("cpu"))
    if key == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (ws,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return nn.parallel.DistributedDataParallel(model)


def batches(cfg, rank, n):
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(0, cfg["vocab"], (2, cfg["batch"], cfg["seq"]), generator=g) for _ in range(n)]


def train_step(model, opt, xy):
    loss = F.cross_entropy(model(xy[0]).flatten(0, 1), xy[1].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def zero_sizes(model):
    """(Ψ, Ψ_root): padded numel over all zeroshard units, and of the root unit."""
    units = [m._handle.layout.padded_numel for m in model.modules() if isinstance(m, zs.FSDP) and m._handle]
    return sum(units), units[0]


def time_worker(rank, ws, cfg, keys, warmup, steps):
    warnings.filterwarnings("ignore")
    data = batches(cfg, rank, warmup + steps)
    runs = {k: (m, torch.optim.AdamW(m.parameters(), lr=1e-3)) for k in keys for m in [build(k, cfg, ws)]}
    times = {k: [] for k in keys}
    comm = {k: [] for k in keys if k.startswith("zs")}
    losses = {}
    for i in range(warmup + steps):
        for k in keys[i % len(keys):] + keys[: i % len(keys)]:  # rotate the order every round
            dist.barrier()
            t0 = time.perf_counter()
            with zs.comm_stats() as st:
                losses[k] = train_step(*runs[k], data[i])
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
                if k in comm:
                    comm[k].append((st.bytes["all_gather"], st.bytes["reduce_scatter"], st.calls["all_gather"], st.calls["reduce_scatter"]))
    out = {}
    for k in keys:
        t = torch.tensor(times[k], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        out[k] = dict(ms=statistics.median(t.tolist()) * 1e3, min=t.min().item() * 1e3, max=t.max().item() * 1e3, loss=losses[k])
        if k in comm:
            assert all(c == comm[k][0] for c in comm[k]), f"{k}: volume changed between steps: {comm[k]}"
            out[k].update(comm=comm[k][0], sizes=zero_sizes(runs[k][0]))
    out["params"] = sum(p.numel() for p in GPT(**cfg).parameters())
    return out


def proc_status_mb(field):  # "VmRSS" (now) or "VmHWM" (peak since the last reset)
    return next(int(ln.split()[1]) / 1024 for ln in open("/proc/self/status") if ln.startswith(field + ":"))


def memory_worker(rank, ws, cfg, key, n_steps):
    warnings.filterwarnings("ignore")
    base = proc_status_mb("VmRSS")
    model = build(key, cfg, ws)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(cfg, rank, n_steps)
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass  # then "train" peak is the lifetime peak
    for xy in data:
        train_step(model, opt, xy)
    return dict(base=base, train=proc_status_mb("VmHWM"), life=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def run(fn, ws, *args):
    """spawn() with a retry when another job took the rendezvous port (free_port() is racy on a shared machine)."""
    for attempt in range(3):
        try:
            return spawn(fn, ws, *args, timeout=7200, pg_timeout=1800)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def machine():
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {sys.version.split()[0]}"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=PRESETS, default="small")
    ap.add_argument("--world-size", type=positive_int, default=2)
    ap.add_argument("--steps", type=positive_int, default=None, help="timed steps (default 10; 3 with --quick)")
    ap.add_argument("--warmup", type=positive_int, default=None, help="untimed steps first (default 3; 1 with --quick)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ", ".join(ENGINES))
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 steps: a smoke test")
    for key in ("d", "layers", "heads", "vocab", "seq", "batch"):
        ap.add_argument(f"--{key}", type=positive_int, help=f"override the preset's {key}")
    a = ap.parse_args()
    if a.quick:
        a.preset = "tiny"
    a.steps = a.steps or (3 if a.quick else 10)
    a.warmup = a.warmup or (1 if a.quick else 3)
    cfg = dict(PRESETS[a.preset], **{k: getattr(a, k) for k in PRESETS["tiny"] if getattr(a, k) is not None})
    keys = a.engines.split(",")
    if not keys or not set(keys) <= set(ENGINES):
        ap.error(f"--engines {a.engines}: unknown {sorted(set(keys) - set(ENGINES))}; choose from {', '.join(ENGINES)}")
    ws, t_start = a.world_size, time.perf_counter()
    print(f"# zeroshard training-step benchmark\n\n`{' '.join([sys.executable, *sys.argv])}`\n\nmachine: {machine()}")
    print(f"world size {ws} gloo ranks x 1 thread; preset {a.preset} {cfg}; warm-up {a.warmup}, median of {a.steps} steps; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores before start (other jobs inflate step times)")
    res = run(time_worker, ws, cfg, keys, a.warmup, a.steps)[0]
    # mmap (freed to the OS at once) for >= 128 KiB: without it glibc's heap retention made ranks differ by ±40 MB.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    mem = {k: run(memory_worker, ws, cfg, k, 3) for k in keys}
    del os.environ["MALLOC_MMAP_THRESHOLD_"]
    tokens = cfg["batch"] * cfg["seq"] * ws
    print(f"model: {res['params'] / 1e6:.2f}M parameters; {tokens} tokens per step over all ranks\n")
    peak = {k: max(m["train"] for m in mem[k]) for k in keys}
    above = {k: max(m["train"] - m["base"] for m in mem[k]) for k in keys}
    rows = [(ENGINES[k], f"{res[k]['ms']:.1f} ({res[k]['min']:.0f}–{res[k]['max']:.0f})", f"{tokens / res[k]['ms'] * 1e3:,.0f}", f"{peak[k]:.0f}",
             f"{max(m['life'] for m in mem[k]):.0f}", f"{max(m['base'] for m in mem[k]):.0f}", f"{res[k]['loss']:.4f}") for k in keys]
    print(table(["engine", "median step ms (min–max)", "tokens/s", "peak RSS train (MB/rank)", "lifetime peak RSS",
                 "RSS before model", "last loss"], rows))
    print("\nRSS (MB, max over ranks), each engine in its own fresh process group, glibc MALLOC_MMAP_THRESHOLD_=128KiB: "
          "train = kernel peak (VmHWM) over 3 steps, reset after construction + gc + malloc_trim; "
          "lifetime = ru_maxrss (construction included); before model = after importing torch and zeroshard + init_process_group.")
    zs_keys = [k for k in keys if k.startswith("zs")]
    if zs_keys:
        rows, f = [], (ws - 1) / ws * 4 / MB
        for k in zs_keys:
            ag, rs, n_ag, n_rs = res[k]["comm"]
            psi, root = res[k]["sizes"]
            ag_theory = (2 * psi - root) if k == "zs-full" else psi
            zero = 3 * psi if k == "zs-full" else 2 * psi
            rows.append((ENGINES[k], f"{n_ag} / {n_rs}", f"{ag / MB:.3f}", f"{ag_theory * f:.3f}", f"{rs / MB:.3f}",
                         f"{psi * f:.3f}", f"{(ag + rs) / MB:.3f}", f"{zero * f:.3f}"))
        print(f"\n## zeroshard communication per step and rank (MiB; Ψ = {psi:,} padded params, Ψ_root = {root:,})\n")
        print(table(["engine", "AG / RS calls", "all-gather", "theory (2Ψ−Ψ_root or Ψ)", "reduce-scatter",
                     "theory Ψ", "total", "ZeRO 3Ψ (FULL) / 2Ψ (GRAD_OP)"], rows))
        peers = [k for k in keys if not k.startswith("zs")]
        print("\n## ratios zeroshard ÷ peer (< 1: zeroshard faster / smaller)\n")
        rows = [(ENGINES[z], ENGINES[p]) + tuple(f"{x:.3f}" for x in (
            res[z]["ms"] / res[p]["ms"], res[z]["min"] / res[p]["min"], peak[z] / peak[p], above[z] / above[p]))
            for z in zs_keys for p in peers]
        print(table(["zeroshard", "÷ peer", "median step time", "fastest step", "peak RSS train", "RSS above before-model"], rows))
    print(f"\ntotal wall time: {time.perf_counter() - t_start:.0f} s; load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
