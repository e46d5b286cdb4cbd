"""torch's DDP tutorial template, ported to zeroshard: NO_SHARD next to FULL_SHARD.

The template of "Getting Started with Distributed Data Parallel"
(pytorch.org/tutorials/intermediate/ddp_tutorial.html) — ``setup`` /
``cleanup``, the ``ToyModel`` (Linear 10->10, ReLU, Linear 10->5), MSE loss,
SGD, ``demo_basic`` and ``demo_checkpoint`` — with the DDP wrapper replaced by
``zeroshard.FullyShardedDataParallel``. The same training runs three times
from the same weights on the same batches:

  torch DDP            the tutorial's original
  zeroshard NO_SHARD   data parallelism: every rank keeps all parameters,
                       gradients are all-reduced (what DDP does)
  zeroshard FULL_SHARD ZeRO-3: every rank keeps 1/N of the parameters,
                       gradients and optimizer state; parameters are
                       all-gathered for forward and backward, gradients
                       reduce-scattered

and rank 0 prints them side by side: losses, the parameter elements each rank
holds, the bytes each rank sent per step. All three end with the same
parameters (bit-identical on 2 ranks; on 4, DDP divides by 4 before summing,
FSDP by 2 before and 2 after, so the last bits may differ). FULL_SHARD sends
as many bytes as NO_SHARD here, not 1.5x: the model is one unit, the root,
which FSDP keeps gathered from forward to backward (2Ψ instead of ZeRO-3's 3Ψ).
``demo_checkpoint``: rank 0 saves the FULL state dict, every rank loads it
into a freshly initialized model (``map_location``), outputs equal.

Runs either way (ranks, world size and local rank come from torchrun's
RANK / WORLD_SIZE / LOCAL_RANK when they are set):

  python -m zeroshard.examples.ddp_template --world-size 2      (spawns the ranks)
  torchrun --standalone --nproc-per-node=2 -m zeroshard.examples.ddp_template
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard as fsdp
from zeroshard.cli_args import positive_int
from zeroshard.testing import free_port

FSDP = fsdp.FullyShardedDataParallel


def setup(rank, world_size, port=None):
    """Spawned ranks: rendezvous on 127.0.0.1:port. Under torchrun the
    environment already has MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE."""
    if port is not None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)


def cleanup():
    # Every rank past its last collective before any tears gloo down: a rank
    # exiting while its peer still shut down once aborted in CI. Models hold
    # the process group; the caller drops its own and gc.collect() frees those
    # left in reference cycles, so that destroying the group frees it now
    # rather than during interpreter shutdown.
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def batch(rank, step):
    """This rank's batch at this step: inputs and a learnable target (a fixed linear map)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(20, 10, generator=g)
    w = torch.linspace(-1, 1, 50).view(10, 5)
    return x, x @ w


def wrap(kind, model):
    if kind == "DDP":
        return DDP(model)
    return FSDP(model, sharding_strategy=getattr(fsdp.ShardingStrategy, kind))


def demo_basic(rank, world_size, kind, steps, log):
    torch.manual_seed(0)  # same initial weights on every rank and for every wrapper
    model = wrap(kind, ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with fsdp.comm_stats() as stats:  # counts zeroshard's collectives (DDP's are not counted)
        for step in range(steps):
            optimizer.zero_grad()
            x, labels = batch(rank, step)
            outputs = model(x)
            loss = loss_fn(outputs, labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    held = sum(p.numel() for p in model.parameters())  # NO_SHARD / DDP: all 165; FULL_SHARD: this rank's shard
    log(f"  {kind:<10}  loss {losses[0]:.4f} -> {losses[-1]:.4f}   rank 0 holds {held:4d} parameter elements"
        + (f"   sent {stats.total_bytes() / steps:6.0f} B/step" if kind != "DDP" else "   (torch's own collectives)"))
    return model, losses


def full_params(model, kind):
    """The whole model's parameters, on every rank."""
    if kind == "DDP":
        return {k: v.clone() for k, v in model.module.state_dict().items()}
    return {k: v.clone() for k, v in model.state_dict().items()}  # FULL_STATE_DICT: gathered (collective)


def demo_checkpoint(rank, model, path, log):
    """The tutorial's demo_checkpoint with FSDP: every rank takes part in
    gathering the FULL state dict, rank 0 saves it, every rank loads it."""
    state = model.state_dict()  # collective
    if rank == 0:
        torch.save(state, path)
    dist.barrier()  # nobody reads before rank 0 has written
    torch.manual_seed(1 + rank)  # a different initialization, overwritten by the load
    fresh = FSDP(ToyModel(), sharding_strategy=fsdp.ShardingStrategy.FULL_SHARD)
    fresh.load_state_dict(torch.load(path, map_location="cpu"))
    x, _ = batch(rank, 999)
    same = torch.equal(fresh(x), model(x))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, same)
    log(f"checkpoint: rank 0 saved the FULL state dict, {len(flags)} ranks loaded it into a fresh model: "
        f"outputs {'equal' if all(flags) else 'DIFFERENT'} on every rank")
    return all(flags)


def worker(rank, world_size, args, port=None):
    setup(rank, world_size, port)
    log = print if rank == 0 else (lambda *a, **k: None)  # rank-0-only logging
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    log(f"{world_size} ranks ({'torchrun' if port is None else 'spawned'}), rank 0 is local rank {local_rank}; "
        f"{args.steps} SGD steps on ToyModel ({sum(p.numel() for p in ToyModel().parameters())} parameters)")
    finals, ok = {}, True
    for kind in ("DDP", "NO_SHARD", "FULL_SHARD"):
        model, _ = demo_basic(rank, world_size, kind, args.steps, log)
        finals[kind] = full_params(model, kind)
        if kind == "FULL_SHARD":
            path = [os.path.join(tempfile.mkdtemp(), "model.checkpoint")] if rank == 0 else [None]
            dist.broadcast_object_list(path, src=0)  # one path for all ranks (torchrun gives no shared argument)
            ok = demo_checkpoint(rank, model, path[0], log) and ok
            dist.barrier()  # every rank has loaded it
            if rank == 0:
                shutil.rmtree(os.path.dirname(path[0]))
    for kind in ("NO_SHARD", "FULL_SHARD"):
        diff = max((finals["DDP"][k] - v).abs().max().item() for k, v in finals[kind].items())
        same = all(torch.equal(finals["DDP"][k], v) for k, v in finals[kind].items())
        log(f"parameters after training, {kind} vs DDP: " + ("bit-identical" if same else f"max |diff| {diff:.2e}"))
        ok = ok and diff < 1e-5
    del model
    cleanup()
    if not ok:  # a failing rank makes mp.spawn / torchrun exit non-zero
        raise RuntimeError("ddp_template: the wrappers disagree (see the lines above)")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zeroshard.examples.ddp_template", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=positive_int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=positive_int, default=None, help="default: 20, or 5 with --small")
    p.add_argument("--small", action="store_true", help="CI size: 5 steps (an explicit --steps wins)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.small else 20
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun: this process is one rank
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        mp.spawn(worker, args=(args.world_size, args, free_port()), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
