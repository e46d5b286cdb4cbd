"""The engine on a CUDA device: device_id handling, CPU offload's host<->device moves and
training parity with torch FSDP1 over NCCL. Skipped (with the reason) where no GPU is
visible; CI has none, so these run where a GPU machine is lent (see README)."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.demo import Block, CharGPT
from zeroshard.zero1 import ZeroOneOptimizer

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


def _accumulate(rank, world_size, mp):
    """Two micro-batches without zero_grad between, on the GPU and under CPU offload:
    world size 1 is NO_SHARD, whose reduced gradient offload moves to the CPU shard
    (in fp32 under mixed precision, where the compute copy is bf16)."""
    group = dist.new_group(backend="nccl")
    grads = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = zs.FSDP(CharGPT(128, d=64, heads=4, layers=2, ctx=16), process_group=group,
                        auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), device_id=torch.cuda.current_device(),
                        cpu_offload=zs.CPUOffload(offload_params=offload),
                        mixed_precision=zs.MixedPrecision(param_dtype=torch.bfloat16) if mp else None)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randint(0, 128, (4, 16), generator=g).cuda()
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        grads.append([p.grad.detach().cpu() for p in model.parameters()])
    return len(grads[0]) == len(grads[1]) and all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
def test_gradient_accumulation_under_cpu_offload(ranks, mp):
    assert ranks.run(1, _accumulate, mp) == [True]


def _zero1_offload(rank, world_size):
    """ZeRO-1 with the master on the CPU (offload_optimizer) and the model on the GPU, against
    the same moves by hand: fp32 copies on the CPU stepped there, written back."""
    torch.backends.cuda.matmul.allow_tf32 = False
    group = dist.new_group(backend="nccl")
    torch.manual_seed(0)
    model = CharGPT(128, d=64, heads=4, layers=2, ctx=16).cuda()
    ref = copy.deepcopy(model)
    make = lambda m: ZeroOneOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False), group,
                                      master_device=torch.device("cpu"), model=m)
    opt = make(model)
    host = [p.detach().cpu().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(host, lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)

    def step(models, opts):
        x = torch.randint(0, 128, (4, 16), generator=g).cuda()
        for m in models + [ref]:
            F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        for h, p in zip(host, ref.parameters()):
            h.grad, p.grad = p.grad.cpu(), None
        norms = []
        for o in opts:
            o.reduce_gradients()
            norms.append(o.clip_grad_norm_(float("inf"), norm_type=float("inf")))  # the norm alone: max |g|, exact
            o.step()
            o.zero_grad()  # else the master's .grad accumulates, as a plain .grad does
        assert all(n.item() == max(h.grad.abs().max().item() for h in host) for n in norms), norms
        ref_opt.step()
        with torch.no_grad():
            for h, p in zip(host, ref.parameters()):
                p.copy_(h)
        return all(torch.equal(a, b) for m in models for a, b in zip(m.parameters(), ref.parameters()))

    same = [step([model], [opt]) for _ in range(3)]
    assert {p.master.device.type for p in opt.parts} == {"cpu"} and {p.device.type for p in model.parameters()} == {"cuda"}
    # A checkpoint of the CPU masters, loaded into a fresh optimizer over a fresh copy, steps on identically.
    buf = io.BytesIO()  # through bytes, as a checkpoint goes: torch's in-memory state dicts share the step tensors
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    again = copy.deepcopy(model)
    opt2 = make(again)
    opt2.load_state_dict(sd)
    same.append(step([model, again], [opt, opt2]))
    return same


def test_zero1_offload_optimizer_on_gpu_matches_cpu_stepping(ranks):
    (same,) = ranks.run(1, _zero1_offload)
    assert same == [True] * 4
