"""Engine overhead on one GPU: zeroshard against the plain model, DDP, torch FSDP1 and FSDP2.

On a fast device the step time is the kernels' plus whatever the engine adds on the host
(hooks, bookkeeping, stream waits). With NCCL world size 1 every engine computes the same
thing (FSDP1 and zeroshard fall back to NO_SHARD at world size 1, FSDP2 shards over one
rank), so the differences are the engines' own overhead — the figure shared/ANCHORS.md
quotes for FSDP1 (~0.5-2 %) and FSDP2 (~3-4 %).

Model: the demo's GPT (pre-LN blocks, tied embedding/head), one unit per block plus the
root, fp32, fused AdamW. All engines live in one process and run round-robin, one step
each per round (order rotated), so clock and thermal drift hit all alike; median over
``--steps`` rounds after ``--warmup``. Every engine computes the same losses up to the
GPU's own nondeterminism (attention backward uses atomics); with ``--deterministic``
(torch.use_deterministic_algorithms) zeroshard and FSDP1 must agree bit for bit (checked).

Usage: python benchmarks/gpu_step.py [--layers 12] [--d 768] [--batch 8] [--seq 512]
       [--steps 20] [--warmup 5] [--engines plain,ddp,fsdp1,fsdp2,zeroshard]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.demo import Block, CharGPT
from zeroshard.testing import free_port

ENGINES = ("plain", "ddp", "fsdp1", "fsdp2", "zeroshard")


def build(engine: str, args) -> nn.Module:
    torch.manual_seed(0)
    model = CharGPT(args.vocab, d=args.d, heads=args.d // 64, layers=args.layers, ctx=args.seq).cuda()
    dev = torch.cuda.current_device()
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[dev])
    if engine == "fsdp1":
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=dev,
                                        backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        return fully_shard(model)
    if engine == "zeroshard":
        return zs.FSDP(model, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), device_id=dev,
                       backward_prefetch=zs.BackwardPrefetch.BACKWARD_PRE)
    return model


def step(model, opt, x, y) -> torch.Tensor:
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (slower)")
    args = p.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    keys = args.engines.split(",")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 end to end: losses comparable bitwise
    torch.backends.cudnn.allow_tf32 = False

    runs = {}
    for k in keys:
        m = build(k, args)
        runs[k] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True))
    with torch.device("meta"):  # count without building another model on the GPU
        nparams = sum(p.numel() for p in CharGPT(args.vocab, d=args.d, heads=args.d // 64, layers=args.layers,
                                                 ctx=args.seq).parameters())
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, args.vocab, (2, args.batch, args.seq), generator=g).cuda()
            for _ in range(args.warmup + args.steps)]
    times = {k: [] for k in keys}
    losses = {k: [] for k in keys}
    for i, (x, y) in enumerate(data):
        for k in keys[i % len(keys):] + keys[: i % len(keys)]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(*runs[k], x, y)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times[k].append(time.perf_counter() - t0)
            losses[k].append(loss)

    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} "
          f"zeroshard ext={zs.ext_backend('cuda')} params={nparams / 1e6:.1f}M "
          f"d={args.d} layers={args.layers} batch={args.batch}x{args.seq} fp32 fused AdamW, "
          f"median of {args.steps} after {args.warmup}" + (", deterministic" if args.deterministic else ""))
    base = statistics.median(times["plain"]) if "plain" in times else None
    print("\n| engine | median step ms | ÷ plain | final loss |\n|---|---:|---:|---:|")
    for k in keys:
        med = statistics.median(times[k])
        ratio = f"{med / base:.3f}" if base else "-"
        print(f"| {k} | {med * 1e3:.1f} | {ratio} | {losses[k][-1].item():.6f} |")
    if "zeroshard" in losses and "fsdp1" in losses:
        same = all(torch.equal(a, b) for a, b in zip(losses["zeroshard"], losses["fsdp1"]))
        print(f"\nzeroshard losses bit-identical to torch FSDP1 over {len(data)} steps: {same}")
    if "zeroshard" in losses and "plain" in losses:
        diff = max(abs(a.item() - b.item()) for a, b in zip(losses["zeroshard"], losses["plain"]))
        print(f"max |loss(zeroshard) - loss(plain)| over {len(data)} steps: {diff:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
