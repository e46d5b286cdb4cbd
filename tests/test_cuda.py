"""The engine on a CUDA device: device_id handling, CPU offload's host<->device moves and
training parity with torch FSDP1 over NCCL. Skipped (with the reason) where no GPU is
visible; CI has none, so these run where a GPU machine is lent (see README)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.demo import Block, CharGPT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _wrong_device(rank, world_size):
    model = CharGPT(64, d=32, heads=2, layers=1, ctx=8).cuda()
    try:
        zs.FSDP(model, device_id=torch.device("cpu"))
    except ValueError as e:
        return str(e)
    return None


def test_module_on_another_device_than_device_id(ranks):
    (msg,) = ranks.run(1, _wrong_device)
    assert msg is not None and "cuda:0" in msg and "device_id=cpu" in msg and "Fix" in msg


def _train(engine, offload, group, steps=3):
    torch.manual_seed(0)
    model = CharGPT(128, d=64, heads=4, layers=3, ctx=16)
    dev = torch.cuda.current_device()
    if engine == "torch":
        from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         device_id=dev, cpu_offload=CPUOffload(offload_params=offload))
    else:
        model = zs.FSDP(model, process_group=group, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                        device_id=dev, cpu_offload=zs.CPUOffload(offload_params=offload))
    # Fused/foreach AdamW kernels differ between CPU and GPU: plain loop on both engines.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 128, (4, 16), generator=g).cuda()
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    params = [p.detach().cpu().clone() for p in model.parameters()]
    devices = {p.device.type for p in model.parameters()}
    return losses, params, devices


def _parity(rank, world_size, offload):
    torch.backends.cuda.matmul.allow_tf32 = False
    group = dist.new_group(backend="nccl")
    ours, ref = _train("zeroshard", offload, group), _train("torch", offload, group)
    assert ours[2] == ref[2], f"parameter devices differ: {ours[2]} vs torch {ref[2]}"
    assert all(torch.equal(a, b) for a, b in zip(ours[0], ref[0])), (ours[0], ref[0])
    assert len(ours[1]) == len(ref[1]) and all(torch.equal(a, b) for a, b in zip(ours[1], ref[1]))
    return zs.ext_backend("cuda"), sorted(ours[2])


@pytest.mark.parametrize("offload", [False, True], ids=["on_gpu", "cpu_offload"])
def test_cuda_training_matches_torch_fsdp1(ranks, offload):
    ((backend, devices),) = ranks.run(1, _parity, offload)
    assert backend == "cuda", "the CUDA flatten kernels are not in use"
    assert devices == (["cpu"] if offload else ["cuda"])
