"""torch's FSDP MNIST tutorial, on CPU ranks, with zeroshard.

The workflow of "Getting Started with Fully Sharded Data Parallel (FSDP)"
(pytorch.org/tutorials/intermediate/FSDP_tutorial.html), step for step:
``mp.spawn`` one process per rank, ``DistributedSampler`` (with
``set_epoch`` so every epoch shuffles differently), ``size_based_auto_wrap_policy``
(min_num_params=100), the tutorial's CNN, Adadelta with StepLR, a train loop
and a test loop whose loss / accuracy sums are all-reduced, and a FULL state
dict saved by rank 0. The differences: MNIST is replaced by scikit-learn's
bundled 8x8 digits (1,797 images, no download; 80/20 split, seed 0), so the
CNN's first linear layer takes 64x2x2 features instead of 9216; gloo instead
of NCCL; and the saved checkpoint is reloaded into a plain ``Net`` to check
that it gives the same test accuracy.

Run: ``python -m zeroshard.examples.mnist_digits`` (2 ranks, 10 epochs, about
5 s of training on 2 CPU cores). Measured test accuracy: 97.8 % (352/360
images) after 10 epochs, and the same after 5 (``--small``, CI's size; CI
asserts at least 95 %). Needs scikit-learn (``pip install scikit-learn``).
"""
from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import zeroshard as fsdp
from zeroshard.cli_args import check_output_path, positive_int
from zeroshard.testing import free_port
from zeroshard.wrap import size_based_auto_wrap_policy

FSDP = fsdp.FullyShardedDataParallel


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))


def cleanup():
    # Every rank past its last collective before any tears gloo down: a rank
    # exiting while its peer still shut down once aborted in CI.
    dist.barrier()
    dist.destroy_process_group()


class Net(nn.Module):
    """The tutorial's CNN, sized for 8x8 inputs (8 -> 6 -> 4 -> pooled 2)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets():
    """scikit-learn's 8x8 digits as (train, test) TensorDatasets, pixels scaled to [0, 1]
    and normalized with the training set's mean and std (as the tutorial does for MNIST)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_train = int(0.8 * len(y))
    train, test = perm[:n_train], perm[n_train:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def train(args, model, rank, world_size, train_loader, optimizer, epoch, sampler=None):
    model.train()
    ddp_loss = torch.zeros(2)
    if sampler:
        sampler.set_epoch(epoch)
    for data, target in train_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target, reduction="sum")
        loss.backward()
        optimizer.step()
        ddp_loss[0] += loss.item()
        ddp_loss[1] += len(data)
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        print(f"Train Epoch: {epoch} \tLoss: {ddp_loss[0] / ddp_loss[1]:.6f}", flush=True)
    return (ddp_loss[0] / ddp_loss[1]).item()


def test(model, rank, world_size, test_loader):
    model.eval()
    ddp_loss = torch.zeros(3)
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            ddp_loss[0] += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            ddp_loss[1] += pred.eq(target.view_as(pred)).sum().item()
            ddp_loss[2] += len(data)
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    accuracy = (ddp_loss[1] / ddp_loss[2]).item()
    if rank == 0:
        print(f"Test set: Average loss: {ddp_loss[0] / ddp_loss[2]:.4f}, "
              f"Accuracy: {int(ddp_loss[1])}/{int(ddp_loss[2])} ({100.0 * accuracy:.2f}%)\n", flush=True)
    return accuracy


def fsdp_main(rank, world_size, args):
    setup(rank, world_size, args.port)
    torch.set_num_threads(1)  # one core per rank
    torch.manual_seed(args.seed)
    dataset1, dataset2 = digits_datasets()
    sampler1 = DistributedSampler(dataset1, rank=rank, num_replicas=world_size, shuffle=True)
    sampler2 = DistributedSampler(dataset2, rank=rank, num_replicas=world_size)
    train_loader = DataLoader(dataset1, batch_size=args.batch_size, sampler=sampler1)
    test_loader = DataLoader(dataset2, batch_size=args.test_batch_size, sampler=sampler2)
    my_auto_wrap_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)

    t0 = time.perf_counter()
    model = FSDP(Net(), auto_wrap_policy=my_auto_wrap_policy)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    if rank == 0:  # what the optimizer sees: one FlatParameter shard per unit
        total = sum(p.numel() for p in Net().parameters())
        print(f"Net: {total} parameters; rank 0 holds", flush=True)
        for name, p in model.named_parameters():
            print(f"  {name.replace('_fsdp_wrapped_module.', '') or '<root>'}: {p.numel()} elements", flush=True)
    for epoch in range(1, args.epochs + 1):
        train(args, model, rank, world_size, train_loader, optimizer, epoch, sampler=sampler1)
        accuracy = test(model, rank, world_size, test_loader)
        scheduler.step()
    if rank == 0:
        print(f"{args.epochs} epochs in {time.perf_counter() - t0:.1f} s on {world_size} ranks", flush=True)

    if args.save_model:
        # Every rank takes part in gathering the FULL state dict; only rank 0 keeps it.
        dist.barrier()
        cfg = fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, cfg):
            states = model.state_dict()
        if rank == 0:
            fsdp.checkpoint.save(states, args.save_model)  # torch.save, atomically
            # The file is a plain state dict: a plain Net loads it and scores the same.
            plain = Net()
            plain.load_state_dict(fsdp.checkpoint.load(args.save_model), strict=True)
            plain.eval()
            x, y = dataset2.tensors
            with torch.no_grad():
                reloaded = (plain(x).argmax(dim=1) == y).float().mean().item()
            gone = " (temporary: deleted at exit; pass --save-model to keep it)" if args.temporary else ""
            print(f"saved {args.save_model}{gone}: a plain Net loaded from it scores {100 * reloaded:.2f}% "
                  f"({'same as' if reloaded == accuracy else 'DIFFERENT FROM'} the sharded model)", flush=True)
    dist.barrier()
    cleanup()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m zeroshard.examples.mnist_digits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=positive_int, default=64, metavar="N", help="input batch size per rank for training")
    parser.add_argument("--test-batch-size", type=positive_int, default=1000, metavar="N")
    parser.add_argument("--epochs", type=positive_int, default=None, metavar="N", help="default: 10, or 5 with --small")
    parser.add_argument("--lr", type=float, default=1.0, metavar="LR", help="Adadelta learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M", help="learning rate step gamma")
    parser.add_argument("--seed", type=int, default=1, metavar="S")
    parser.add_argument("--world-size", type=positive_int, default=2)
    parser.add_argument("--save-model", default=None, metavar="PATH",
                        help="where rank 0 saves the FULL state dict (default: a temporary file)")
    parser.add_argument("--no-save", dest="save", action="store_false")
    parser.add_argument("--small", action="store_true", help="CI size: 5 epochs (an explicit --epochs wins)")
    args = parser.parse_args(argv)
    check_output_path(parser, "--save-model", args.save_model if args.save else None)
    if args.epochs is None:
        args.epochs = 5 if args.small else 10
    args.port = free_port()
    args.temporary = args.save and args.save_model is None
    with tempfile.TemporaryDirectory() as tmp:
        if not args.save:
            args.save_model = None
        elif args.save_model is None:
            args.save_model = os.path.join(tmp, "digits_cnn.pt")
        mp.spawn(fsdp_main, args=(args.world_size, args), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
