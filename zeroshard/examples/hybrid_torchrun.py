"""HYBRID_SHARD across two "nodes" started by torchrun: shard within a node,
replicate across nodes.

Hybrid sharding (HSDP) is what multi-node jobs use when the network between
nodes is the bottleneck: ZeRO-3 inside each node (the all-gathers and
reduce-scatters stay on the fast links within a node) and plain data
parallelism across nodes (one all-reduce of each gradient shard crosses the
slow link). Each rank then holds 1/(ranks per node) of every unit, not
1/(all ranks): memory traded for cheaper communication.

zeroshard reads the node structure from torchrun: with HYBRID_SHARD and no
process groups it shards over LOCAL_WORLD_SIZE consecutive ranks (one node)
and replicates across nodes. This script trains the demo's character-level
GPT and checks, on every rank:

* each rank holds half of every unit (a node has 2 ranks), not a quarter;
* the two ranks of a node hold different halves, and local rank r of node 0
  holds exactly what local rank r of node 1 holds (replicas);
* torch FSDP1 with HYBRID_SHARD over the same groups (a 2-D DeviceMesh:
  replicate across nodes, shard within one) trains to bit-identical losses
  and parameters.

Two "nodes" of 2 ranks on one machine (two terminals, any free port P):

  torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 --master-addr=127.0.0.1 --master-port=P -m zeroshard.examples.hybrid_torchrun
  torchrun --nnodes=2 --nproc-per-node=2 --node-rank=1 --master-addr=127.0.0.1 --master-port=P -m zeroshard.examples.hybrid_torchrun

On real machines use each node's own rank and the first node's address.
"""
from __future__ import annotations

import argparse
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.demo import Block, CharGPT, _batches, load_text
from zeroshard.cli_args import positive_int


def build(engine: str, vocab: int, args, nnodes: int, per_node: int):
    torch.manual_seed(0)  # the same initial weights on every rank and for both engines
    model = CharGPT(vocab, d=args.d_model, heads=4, layers=2, ctx=args.ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if engine == "zeroshard":  # the node structure comes from torchrun (LOCAL_WORLD_SIZE)
            return zs.FullyShardedDataParallel(model, sharding_strategy=zs.ShardingStrategy.HYBRID_SHARD,
                                               auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mesh = init_device_mesh("cpu", (nnodes, per_node), mesh_dim_names=("replicate", "shard"))
        return FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh,
                                        auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))


def train(model, ids, rank, args):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in _batches(ids, rank, args.steps, args.batch, args.ctx):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(prog="torchrun ... -m zeroshard.examples.hybrid_torchrun", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=None, help="default: 20, or 4 with --small")
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--ctx", type=positive_int, default=32)
    # Not --d: torchrun reads it as an ambiguous prefix of its own --duplicate-* options.
    p.add_argument("--d-model", type=positive_int, default=64, help="model width")
    p.add_argument("--small", action="store_true", help="CI size: 4 steps (an explicit --steps wins)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.small else 20
    if "LOCAL_WORLD_SIZE" not in os.environ:
        p.error("launch me with torchrun (see the docstring): I need RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    node, nnodes = rank // per_node, world // per_node
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # env:// from torchrun
    torch.set_num_threads(1)
    text = load_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text[:20_000]], dtype=torch.long)

    ours = build("zeroshard", len(chars), args, nnodes, per_node)
    losses = train(ours, ids, rank, args)
    total = sum(p.numel() for p in CharGPT(len(chars), d=args.d_model, heads=4, layers=2, ctx=args.ctx).parameters())
    shard = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])  # this rank's flat shards, unit after unit
    shards = [None] * world
    dist.all_gather_object(shards, shard)
    replica = shards[(rank + per_node) % world]  # the same local rank on the other node
    neighbour = shards[node * per_node + (local_rank + 1) % per_node]  # the other rank of this node
    checks = {
        # 1/per_node of each unit, rounded up to whole elements (the shard padding)
        f"holds 1/{per_node} of the model": 0 <= shard.numel() - total / per_node < len(list(ours.parameters())),
        "replicas across nodes identical": torch.equal(shard, replica),
        "ranks within a node hold different halves": not torch.equal(shard, neighbour),
    }
    full = ours.state_dict()  # FULL_STATE_DICT (collective)

    ref = build("torch", len(chars), args, nnodes, per_node)
    ref_losses = train(ref, ids, rank, args)
    ref_full = ref.state_dict()
    checks["losses equal torch FSDP1 HYBRID_SHARD"] = ref_losses == losses
    checks["parameters equal torch FSDP1 HYBRID_SHARD"] = all(torch.equal(v, ref_full[k]) for k, v in full.items())
    checks["loss decreased"] = losses[-1] < losses[0]

    verdicts = [None] * world
    dist.all_gather_object(verdicts, checks)
    if local_rank == 0:  # one report per node
        print(f"node {node}: ranks {node * per_node}-{node * per_node + per_node - 1} of {world}, HYBRID_SHARD, "
              f"rank {rank} holds {shard.numel()} of {total} parameter elements; "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps", flush=True)
        for name in checks:
            ok = all(v[name] for v in verdicts)
            print(f"node {node}: {name}: {'yes' if ok else 'NO'} (all {world} ranks)", flush=True)
    dist.barrier()  # all ranks done before any tears gloo down (see ddp_template.cleanup)
    dist.destroy_process_group()
    if not all(all(v.values()) for v in verdicts):
        raise SystemExit(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
