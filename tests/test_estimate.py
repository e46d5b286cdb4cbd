"""The memory estimator: the ZeRO paper's formulas, agreement with the engine's
real layouts, and measured model-state bytes after an optimizer step."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

import zeroshard as zs
from models import MLP, Block, TinyGPT, TransformerBlock
from zeroshard.estimate import comm_volume, estimate_model, model_states

GB = 1e9


# --------------------------------------------------------------- (1) formulas
@pytest.mark.parametrize(
    "strategy,expected",
    [
        ("FULL_SHARD", 16 * 7e9 / 64),  # 1.75e9
        ("SHARD_GRAD_OP", 2 * 7e9 + 14 * 7e9 / 64),  # 15.53125e9
        ("ZERO1", 4 * 7e9 + 12 * 7e9 / 64),  # 29.3125e9
        ("NO_SHARD", 16 * 7e9),  # 112e9
    ],
)
def test_paper_formulas_7b_64(strategy, expected):
    r = model_states(7e9, 64, strategy, "bf16", "paper")
    assert r.total == expected
    assert {"FULL_SHARD": 1.75e9, "SHARD_GRAD_OP": 15.53125e9, "ZERO1": 29.3125e9, "NO_SHARD": 112e9}[strategy] == r.total


@pytest.mark.parametrize(
    "psi,n,gb",  # ZeRO paper, Table 1 (GB = 1e9 bytes): DDP, P_os, P_os+g, P_os+g+p
    [(7.5e9, 64, (120, 31.4, 16.6, 1.88)), (128e9, 1024, (2048, 513, 258, 2)), (1e12, 1024, (16000, 4011, 2013, 15.6))],
)
def test_paper_table_1(psi, n, gb):
    got = [model_states(psi, n, s, "fp16").total / GB for s in ("NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD")]
    assert got == pytest.approx(gb, rel=3e-3)  # the paper prints 3-4 significant digits


def test_fp32_split_and_zeroshard_rows():
    psi, n = 1e9, 8
    fp32 = {s: model_states(psi, n, s, "none") for s in ("FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD")}
    assert (fp32["FULL_SHARD"].params, fp32["FULL_SHARD"].grads, fp32["FULL_SHARD"].optim) == (4 * psi / n, 4 * psi / n, 8 * psi / n)
    assert fp32["SHARD_GRAD_OP"].total == 4 * psi + 12 * psi / n
    assert fp32["ZERO1"].total == 8 * psi + 8 * psi / n
    assert fp32["NO_SHARD"].total == 16 * psi
    # zeroshard keeps the fp32 master as the parameter: 16Ψ/N sharded under bf16 too,
    # plus the gathered bf16 copy (all of it for SHARD_GRAD_OP).
    z3 = model_states(psi, n, "FULL_SHARD", "bf16", "zeroshard")
    z2 = model_states(psi, n, "SHARD_GRAD_OP", "bf16", "zeroshard")
    assert z3.total == z2.total == 16 * psi / n and z3.working_set is None and z2.working_set == 2 * psi
    assert model_states(psi, n, "NO_SHARD", "none", "zeroshard").working_set == 0
    assert z3.accounting == "zeroshard FSDP1-style" and fp32["ZERO1"].accounting == "ZeRO paper"
    with pytest.raises(ValueError, match="ZeRO-1"):
        model_states(psi, n, "ZERO1", "bf16", "zeroshard")


# ------------------------------------------- (2) agreement with the engine
def _policy(name):
    return {
        "mlp": zs.wrap.ModuleWrapPolicy({Block}),
        "gpt": zs.wrap.ModuleWrapPolicy({TransformerBlock}),
        "size": functools.partial(zs.wrap.size_based_auto_wrap_policy, min_num_params=150),
        "size1k": functools.partial(zs.wrap.size_based_auto_wrap_policy, min_num_params=1000),
    }[name]


def _model(name):
    torch.manual_seed(0)
    return MLP(n_blocks=4) if name == "mlp" else TinyGPT()


def _engine_layouts(rank, world_size, model_name, policy_name, use_orig_params, param_dtype):
    mp = zs.MixedPrecision(param_dtype=param_dtype) if param_dtype is not None else None
    model = zs.FSDP(_model(model_name), auto_wrap_policy=_policy(policy_name), use_orig_params=use_orig_params,
                    mixed_precision=mp)
    units = zs.FSDP.fsdp_modules(model)
    return [(u._handle.layout.numel, u._handle.layout.padded_numel, u._handle.layout.shard_numel)
            if u._handle is not None else (0, 0, 0) for u in units]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "model_name,policy_name,use_orig_params,param_dtype",
    [("mlp", "mlp", False, None), ("gpt", "gpt", False, None), ("gpt", "gpt", True, torch.bfloat16),
     ("mlp", "size", True, None), ("gpt", "size1k", False, None)],
)
def test_estimate_matches_engine_layouts(ranks, world_size, model_name, policy_name, use_orig_params, param_dtype):
    est = estimate_model(_model(model_name), world_size, _policy(policy_name), param_dtype=param_dtype,
                         use_orig_params=use_orig_params)
    expected = [(u.numel, u.padded_numel, u.shard_numel) for u in est.units]
    assert len(expected) > 1  # the policy really made nested units
    for layouts in ranks.run(world_size, _engine_layouts, model_name, policy_name, use_orig_params, param_dtype):
        assert layouts == expected
        assert sum(s for _, _, s in layouts) * 16 == est.sharded_bytes  # fp32 master + grad + 2 Adam states


def _whole_layouts(rank, world_size, strategy, persistence):
    model = zs.FSDP(_model("mlp"), auto_wrap_policy=_policy("mlp"), use_orig_params=True, param_persistence_threshold=persistence,
                    sharding_strategy=zs.ShardingStrategy[strategy])
    return [(u._handle.layout.numel, u._handle.layout.padded_numel, u._handle.sharded) for u in zs.FSDP.fsdp_modules(model)]


@pytest.mark.parametrize("strategy,persistence", [("NO_SHARD", None), ("FULL_SHARD", 200)])
def test_whole_units_with_use_orig_params_match_engine_layouts(ranks, strategy, persistence):
    """With use_orig_params the engine pads a whole unit's (NO_SHARD, persistent) aligned layout to
    a multiple of the world size; the estimate laid it out for one rank (181 elements for 183)."""
    est = estimate_model(_model("mlp"), 3, _policy("mlp"), strategy, use_orig_params=True,
                         param_persistence_threshold=persistence)
    for layouts in ranks.run(3, _whole_layouts, strategy, persistence):
        assert [(n, p) for n, p, _ in layouts] == [(u.numel, u.padded_numel) for u in est.units]
        whole = [u for u, (_, _, sharded) in zip(est.units, layouts) if not sharded]
        assert whole and all(u.shard_numel == u.padded_numel for u in whole)  # a whole unit's rank holds it all


def test_estimate_model_without_policy_and_shared_params():
    est = estimate_model(TinyGPT(), 4)  # one unit; the tied head/embedding weight counted once
    n = sum(p.numel() for p in TinyGPT().parameters())  # parameters() dedups too
    assert [u.numel for u in est.units] == [n] and est.psi == n
    assert est.units[0].shard_numel == -(-n // 4) and est.working_set_bytes == est.units[0].padded_numel * 4
    with pytest.raises(ValueError, match="shared by units"):  # the engine refuses this wrapping too
        estimate_model(TinyGPT(), 2, _policy("size"))  # tok and head become units sharing one weight
    one = estimate_model(MLP(), 1, zs.wrap.ModuleWrapPolicy({Block}))
    assert one.strategy == "NO_SHARD" and one.working_set_bytes == 0  # the engine switches at world size 1


# -------------------------------------------------- (3) measured model states
def _mlp(setup: str | None) -> MLP:
    torch.manual_seed(0)
    m = MLP(n_blocks=4)
    if setup == "frozen":  # fine-tuning: two blocks frozen
        m.blocks[0].requires_grad_(False), m.blocks[1].requires_grad_(False)
    return m


def _measured_bytes(rank, world_size, strategy, param_dtype, persistence=None, setup=None):
    mp = zs.MixedPrecision(param_dtype=param_dtype) if param_dtype is not None else None
    plain = _mlp(setup)
    model = zs.FSDP(plain, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                    sharding_strategy=getattr(zs.ShardingStrategy, strategy), mixed_precision=mp,
                    param_persistence_threshold=persistence, ignored_modules=[plain.out] if setup == "ignored" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zs.unsharded_tracker.reset_peaks()
    with zs.comm_stats() as stats:
        model(torch.randn(4, 5)).sum().backward()
    opt.step()

    def nbytes(t):
        return t.numel() * t.element_size()

    params = list(model.parameters())
    p_bytes = sum(nbytes(p) for p in params)
    g_bytes = sum(nbytes(p.grad) for p in params if p.grad is not None)
    o_bytes = step_bytes = 0
    for st in opt.state.values():
        for k, v in st.items():
            if k == "step":  # AdamW's scalar step counter: not a model state, excluded explicitly
                step_bytes += nbytes(v)
            else:
                o_bytes += nbytes(v)
    sent = {k: v for k, v in stats.bytes.items() if v}
    return p_bytes, g_bytes, o_bytes, step_bytes, len(opt.state), zs.unsharded_tracker.peak_bytes, sent


@pytest.mark.parametrize(
    "strategy,param_dtype,persistence,setup",
    [("FULL_SHARD", None, None, None), ("FULL_SHARD", torch.bfloat16, None, None), ("SHARD_GRAD_OP", None, None, None),
     ("NO_SHARD", None, None, None), ("FULL_SHARD", None, 100, None), ("SHARD_GRAD_OP", torch.bfloat16, 100, None),
     ("FULL_SHARD", None, None, "frozen"), ("NO_SHARD", None, None, "frozen"), ("FULL_SHARD", None, None, "ignored")],
)
def test_measured_model_states_match_estimate(ranks, strategy, param_dtype, persistence, setup):
    """Also frozen units, whose gradients nothing reduces (comm_volume counted them: up to 2x
    the bytes measured), and an ignored module, whole on every rank with its gradient and
    optimizer state (the estimate left it out)."""
    plain = _mlp(setup)
    est = estimate_model(plain, 2, zs.wrap.ModuleWrapPolicy({Block}), strategy, param_dtype,
                         param_persistence_threshold=persistence, ignored_modules=[plain.out] if setup == "ignored" else None)
    if setup == "ignored":
        assert est.psi == sum(p.numel() for p in plain.parameters())
    if persistence:  # else this case shows nothing: some units persistent, some sharded
        assert {u.sharded for u in est.units} == {True, False}
    volume = {k.split()[-1]: 0.0 for k in comm_volume(est)}
    for k, (b, _) in comm_volume(est).items():
        volume[k.split()[-1]] += b
    for p_bytes, g_bytes, o_bytes, step_bytes, n_params, peak, sent in ranks.run(
            2, _measured_bytes, strategy, param_dtype, persistence, setup):
        assert sent == pytest.approx(volume, rel=1e-12, abs=0), (sent, volume)
        assert (p_bytes, g_bytes, o_bytes) == (est.param_bytes, est.grad_bytes, est.optim_bytes)
        assert p_bytes + g_bytes + o_bytes == est.sharded_bytes
        assert step_bytes == 4 * n_params  # one float32 scalar per trained parameter, left out of the estimate
        # The gathered working set: root + the 2 largest other units (FULL_SHARD), all (ZeRO-2), none (NO_SHARD fp32).
        assert peak == est.working_set_bytes


class _Nest(torch.nn.Module):
    """Linear -> inner -> Linear: units nested three deep compute inside one another."""

    def __init__(self, d: int, inner: torch.nn.Module | None = None):
        super().__init__()
        self.a, self.inner, self.b = torch.nn.Linear(d, d), inner or torch.nn.Identity(), torch.nn.Linear(d, d)

    def forward(self, x):
        return self.b(torch.tanh(self.inner(self.a(x))))


class _Leaf(_Nest):
    pass


class _Sub(_Nest):
    pass


def _nested_model():
    torch.manual_seed(0)
    blocks = [_Nest(8, _Sub(8, _Leaf(8))) for _ in range(3)]
    return torch.nn.Sequential(torch.nn.Linear(5, 8), *blocks, torch.nn.Linear(8, 4))


def _nested_peak(rank, world_size, kw):
    model = zs.FSDP(_nested_model(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({_Nest, _Sub, _Leaf}), **kw)
    zs.unsharded_tracker.reset_peaks()
    model(torch.randn(4, 5)).square().mean().backward()
    return zs.unsharded_tracker.peak_bytes, zs.unsharded_tracker.peak_non_root_units


def test_working_set_bounds_nested_units(ranks):
    """Units nested three deep are all gathered at once while the innermost
    computes: more than the root + 2 largest units the estimate used to give."""
    est = estimate_model(_nested_model(), 2, zs.wrap.ModuleWrapPolicy({_Nest, _Sub, _Leaf}), "FULL_SHARD")
    root, *rest = [u.padded_numel * 4 for u in est.units]
    for kw in ({}, {"backward_prefetch": None}, {"backward_prefetch": zs.BackwardPrefetch.BACKWARD_POST},
               {"forward_prefetch": True}):
        peak, units = ranks.run(2, _nested_peak, kw)[0]
        assert units == 3 and root + sum(sorted(rest)[-2:]) < peak <= est.working_set_bytes, (kw, peak, est.working_set_bytes)


# --------------------------------------------------------------------- (4) CLI
def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "zeroshard.estimate", *args], capture_output=True, text=True,
                         env=env, check=True)
    return out.stdout


def test_cli_params():
    out = _cli("--params", "7e9", "--world-size", "64")
    for s in ("FULL_SHARD", "SHARD_GRAD_OP", "ZERO1", "NO_SHARD"):
        assert f"| {s} |" in out
    assert "1,750,000,000 (1.63 GiB)" in out and "15,531,250,000" in out and "29,312,500,000" in out
    assert "112,000,000,000" in out and "ZeRO paper" in out and "zeroshard FSDP1-style" in out


def test_cli_model_and_offload():
    out = _cli("--model", "models:TinyGPT", "--wrap-class", "TransformerBlock", "--world-size", "3",
               "--strategy", "FULL_SHARD", "--offload")
    torch.manual_seed(0)
    est = estimate_model(TinyGPT(), 3, zs.wrap.ModuleWrapPolicy({TransformerBlock}), param_dtype=torch.bfloat16,
                         offload=True)
    assert f"| (root) | {est.units[0].numel:,} |" in out and "| blocks.0 |" in out
    assert est.gpu_bytes == est.working_set_bytes and est.cpu_bytes == est.sharded_bytes
    assert f"{est.sharded_bytes:,}" in out and f"{est.working_set_bytes:,}" in out


def test_cli_hpz_tradeoff():
    """ZeRO++ hpZ rows: 7e9 bf16 parameters, N = 64, k = 8: Ψ·2/8 bytes held from
    forward to backward; the backward all-gather sends Ψ·2·7/8 within the node
    instead of Ψ·2·63/64 across all ranks (engine agreement: tests/test_hpz.py)."""
    out = _cli("--params", "7e9", "--world-size", "64", "--strategy", "FULL_SHARD", "--hpz-group-size", "8")
    assert "| hpZ | 1,750,000,000 (1.63 GiB) | 12,250,000,000 (11.41 GiB) | k = 8 ranks (intra-group) |" in out
    assert "| ZeRO-3 | 0 | 13,781,250,000 (12.83 GiB) | N = 64 ranks |" in out
    est = estimate_model(TinyGPT(), 4, zs.wrap.ModuleWrapPolicy({TransformerBlock}), hpz_group_size=2)
    out = _cli("--model", "models:TinyGPT", "--wrap-class", "TransformerBlock", "--world-size", "4",
               "--strategy", "FULL_SHARD", "--mixed-precision", "none", "--hpz-group-size", "2")
    assert f"| hpZ | {est.secondary_bytes:,} " in out and est.secondary_bytes > 0
    assert est.gpu_bytes == est.sharded_bytes + est.working_set_bytes + est.secondary_bytes


def test_cli_hpz_table_and_offload_rows_follow_the_model_flags():
    """The hpZ table ignored --param-persistence-threshold (612 B of secondary shards for units
    the engine keeps whole, with no backward all-gather at all), and --params printed a NO_SHARD
    working set of 0 with --offload where --model (and the engine) copy every unit to the GPU."""
    args = ["--model", "models:MLP", "--wrap-class", "Block", "--world-size", "4", "--strategy", "FULL_SHARD",
            "--hpz-group-size", "2"]
    assert "| hpZ | 0 (0.00 GiB) | 0 (0.00 GiB) |" not in _cli(*args)
    assert "| hpZ | 0 (0.00 GiB) | 0 (0.00 GiB) |" in _cli(*args, "--param-persistence-threshold", "300")
    psi = sum(p.numel() for p in MLP().parameters())
    rows = []
    for given in (["--params", str(psi)], ["--model", "models:MLP", "--wrap-class", "Block"]):
        out = _cli(*given, "--world-size", "2", "--strategy", "NO_SHARD", "--mixed-precision", "none", "--offload")
        rows.append([line.split(" | ")[8] for line in out.splitlines() if "zeroshard FSDP1-style" in line][0])
    assert rows[0] == rows[1] == f"{4 * psi:,} ({4 * psi / 2**30:.2f} GiB)", rows


def test_the_python_api_refuses_what_the_cli_refuses():
    """The CLIs checked their flags, the functions did not: ZeroDivisionError for a world size
    of 0, KeyError for an unknown name, and negative sizes or an efficiency of 5 computed."""
    from zeroshard import simulate
    from zeroshard.estimate import hpz_tradeoff

    gpt = simulate.gpt("g", 2, 128, 1000)
    calls = [
        (model_states, (7e9, 0, "FULL_SHARD"), "world_size"), (model_states, (-1.0, 8, "FULL_SHARD"), "psi"),
        (model_states, (7e9, 8, "ZERO3"), "strategy"), (model_states, (7e9, 8, "FULL_SHARD", "int8"), "mixed_precision"),
        (estimate_model, (MLP(), 0), "world_size"), (estimate_model, (MLP(), -2), "world_size"),
        (lambda: estimate_model(MLP(), 4, hpz_group_size=3), (), "hpz_group_size"),
        (lambda: estimate_model(MLP(), 4, strategy="SHARD_GRAD_OP", hpz_group_size=2), (), "hpz_group_size needs"),
        (hpz_tradeoff, (7e9, 64, 0), "k"), (hpz_tradeoff, (7e9, 64, 7), "k"),
        (simulate.simulate, (gpt, 0, "a100-400g", 2, 1024), "gpus"), (simulate.simulate, (gpt, -8, "a100-400g", 2, 1024), "gpus"),
        (simulate.simulate, (gpt, 8, "tpu", 2, 1024), "hardware"),
        (lambda: simulate.simulate(gpt, 8, "a100-400g", 2, 1024, efficiency=5), (), "efficiency"),
        (lambda: simulate.simulate(gpt, 8, "a100-400g", 2, 1024, ac=2.0), (), "ac"),
        (lambda: simulate.simulate(gpt, 8, "a100-400g", 2, 1024, strategy="NO_SHARD", shard_group=4), (), "shard_group"),
        (lambda: simulate.simulate(gpt, 8, "a100-400g", 2, 1024, shard_group=16), (), "shard_group"),
    ]
    for fn, args, name in calls:
        with pytest.raises(ValueError, match=name):
            fn(*args)
    one = estimate_model(MLP(), 1, strategy="SHARD_GRAD_OP", hpz_group_size=1)  # one rank: NO_SHARD, as the engine builds it
    assert one.strategy == "NO_SHARD" and one.hpz_group_size is None
    frozen = MLP()
    frozen.blocks[0].l1.requires_grad_(False)  # a unit mixing frozen and trainable: the engine refuses it
    with pytest.raises(ValueError, match="use_orig_params"):
        estimate_model(frozen, 2, zs.wrap.ModuleWrapPolicy({Block}))


def test_cli_refuses_what_it_cannot_estimate(capsys):
    """A world size of 0 divided by zero, negative ones printed negative bytes,
    hpZ with SHARD_GRAD_OP printed a FULL_SHARD table, and hpZ on one rank
    crashed with --model (KeyError) or printed memory the engine never holds."""
    from zeroshard.estimate import main

    def refused(*args):
        with pytest.raises(SystemExit):
            main(list(args))
        return capsys.readouterr().err

    assert "argument --world-size: 0 must be >= 1" in refused("--params", "7e9", "--world-size", "0")
    assert "give --model" in refused("--params", "7e9", "--world-size", "2", "--wrap-class", "Block")  # was ignored
    assert "argument --params: -7000000000.0 must be a finite number > 0" in refused("--params=-7e9", "--world-size", "4")
    assert "only FULL_SHARD" in refused("--params", "7e9", "--world-size", "8", "--hpz-group-size", "2",
                                        "--strategy", "SHARD_GRAD_OP")
    # A bad --model ended in a raw ModuleNotFoundError / AttributeError traceback.
    assert "--model nosuchmodule:f: No module named 'nosuchmodule'" in refused("--model", "nosuchmodule:f", "--world-size", "2")
    assert "(expected module:function" in refused("--model", "models", "--world-size", "2")
    # A factory that fails, or returns no module, ended in a raw traceback.
    assert "--model models:build: calling build() failed: TypeError" in refused("--model", "models:build", "--world-size", "2")
    # A model without parameters, and a Ψ whose 16 bytes each overflow, ended in tracebacks.
    assert "the model has no parameters (nothing to shard)" in refused("--model", "torch.nn:Identity", "--world-size", "2")
    assert "argument --params: 2e+307 parameters is beyond any model (at most 1e+18)" in refused("--params", "2e307", "--world-size", "2")
    assert "needs the units' sizes: give --model" in refused("--params", "7e9", "--world-size", "2",
                                                             "--param-persistence-threshold", "100")
    # NO_SHARD shards nothing: its units' "shard numel/rank" was half their numel.
    whole = main(["--model", "models:MLP", "--wrap-class", "Block", "--world-size", "2", "--strategy", "NO_SHARD"])
    assert "| blocks.0 | 202 | 202 | 202 |" in whole, whole
    out = main(["--model", "models:TinyGPT", "--wrap-class", "TransformerBlock", "--world-size", "1", "--hpz-group-size", "1"])
    assert "ZeRO++ hpZ: no effect at --world-size 1" in out
