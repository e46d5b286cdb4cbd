"""Quantized all-gather (ZeRO++ qwZ): ``quantized_all_gather=Int8BlockQuant(...)``.

Specification, in order:
1. the quantizer: symmetric absmax int8 per block, error ≤ scale / 2 per element (plus fp32 rounding), finite for any scale;
2. a quantized model computes exactly what ordinary ZeRO-3 computes on the
   dequantized weights (bit-identical outputs and reduced gradients), while its
   fp32 master shard stays untouched and summon_full_params gathers it exactly;
3. the bytes all-gathered per step are ≤ 0.3× of fp32 (and equal to the payload
   formula), the reduce-scatter bytes unchanged (full-precision gradients);
4. a small GPT trained 200 steps ends within 2% of the unquantized loss.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import zeroshard as zs
from models import Block, TinyGPT, TransformerBlock, batch, build
from zeroshard.quantize import Int8BlockQuant


# ---------------------------------------------------------------- 1. quantizer
@given(numel=st.integers(1, 700), block=st.sampled_from([1, 7, 64, 256]), half=st.booleans(),
       exp=st.integers(-30, 8), seed=st.integers(0, 1000))
def test_roundtrip_error_is_half_a_step(numel, block, half, exp, seed):
    q = Int8BlockQuant(block, torch.float16 if half else torch.float32)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 2.0**exp
    payload = q.quantize(x)
    assert payload.dtype == torch.int8 and payload.numel() == q.payload_bytes(numel)
    out = torch.empty(numel)
    q.dequantize(payload, numel, out)
    nb = q.blocks(numel)
    stored = payload[nb * block :].clone().view(q.scale_dtype).float()  # the scales as sent
    exact = torch.nn.functional.pad(x, [0, nb * block - numel]).view(nb, block).abs().amax(dim=1) / 127
    if half:  # rounded up to fp16: never below the exact step, within one fp16 ulp of it where normal
        assert (stored >= exact).all()
        normal = exact > torch.finfo(torch.float16).tiny
        assert (stored[normal] <= exact[normal] * (1 + 2.0**-10)).all()
    else:
        assert torch.equal(stored, exact)
    step = torch.repeat_interleave(stored, block)[:numel]
    # Half a step, plus the fp32 rounding of x / scale (up to 127 ulp-sized errors near a tie) and of q · scale.
    assert ((out - x).abs() <= step / 2 * (1 + 2.0**-15)).all()


def test_zero_and_constant_blocks():
    q = Int8BlockQuant(4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, -3.0, 3.0, 1.5])
    out = torch.empty(8)
    q.dequantize(q.quantize(x), 8, out)
    assert torch.equal(out[:4], torch.zeros(4))  # an all-zero block has scale 0, not NaN
    assert torch.equal(out[4:7], x[4:7])  # ±absmax is exactly ±127 steps
    with pytest.raises(ValueError):
        Int8BlockQuant(0)


def test_extreme_scales_stay_finite():
    """A tiny block (absmax below ~4e-37: 1 / scale overflows in fp32) and a
    block beyond fp16's range with fp16 scales (the scale saturates, no NaN)."""
    q32, q16 = Int8BlockQuant(4), Int8BlockQuant(4, torch.float16)
    tiny = torch.tensor([1e-38, -5e-39, 0.0, 2.5e-39])
    out = torch.empty(4)
    q32.dequantize(q32.quantize(tiny), 4, out)
    step = tiny.abs().max() / 127
    assert torch.isfinite(out).all() and ((out - tiny).abs() <= step / 2 * (1 + 2.0**-15)).all(), out
    huge = torch.tensor([1e7, -3e6, 0.0, 5.0])
    q16.dequantize(q16.quantize(huge), 4, out)
    assert torch.isfinite(out).all() and out[0] == 127 * 65504 and out[2] == 0, out


# ------------------------------------- 2. ZeRO-3 on the dequantized weights
def _policy(model):
    return zs.wrap.ModuleWrapPolicy({TransformerBlock} if model == "gpt" else {Block})


def _equals_zero3_on_dequantized(rank, world_size, model_name, use_orig_params, param_dtype):
    quant = Int8BlockQuant(block_size=64)
    base = build(model_name)
    mp = zs.MixedPrecision(param_dtype=param_dtype) if param_dtype else None
    kw = dict(auto_wrap_policy=_policy(model_name), use_orig_params=use_orig_params, mixed_precision=mp)
    qmodel = zs.FSDP(copy.deepcopy(base), quantized_all_gather=quant, **kw)
    ref = zs.FSDP(copy.deepcopy(base), **kw)
    handles = [[u._handle for u in zs.FSDP.fsdp_modules(m)] for m in (qmodel, ref)]
    masters = []
    for hq, hr in zip(*handles):
        masters.append(hq.local_shard.clone())
        # The reference holds, as its master, what the quantized model will compute with: its
        # blocks quantized with the padding as zeros (use_orig_params' alignment gaps hold
        # torch's marker 42, which would otherwise set their blocks' scales).
        real = hr.local_shard.clone()
        for start, end in hr.layout.shard_padding():
            real[start:end] = 0
        quant.dequantize(quant.quantize(real), real.numel(), hr.local_shard)
    with zs.comm_stats() as qstats:
        for step in range(2):  # accumulate two micro-batches
            out_q = qmodel(batch(model_name, rank, step))
            out_q.float().square().mean().backward()
    with zs.comm_stats() as rstats:
        for step in range(2):
            out_r = ref(batch(model_name, rank, step))
            out_r.float().square().mean().backward()
    assert torch.equal(out_q, out_r), "forward differs from ZeRO-3 on the dequantized weights"
    for (n, a), (_, b) in zip(qmodel.named_parameters(), ref.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"reduced gradient of {n} differs"
    for h, m in zip(handles[0], masters):  # the master shard is untouched
        assert torch.equal(h.local_shard, m)
    with zs.FSDP.summon_full_params(qmodel):  # and gathers exactly
        exact = all(torch.equal(a, b) for a, b in zip(qmodel.parameters(), base.parameters()))
    # The quantization is not a no-op on these weights.
    differs = any(not torch.equal(hq.local_shard, hr.local_shard) for hq, hr in zip(*handles))
    if use_orig_params and model_name == "mlp":  # its alignment gaps hold 42 (the case the padding mask is for)
        assert any(42 in hq.local_shard[s:e] for hq in handles[0] for s, e in hq.shard_padding)
    return exact, differs, dict(qstats.bytes), dict(rstats.bytes)


@pytest.mark.parametrize("model_name,use_orig_params,param_dtype", [
    ("mlp", False, None), ("mlp", True, None), ("gpt", True, None), ("gpt", False, torch.bfloat16)])
def test_computes_zero3_on_dequantized_weights(ranks, model_name, use_orig_params, param_dtype):
    for exact, differs, qbytes, rbytes in ranks.run(2, _equals_zero3_on_dequantized, model_name, use_orig_params,
                                                    param_dtype):
        assert exact and differs
        assert qbytes["reduce_scatter"] == rbytes["reduce_scatter"]  # gradients travel in full precision
        assert qbytes["all_gather"] < rbytes["all_gather"]


def _summon_while_gathered(rank, world_size, strategy, how):
    """A unit still holding its int8-dequantized gathered copy (ZeRO-2 after a
    no_sync micro-batch, the root after a forward with no backward) is
    gathered exactly again for summon_full_params and state dicts: they used
    to reuse that copy (the state dict then held quantized values, and an
    empty summon_full_params wrote them back into the fp32 master shards)."""
    base = build("mlp")
    model = zs.FSDP(copy.deepcopy(base), auto_wrap_policy=_policy("mlp"), quantized_all_gather=Int8BlockQuant(block_size=64),
                    sharding_strategy=getattr(zs.ShardingStrategy, strategy))
    shards = [u._handle.local_shard.clone() for u in zs.FSDP.fsdp_modules(model)]
    if how == "no_sync":
        with model.no_sync():
            model(batch("mlp", rank, 0)).square().mean().backward()
    else:
        model(batch("mlp", rank, 0))  # grad mode on, never backpropagated
    assert any(u._handle.unsharded for u in zs.FSDP.fsdp_modules(model))  # the case: a gathered, quantized copy
    sd = model.state_dict()
    with zs.FSDP.summon_full_params(model):  # writeback=True
        pass
    assert all(torch.equal(sd[k], v) for k, v in base.state_dict().items())
    assert all(torch.equal(u._handle.local_shard, s) for u, s in zip(zs.FSDP.fsdp_modules(model), shards))
    return True


@pytest.mark.parametrize("strategy,how", [("SHARD_GRAD_OP", "no_sync"), ("FULL_SHARD", "forward_only"),
                                          ("SHARD_GRAD_OP", "forward_only")])
def test_summon_and_state_dict_while_a_quantized_copy_is_gathered(ranks, strategy, how):
    assert all(ranks.run(2, _summon_while_gathered, strategy, how))


# --------------------------------------------- 3 and 4: bytes and training
def _sequences(rank: int, step: int, batch_size: int = 8, ctx: int = 16, vocab: int = 37):
    """Arithmetic progressions mod vocab: learnable (a start and a stride per row)."""
    g = torch.Generator().manual_seed(100_000 * rank + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 6, (batch_size, 1), generator=g)
    return (start + stride * torch.arange(ctx + 1)) % vocab


def _train_gpt(rank, world_size, quant, steps):
    torch.manual_seed(0)
    model = zs.FSDP(TinyGPT(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({TransformerBlock}),
                    quantized_all_gather=quant)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, per_step = [], None
    for step in range(steps):
        seq = _sequences(rank, step)
        with zs.comm_stats() as stats:
            loss = F.cross_entropy(model(seq[:, :-1]).reshape(-1, 37), seq[:, 1:].reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world_size)
        if step == 0:
            per_step = (dict(stats.calls), dict(stats.bytes))
    gathers = [(h.layout.shard_numel, 1 if h.is_root else 2) for h in model._runtime.handles]
    return losses, per_step, gathers


def test_bytes_and_loss_after_200_steps(ranks):
    """Measured (2 ranks, TinyGPT 3 blocks, blocks of 256 with fp32 scales):
    all-gather bytes 0.271× of fp32 (block padding of small shards included),
    mean loss of the last 20 steps 1.6363 vs 1.6306 unquantized (+0.35%)."""
    steps, world = 200, 2
    quant = Int8BlockQuant(block_size=256)
    (base_losses, (base_calls, base_bytes), gathers) = ranks.run(world, _train_gpt, None, steps)[0]
    (q_losses, (q_calls, q_bytes), _) = ranks.run(world, _train_gpt, quant, steps)[0]
    # 3. One all-gather per unshard either way (the scales ride in the int8 payload).
    assert q_calls == base_calls
    ratio = q_bytes["all_gather"] / base_bytes["all_gather"]
    assert ratio <= 0.3, ratio
    expected = sum(k * world * quant.payload_bytes(n) * (world - 1) / world for n, k in gathers)
    assert q_bytes["all_gather"] == pytest.approx(expected, rel=1e-12, abs=0)
    assert q_bytes["reduce_scatter"] == base_bytes["reduce_scatter"]
    # 4. Both runs really learn, and end within 2% of each other.
    base_final, q_final = sum(base_losses[-20:]) / 20, sum(q_losses[-20:]) / 20
    assert base_final < 0.2 * base_losses[0] and q_final < 0.2 * q_losses[0]
    assert abs(q_final - base_final) / base_final <= 0.02, (q_final, base_final)
    assert q_losses != base_losses  # the quantization did perturb training


def _qwz_misuse(rank, world_size):
    import warnings

    refused = []
    for bad in (Int8BlockQuant, "int8"):
        try:
            zs.FSDP(torch.nn.Linear(4, 4), quantized_all_gather=bad)
        except ValueError as e:
            refused.append(str(e))
    try:
        Int8BlockQuant(block_size=64.0)
    except ValueError as e:
        refused.append(str(e))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zs.FSDP(torch.nn.Linear(4, 4), sharding_strategy=zs.ShardingStrategy.NO_SHARD,
                quantized_all_gather=Int8BlockQuant())(torch.randn(2, 4))
        zs.FSDP(torch.nn.Linear(4, 4), quantized_all_gather=Int8BlockQuant())(torch.randn(2, 4))
    return refused, [str(w.message) for w in caught if "quantized_all_gather" in str(w.message)]


def test_qwz_misuse_is_named_at_construction(ranks):
    """The class instead of an instance and a float block_size failed inside the
    first forward (TypeErrors); qwZ on a model with no sharded unit did nothing, silently."""
    refused, warned = ranks.run(2, _qwz_misuse)[0]
    assert len(refused) == 3, refused
    assert "(an instance)" in refused[0] and "Int8BlockQuant() (called)" in refused[0]
    assert "is not a quantizer" in refused[1]
    assert "block_size=64.0" in refused[2] and "positive int" in refused[2]
    assert len(warned) == 2 and "has no effect" in warned[0] and "NO_SHARD" in warned[0], warned
    # A 20-element Linear over 2 ranks: 10-element shards, each sent as a whole 256-element block.
    assert "sends more bytes than the plain all-gather for units 'Linear'" in warned[1], warned


class _DelegatingQuant:
    """A user's own quantizer: any object with quantize / dequantize (default repr: an address)."""

    def __init__(self):
        self.inner = Int8BlockQuant(block_size=64)

    def quantize(self, shard):
        return self.inner.quantize(shard)

    def dequantize(self, payload, numel, out):
        return self.inner.dequantize(payload, numel, out)


def _custom_quantizer(rank, world_size):
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 16)
    ours = zs.FSDP(copy.deepcopy(base), quantized_all_gather=_DelegatingQuant())
    ref = zs.FSDP(copy.deepcopy(base), quantized_all_gather=Int8BlockQuant(block_size=64))
    x = torch.ones(2, 16)
    return torch.equal(ours(x), ref(x))


def test_a_custom_quantizer_is_not_refused_for_its_address(ranks):
    """Construction compared quantizers by str(): a class without a __repr__ differed on every rank."""
    assert ranks.run(2, _custom_quantizer) == [True, True]


class _Lookup(torch.nn.Module):
    """A frozen integer (or complex) table stored as a Parameter."""

    def __init__(self, values):
        super().__init__()
        self.ids = torch.nn.Parameter(values, requires_grad=False)

    def forward(self, x):
        return x + self.ids.abs().sum().real.float()


def _table_as_gathered(rank, world_size, values):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), _Lookup(values))
    seen = []
    net[1].register_forward_pre_hook(lambda m, a: seen.append(m.ids.detach().clone()))
    m = zs.FSDP(net, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({_Lookup}), quantized_all_gather=Int8BlockQuant(block_size=4))
    with torch.no_grad():
        m(torch.zeros(1, 4))
    return seen[0]


@pytest.mark.parametrize("values", [torch.arange(1000, 1010), torch.tensor([1 + 2j, 3 - 4j, 5 + 0.5j])])
def test_integer_and_complex_units_are_gathered_exactly(ranks, values):
    """qwZ quantized every sharded unit: ids 1000..1009 came back as 1003,1003,... and complex
    values lost their imaginary part, silently. Only floating-point units are quantized now."""
    for got in ranks.run(2, _table_as_gathered, values):
        assert torch.equal(got, values), got
