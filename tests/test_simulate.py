"""The scale simulator: the ring α-β formula, ZeRO-3's communication volume, the
compute formula, the overlap bounds, and the published FSDP setups it must predict."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.simulate import (HARDWARE, LLAMA2, PUBLISHED, Model, gpt, link, main, predict, ring_time,
                                schedule, simulate, step_flops_per_token)

P4D = HARDWARE["a100-400g"]


# --------------------------------------------------------------- ring α-β formula
def test_ring_time_hand_values():
    # (n−1)·α + (n−1)/n · bytes/β: 7·5 µs + 7/8 · 1 GB / 100 GB/s = 35 µs + 8.75 ms
    assert ring_time(1e9, 8, 5e-6, 100.0) == pytest.approx(35e-6 + 8.75e-3, rel=1e-12)
    assert ring_time(2e9, 2, 0.0, 50.0) == pytest.approx(0.5 * 2e9 / 50e9)
    assert ring_time(1e9, 1, 5e-6, 100.0) == 0.0  # nothing to exchange with oneself


def test_slowest_link_of_the_ring():
    assert link(P4D, 8, 8) == (P4D.alpha_intra, 300.0)  # one node: NVLink
    # across 16 nodes: 15 of the 127 ring steps cross the network, at the node's 400 Gb/s
    alpha, beta = link(P4D, 128, 8)
    assert beta == 50.0 and alpha * 127 == pytest.approx(15 * 14e-6 + 112 * 3.4e-6)
    # HSDP's replica all-reduce: one rank per node, 8 such rings share each node's NICs
    assert link(P4D, 16, 1) == (pytest.approx(P4D.alpha_inter), 50.0 / 8)
    # a fast network never makes a ring faster than NVLink
    assert link(replace(P4D, network_gbps=1e4), 64, 8)[1] == 300.0


# --------------------------------------------------------------- communication volume
def _flat(psi=8e9, layers=32, root=0.0) -> Model:
    return Model("flat", layers, 4096, (psi - root) / layers, root)


@pytest.mark.parametrize("n", [2, 8, 64, 1024])
@pytest.mark.parametrize("dtype,c", [("bf16", 2), ("fp32", 4)])
def test_zero3_moves_3psi_zero2_2psi(n, dtype, c):
    m = _flat()
    full = simulate(m, n, "a100-400g", 1, 2048, dtype, "FULL_SHARD").comm_bytes
    grad_op = simulate(m, n, "a100-400g", 1, 2048, dtype, "SHARD_GRAD_OP").comm_bytes
    ddp = simulate(m, n, "a100-400g", 1, 2048, dtype, "NO_SHARD").comm_bytes
    ring = m.params * (n - 1) / n * c
    assert sum(full.values()) == pytest.approx(3 * ring, rel=1e-12)  # ZeRO paper: 3Ψ
    assert set(full) == {"forward all_gather", "backward all_gather", "reduce_scatter"}
    assert sum(grad_op.values()) == pytest.approx(2 * ring, rel=1e-12)  # no backward all-gather
    assert ddp == {"all_reduce": pytest.approx(2 * ring, rel=1e-12)}


def test_root_unit_is_gathered_once():
    # FSDP1 (and zeroshard) keep the root gathered from forward through backward: 3Ψ − Ψ_root.
    m = _flat(root=1e9)
    sent = simulate(m, 16, "a100-400g", 1, 2048, "bf16").comm_bytes
    ring = 2 * 15 / 16
    assert sent["forward all_gather"] == pytest.approx(m.params * ring)
    assert sent["backward all_gather"] == pytest.approx((m.params - 1e9) * ring)
    assert sum(sent.values()) == pytest.approx((3 * m.params - 1e9) * ring)


def test_hybrid_shard_volume():
    m, n, k = _flat(), 128, 8
    sent = simulate(m, n, "a100-400g", 1, 2048, "bf16", shard_group=k).comm_bytes
    r = n // k
    assert sent["forward all_gather"] + sent["backward all_gather"] + sent["reduce_scatter"] == \
        pytest.approx(3 * m.params * 2 * (k - 1) / k)
    assert sent["all_reduce"] == pytest.approx(2 * m.params * 2 / k * (r - 1) / r)
    with pytest.raises(ValueError, match="divide"):
        simulate(m, 100, "a100-400g", 1, 2048, shard_group=8)


# --------------------------------------------------------------- compute
def test_flops_hand_values():
    m = Model("toy", layers=2, d_model=4, block_params=100, root_params=50)
    # 6Ψ + 12·L·d·s = 6·250 + 12·2·4·8; recomputation adds 2Ψ_blocks + 4·L·d·s
    assert step_flops_per_token(m, 8) == (1500 + 768, 1500 + 768)
    assert step_flops_per_token(m, 8, ac=1.0) == (2268, 2268 + 400 + 256)
    assert step_flops_per_token(m, 8, ac=0.5) == (2268, 2268 + 328)
    r = simulate(m, 1, "a100-400g", 3, 8, ac=1.0, efficiency=0.5)
    assert r.compute_s == pytest.approx(3 * 8 * 2924 / (312e12 * 0.5), rel=1e-12)
    assert r.hw_flops == 3 * 8 * 2924 and r.model_flops == 3 * 8 * 2268


def test_matches_megatron_eq3_for_gpt():
    # Narayanan et al. 2021, eq. (3): F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), recomputation included.
    l, h, v, s, b = 96, 12288, 50000, 512, 20
    megatron = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    ours = b * s * step_flops_per_token(gpt("175B", l, h, v), s, ac=1.0)[1]
    assert ours == pytest.approx(megatron, rel=2e-4)  # the rest: 13h of biases and norms per block


def test_llama_shapes_give_the_released_parameter_counts():
    assert LLAMA2["7B"].params == 6_738_415_616
    assert LLAMA2["70B"].params == 68_976_648_192


def test_schedule_hand_values():
    fwd, bwd, ag_f, ag_b, rs = [1, 1], [2, 2], [0.5, 3], [0.5, 0.5], [1, 1]
    # forward 0.5 + max(1, 3) + 1; backward 0.5 + max(2, 0.5) + max(2, 1) + 1
    assert schedule(fwd, bwd, ag_f, ag_b, rs) == 4.5 + 4.5 + 1
    assert schedule(fwd, bwd, ag_f, ag_b, rs, prefetch=False) == 12.5


# --------------------------------------------------------------- monotone / limits
setups = st.fixed_dictionaries(dict(
    psi=st.floats(1e8, 2e12), layers=st.integers(1, 128), n=st.sampled_from([1, 2, 8, 16, 96, 512, 4096]),
    hw=st.sampled_from(sorted(HARDWARE)), mb=st.integers(1, 16), seq=st.sampled_from([512, 2048, 8192]),
    strategy=st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]), ac=st.sampled_from([0.0, 0.5, 1.0]),
    root=st.floats(0.0, 0.1)))


def _run(x, hw=None, **kw):
    m = Model("h", x["layers"], 4096, x["psi"] * (1 - x["root"]) / x["layers"], x["psi"] * x["root"])
    args = dict(model=m, gpus=x["n"], hardware=hw or HARDWARE[x["hw"]], micro_batch=x["mb"], seq=x["seq"],
                strategy=x["strategy"], ac=x["ac"])
    return simulate(**{**args, **kw})


@settings(max_examples=20)
@given(setups, st.floats(1.0, 100.0))
def test_more_bandwidth_never_slows_a_step(x, factor):
    hw = HARDWARE[x["hw"]]
    fast = replace(hw, network_gbps=hw.network_gbps * factor, nvlink_gbps=hw.nvlink_gbps * factor)
    for prefetch in (True, False):
        assert _run(x, fast, prefetch=prefetch).step_s <= _run(x, prefetch=prefetch).step_s * (1 + 1e-12)


@settings(max_examples=20)
@given(setups)
def test_prefetch_step_between_max_and_sum(x):
    r = _run(x)
    assert max(r.compute_s, r.comm_s) * (1 - 1e-12) <= r.step_s <= (r.compute_s + r.comm_s) * (1 + 1e-12)
    assert _run(x, prefetch=False).step_s == pytest.approx(r.compute_s + r.comm_s, rel=1e-12)


@settings(max_examples=20)
@given(setups)
def test_one_gpu_has_no_communication(x):
    r = _run({**x, "n": 1})
    assert r.comm_s == 0.0 and r.comm_bytes == {} and r.step_s == pytest.approx(r.compute_s, rel=1e-12)


@settings(max_examples=20)
@given(setups)
def test_larger_batch_never_lowers_throughput(x):
    # compute grows with the batch, communication does not: tokens/s can only rise
    assert _run({**x, "mb": x["mb"] + 1}).tokens_per_s >= _run(x).tokens_per_s * (1 - 1e-12)


# --------------------------------------------------------------- published setups
@pytest.mark.parametrize("setup", PUBLISHED, ids=[s["name"] for s in PUBLISHED])
def test_published_setup_within_factor_two(setup):
    # One efficiency per GPU type (Megatron-LM's published figures), none per row.
    assert "efficiency" not in setup
    _, pred = predict(setup)
    assert 0.5 <= pred / setup["published"] <= 2.0, (setup["name"], pred, setup["published"])


@pytest.mark.parametrize("setup", PUBLISHED, ids=[s["name"] for s in PUBLISHED])
def test_published_setup_cites_its_number(setup):
    assert setup["metric"] in ("TFLOPS/GPU", "tokens/s/GPU")
    assert f"{setup['published']:.0f}" in setup["quote"]
    assert "http" in setup["source"] and "20" in setup["source"]  # an address and a year


def test_cli_prints_table_and_custom_setup(capsys):
    text = main([])
    assert all(s["name"] in text for s in PUBLISHED) and "predicted/published" in text
    one = main(["--params", "7e9", "--world-size", "1", "--hardware", "h100-3.2t"])
    assert "exposed communication | 0.000 s" in one and "bytes sent" not in one
    hsdp = main(["--params", "7e9", "--world-size", "128", "--shard-group", "8", "--ac", "1"])
    assert "all_reduce" in hsdp and "reduce_scatter" in hsdp
    capsys.readouterr()


@pytest.mark.parametrize("argv, said", [
    (["--world-size", "8"], "--world-size describes a custom setup: give --params too"),
    (["--params", "7e9", "--world-size", "0"], "argument --world-size: 0 must be >= 1"),
    (["--params", "7e9", "--layers", "0"], "argument --layers: 0 must be >= 1"),
    (["--params", "7e9", "--ac", "-1"], "argument --ac: -1.0 must be between 0 and 1"),
    (["--params", "7e9", "--efficiency", "5"], "argument --efficiency: 5.0 must be between 0 and 1"),
    (["--params", "nan"], "argument --params: nan must be a finite number > 0"),
    (["--params", "1e308"], "argument --params: 1e+308 parameters is beyond any model"),  # printed inf / nan
    (["--params", "7e9", "--shard-group", "128"], "--shard-group 128 must divide --world-size 64"),
    (["--world-size", "64"], "--world-size describes a custom setup"),  # the default's value, given: was ignored
    (["--world", "8"], "unrecognized arguments: --world 8"),  # an abbreviation would slip past the check above
    (["--params", "7e9", "--strategy", "NO_SHARD", "--shard-group", "2"], "NO_SHARD shards nothing"),  # was ignored
    # groups of 3 contiguous ranks straddle 8-GPU nodes: they were priced as NVLink (review)
    (["--params", "7e9", "--world-size", "24", "--shard-group", "3"], "neither divides nor is a multiple of the 8 GPUs"),
])
def test_cli_refuses_what_it_cannot_model(argv, said, capsys):
    """These divided by zero, printed negative or >100 % figures, or ignored the flags."""
    with pytest.raises(SystemExit):
        main(argv)
    assert said in capsys.readouterr().err
