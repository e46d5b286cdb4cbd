"""Bit-exact parity with torch FSDP1 (device_id=cpu) for fp32 training:
outputs, accumulated gradients, clip_grad_norm_, parameters after AdamW."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parity import run_case

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
PREFETCH = [
    dict(backward_prefetch="BACKWARD_PRE"),
    dict(backward_prefetch="BACKWARD_POST"),
    dict(backward_prefetch=None, forward_prefetch=True),
    dict(backward_prefetch="BACKWARD_PRE", forward_prefetch=True, limit_all_gathers=False),
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_strategies_and_prefetch(ranks, world_size, strategy, use_orig_params):
    for prefetch in PREFETCH:
        ranks.run(world_size, run_case, dict(strategy=strategy, use_orig_params=use_orig_params, **prefetch))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("policy", ["transformer", "size", "lambda", "manual", "none"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_transformer_wrapping(ranks, world_size, policy, use_orig_params):
    ranks.run(world_size, run_case, dict(model="gpt", policy=policy, use_orig_params=use_orig_params, min_num_params=2000))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_no_sync_accumulation(ranks, world_size, strategy, use_orig_params):
    ranks.run(world_size, run_case, dict(strategy=strategy, use_orig_params=use_orig_params, no_sync=True, accum=3))


def test_clip_norm_is_reported(ranks):
    """The clipping comparison above is not vacuous: the norm exceeds max_norm."""
    (out, _) = ranks.run(2, run_case, dict(clip=0.05))
    assert all(n > 0.05 for n in out["norms"])


@given(
    dims=st.tuples(st.integers(1, 9), st.integers(1, 12), st.integers(1, 20), st.integers(1, 4), st.integers(1, 5)),
    world_size=st.integers(1, 4),
    policy=st.sampled_from(["module", "size", "lambda", "manual", "none"]),
    min_num_params=st.integers(1, 400),
    strategy=st.sampled_from(STRATEGIES),
    use_orig_params=st.booleans(),
    backward_prefetch=st.sampled_from([None, "BACKWARD_PRE", "BACKWARD_POST"]),
    forward_prefetch=st.booleans(),
)
def test_random_mlp_trains_bit_identically(ranks, dims, world_size, policy, min_num_params, strategy, use_orig_params, backward_prefetch, forward_prefetch):
    d_in, d, hidden, n_blocks, d_out = dims
    ranks.run(world_size, run_case, dict(
        model_kwargs=dict(d_in=d_in, d=d, hidden=hidden, n_blocks=n_blocks, d_out=d_out), policy=policy,
        min_num_params=min_num_params, strategy=strategy, use_orig_params=use_orig_params,
        backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch, steps=2,
    ))


MIXED = [
    dict(param_dtype="bfloat16"),
    dict(param_dtype="bfloat16", reduce_dtype="float32", buffer_dtype="bfloat16"),
    dict(param_dtype="float16", reduce_dtype="float16", buffer_dtype="float16", cast_forward_inputs=True),
    dict(reduce_dtype="bfloat16"),
]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_mixed_precision(ranks, world_size, strategy, use_orig_params):
    """bf16/fp16 all-gather and compute, reductions in reduce_dtype, fp32
    master shards: still bit-identical, since both engines round the same
    values at the same points."""
    for mp in MIXED:
        ranks.run(world_size, run_case, dict(strategy=strategy, use_orig_params=use_orig_params, mp=mp))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_mixed_precision_transformer_no_sync(ranks, use_orig_params):
    ranks.run(2, run_case, dict(model="gpt", policy="transformer", use_orig_params=use_orig_params, no_sync=True,
                                mp=dict(param_dtype="bfloat16", reduce_dtype="float32")))


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
@pytest.mark.parametrize("how", ["tuple", "mesh", "group_size"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_hybrid_sharding(ranks, strategy, how, use_orig_params):
    """Shard within pairs of ranks, replicate across them (4 ranks): equal to
    torch FSDP1 given process_group=(shard, replicate); zeroshard's
    fsdp_group_size=2 and a 2-D DeviceMesh describe the same layout."""
    ranks.run(4, run_case, dict(strategy=strategy, hybrid=how, use_orig_params=use_orig_params))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("policy", ["lambda", "none"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_frozen_parameters_use_orig_params(ranks, world_size, policy, strategy):
    """LoRA-style units mixing frozen and trainable parameters
    (use_orig_params=True): same grads (None for frozen) and same optimizer
    states as torch FSDP1, and no state at all for the frozen parameters."""
    results = ranks.run(world_size, run_case, dict(model="lora", policy=policy, strategy=strategy, use_orig_params=True))
    for r in results:
        assert not any(n.endswith(("base.weight", "base.bias", "out.weight")) for n in r["with_state"]), r["with_state"]
        assert any("lora" in n for n in sum((x["with_state"] for x in results), []))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_wholly_frozen_units(ranks, strategy, use_orig_params):
    """A unit whose parameters are all frozen (one block, frozen before
    wrapping) wraps and trains as under torch FSDP1: it gathers for forward,
    gets no gradient and no optimizer state."""
    results = ranks.run(2, run_case, dict(strategy=strategy, use_orig_params=use_orig_params, freeze=("blocks.1",)))
    assert not any(n.startswith("_fsdp_wrapped_module.blocks.1.") for n in results[0]["with_state"]), results[0]["with_state"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_keep_low_precision_grads(ranks, strategy, use_orig_params):
    """keep_low_precision_grads: the optimizer sees grads in param_dtype (bf16)
    on fp32 parameters, accumulated in fp32 across steps; equal to torch FSDP1
    (grads' dtype and values, clip norm, parameters after SGD steps)."""
    ranks.run(2, run_case, dict(strategy=strategy, use_orig_params=use_orig_params, optim="sgd", clip=0.05,
                                mp=dict(param_dtype="bfloat16", reduce_dtype="float32", keep_low_precision_grads=True)))
