"""The hfai FSDP workflow on CPU ranks: train, save a full checkpoint from
rank 0 inside ``summon_full_params()``, save per-rank local shards, reload both.

Run: ``python -m zeroshard.examples.hfai_style --world-size 4 --group-size 2``.
Only the import line differs from a script written for hfai.distributed.fsdp.
"""
from __future__ import annotations

import argparse
import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.compat.hfai import FullyShardedDataParallel, size_based_auto_wrap_policy
from zeroshard.cli_args import check_output_path, positive_int
from zeroshard.testing import spawn


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def train(rank, world_size, args):
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        make_model(), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
        fsdp_group_size=args["group_size"], reshard_after_forward=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(args["steps"]):
        x = torch.randn(32, 16, generator=g)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}  loss {loss.item():.4f}", flush=True)

    out = args["out"]
    os.makedirs(out, exist_ok=True)
    with model.summon_full_params():  # every rank enters; only rank 0 saves
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(out, "full.pt"))
    torch.save(model.state_dict(), os.path.join(out, f"model{rank}.pt"))  # local shard, no communication
    dist.barrier()

    plain = make_model()
    plain.load_state_dict(torch.load(os.path.join(out, "full.pt")), strict=True)
    x = torch.randn(8, 16, generator=g)
    same_full = torch.equal(plain(x), model(x))

    torch.manual_seed(1)  # a differently initialized model, restored from the local shards
    fresh = FullyShardedDataParallel(make_model(), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
                                     fsdp_group_size=args["group_size"])
    fresh.load_state_dict(torch.load(os.path.join(out, f"model{rank}.pt")))
    same_local = torch.equal(fresh(x), model(x))
    return losses, same_full, same_local


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zeroshard.examples.hfai_style", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=positive_int, default=4)
    p.add_argument("--group-size", type=positive_int, default=2, help="fsdp_group_size: ranks per shard group")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    args = vars(p.parse_args(argv))
    if args["world_size"] % args["group_size"]:
        p.error(f"--group-size {args['group_size']} must divide --world-size {args['world_size']}")
    check_output_path(p, "--out", args["out"], is_dir=True)
    with tempfile.TemporaryDirectory() as tmp:
        args["out"] = args["out"] or tmp
        results = spawn(train, args["world_size"], args, timeout=300)
    losses, ok_full, ok_local = results[0]
    all_ok = all(r[1] and r[2] for r in results)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; full checkpoint reloads in a plain model: {ok_full}; "
          f"local shards restore a fresh model: {ok_local}")
    fell = len(losses) < 2 or losses[-1] < losses[0]  # (one step: nothing to compare)
    if not fell:
        print(f"FAILED: the loss did not fall over {len(losses)} steps (try more --steps)")
    if not all_ok:
        print("FAILED: a checkpoint did not restore the model (see the checks above)")
    return 0 if all_ok and fell else 1


if __name__ == "__main__":
    raise SystemExit(main())
