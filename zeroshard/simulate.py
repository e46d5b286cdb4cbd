"""A ZeRO-3 / FSDP training step on paper, beyond one machine: an α-β cost model of one step.

The communication analysis of the ZeRO paper (Rajbhandari et al., 2020, section 7: ZeRO-3
moves 3Ψ per step, 1.5× data parallelism's 2Ψ) priced on real links, plus the overlap that
FSDP's forward and backward prefetch buy (Zhao et al., "PyTorch FSDP: Experiences on Scaling
Fully Sharded Data Parallel", VLDB 2023). Pure arithmetic, no torch: a step is a list of units
(the root holding embeddings and head, then one unit per transformer block, as
``transformer_auto_wrap_policy`` wraps a GPT), each with a compute time and its collectives.

**Compute.** FLOPs per token, as the PaLM paper counts model FLOPs (Chowdhery et al., 2022,
Appendix B; nanoGPT's ``estimate_mfu``): 6Ψ + 12·L·d·s (Ψ parameters, L blocks, width d,
sequence s; forward 1/3, backward 2/3). Activation checkpointing re-runs each checkpointed
block's forward: + ac·(2Ψ_blocks + 4·L·d·s), ac = fraction of blocks checkpointed. For a GPT
with tied embeddings and ac = 1 this is exactly eq. (3) of Narayanan et al., 2021
(Megatron-LM, SC21), F = 96·B·s·L·d²·(1 + s/(6d) + V/(16·L·d)), which counts the extra forward.
Time = FLOPs / (peak × efficiency): one efficiency per hardware preset, taken from Megatron-LM
(not fitted to the rows below) and applied to every executed FLOP.

**Communication.** Per unit of p parameters and c bytes per element (the parameter dtype;
gradients are reduced in it too): forward all-gather p·c, backward all-gather p·c (FULL_SHARD
only, and never for the root unit, which FSDP1 keeps gathered from forward through backward),
reduce-scatter p·c. HYBRID_SHARD (``shard_group``) runs those inside a shard group of k ranks
and adds an all-reduce of the p·c/k shard across the N/k replicas. Each collective is a ring:

    t = (n − 1)·α + (n − 1)/n · bytes / β        (all-reduce: twice that)

with α the mean latency of the ring's steps (NVLink or network hop, as NCCL models it) and β
its slowest link: NVLink inside a node, else the node's network bandwidth × (the group's ranks
per node / GPUs per node) — NCCL spreads a ring's node crossings over all of a node's NICs, and
concurrent groups on one node share them. Bytes per rank per step: FULL_SHARD
(3Ψ − Ψ_root)(N−1)/N·c, SHARD_GRAD_OP 2Ψ(N−1)/N·c, NO_SHARD 2Ψ(N−1)/N·c.

**Overlap.** One compute stream and one communication stream. With prefetch the next unit's
all-gather runs under the current unit's compute; in backward (units in reverse) the
reduce-scatter (and replica all-reduce) of the unit just finished runs there too:

    forward : AG₀ + Σᵢ max(fᵢ, AG_{i+1})
    backward: AGᵇ_{last} + Σᵢ (reverse) max(bᵢ, AGᵇ_{i−1} + RS_{i+1}) + RS_first

so max(Σ compute, Σ comm) ≤ step ≤ Σ compute + Σ comm; without prefetch the step is the sum.
Not modelled: CPU offload traffic, allocator stalls, kernel launch gaps, stragglers.

    python -m zeroshard.simulate                       # published setups vs predictions
    python -m zeroshard.simulate --params 7e9 --world-size 256 --hardware a100-400g
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from .cli_args import check_choice, check_count, check_fraction, parameter_count, positive_float, positive_int

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense 16-bit tensor-core peak per GPU (datasheet)
    tf32_tflops: float  # dense TF32 peak, used when the parameters are fp32
    efficiency: float  # achievable fraction of peak (stated input, one per GPU type)
    gpus_per_node: int
    nvlink_gbps: float  # GB/s per GPU per direction inside a node
    network_gbps: float  # GB/s per node per direction between nodes
    # Seconds per ring step: NCCL's own latency model (src/graph/tuning.cc, hwLat, Ring/Simple):
    # 3.4 µs over NVLink, 14 µs over the network; its fixed per-call base latency is left out.
    alpha_intra: float = 3.4e-6
    alpha_inter: float = 14e-6


# Efficiencies: A100 0.52 = the 1T-parameter run of Narayanan et al. 2021, Table 1 (163
# TFLOP/s per GPU, "52%" of peak on 3072 A100s); H100 0.47 = Megatron-LM README ("up to 47%
# Model FLOP Utilization (MFU) on H100 clusters"). Both from another system, so not tuned here.
# Peaks: 312 / 989 TFLOPS (datasheets; quoted by the AWS and IBM sources below); NVLink 600 /
# 900 GB/s per GPU both directions together; 8 GPUs per node.
A100 = dict(peak_tflops=312.0, tf32_tflops=156.0, efficiency=0.52, gpus_per_node=8, nvlink_gbps=300.0)
H100 = dict(peak_tflops=989.0, tf32_tflops=494.0, efficiency=0.47, gpus_per_node=8, nvlink_gbps=450.0)
HARDWARE = {
    "a100-400g": Hardware("A100 + 400 Gb/s per node (AWS p4d: 4×100 Gb/s EFA)", network_gbps=50.0, **A100),
    "a100-8x200g-ib": Hardware("A100 + 8×200 Gb/s InfiniBand per node (DGX A100)", network_gbps=200.0, **A100),
    "h100-800g": Hardware("H100 SXM + 800 Gb/s per node", network_gbps=100.0, **H100),
    "h100-3.2t": Hardware("H100 SXM + 3.2 Tb/s per node (AWS p5, DGX H100)", network_gbps=400.0, **H100),
}


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer as FSDP units: the root (embeddings, head) and L blocks."""

    name: str
    layers: int
    d_model: int
    block_params: float
    root_params: float

    @property
    def params(self) -> float:
        return self.layers * self.block_params + self.root_params


def gpt(name, layers, d, vocab) -> Model:
    # 4d² attention + 8d² MLP + 13d biases/norms; embedding tied to the head.
    return Model(name, layers, d, 12 * d * d + 13 * d, vocab * d)


def llama(name, layers, d, ffn, vocab, kv_dim=None) -> Model:
    kv = kv_dim or d  # grouped-query attention shrinks k and v to kv_dim
    return Model(name, layers, d, 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d, 2 * vocab * d + d)


def ring_time(nbytes: float, n: int, alpha: float, beta_gbps: float) -> float:
    """All-gather or reduce-scatter of ``nbytes`` (the full tensor) over a ring of n ranks."""
    return 0.0 if n <= 1 else (n - 1) * alpha + (n - 1) / n * nbytes / (beta_gbps * 1e9)


def link(hw: Hardware, n: int, per_node: int) -> tuple[float, float]:
    """(α, β GB/s) of a ring of n ranks with ``per_node`` of them on each node.

    α is the mean latency of the ring's n − 1 steps: of those, nodes − 1 cross the network
    and the rest stay on NVLink (NCCL's latency model). β is the slowest link's bandwidth."""
    if n <= per_node:
        return hw.alpha_intra, hw.nvlink_gbps
    nodes = math.ceil(n / per_node)
    alpha = ((nodes - 1) * hw.alpha_inter + (n - nodes) * hw.alpha_intra) / (n - 1)
    return alpha, min(hw.nvlink_gbps, hw.network_gbps * per_node / hw.gpus_per_node)


def step_flops_per_token(model: Model, seq: int, ac: float = 0.0) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per token: PaLM's 6Ψ + 12Lds, plus recomputation."""
    attn = 12 * model.layers * model.d_model * seq
    recompute = ac * (2 * model.layers * model.block_params + attn / 3)
    return 6 * model.params + attn, 6 * model.params + attn + recompute


@dataclass(frozen=True)
class Result:
    step_s: float
    compute_s: float
    comm_s: float
    tokens_per_gpu: float  # per step
    model_flops: float  # per GPU per step
    hw_flops: float  # per GPU per step, recomputation included
    peak_tflops: float
    comm_bytes: dict  # bytes one rank sends per step, by collective

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_gpu / self.step_s

    @property
    def tflops(self) -> float:  # model TFLOPS per GPU
        return self.model_flops / self.step_s / 1e12

    @property
    def hw_tflops(self) -> float:
        return self.hw_flops / self.step_s / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops / self.peak_tflops

    @property
    def comm_ratio(self) -> float:
        return self.comm_s / self.compute_s

    @property
    def exposed_comm_s(self) -> float:
        return self.step_s - self.compute_s


def schedule(fwd, bwd, ag_f, ag_b, rs, prefetch: bool = True) -> float:
    """Step time of units in forward order (lists of seconds); see the module docstring."""
    if not prefetch:
        return sum(fwd) + sum(bwd) + sum(ag_f) + sum(ag_b) + sum(rs)
    u = len(fwd)
    nxt = lambda xs, i: xs[i] if 0 <= i < u else 0.0  # noqa: E731
    t = ag_f[0] + sum(max(fwd[i], nxt(ag_f, i + 1)) for i in range(u))
    t += ag_b[-1] + sum(max(bwd[i], nxt(ag_b, i - 1) + nxt(rs, i + 1)) for i in reversed(range(u)))
    return t + rs[0]


def simulate(model: Model, gpus: int, hardware: str | Hardware, micro_batch: int, seq: int,
             dtype: str = "bf16", strategy: str = "FULL_SHARD", ac: float = 0.0, prefetch: bool = True,
             shard_group: int | None = None, efficiency: float | None = None) -> Result:
    """One training step of ``model`` on ``gpus`` GPUs, ``micro_batch`` sequences of ``seq``
    tokens per GPU. ``shard_group=k`` with FULL_SHARD is HYBRID_SHARD (shard over k, replicate)."""
    where = "zeroshard.simulate.simulate"
    for name, value in (("gpus", gpus), ("micro_batch", micro_batch), ("seq", seq)):
        check_count(where, name, value)
    if isinstance(hardware, str):
        check_choice(where, "hardware", hardware, tuple(HARDWARE))
    check_choice(where, "dtype", dtype, tuple(DTYPE_BYTES))
    check_choice(where, "strategy", strategy, STRATEGIES)
    check_fraction(where, "ac", ac, low_open=False)
    if efficiency is not None:
        check_fraction(where, "efficiency", efficiency, low_open=True)
    if shard_group is not None:  # ignored (NO_SHARD) or clamped (> gpus) before: a different setup than asked for
        check_count(where, "shard_group", shard_group)
        if strategy == "NO_SHARD" or shard_group > gpus:
            raise ValueError(f"{where}: shard_group={shard_group} shards within groups of a sharded strategy's "
                             f"{gpus} GPUs (HYBRID_SHARD); with {strategy} drop it, or give one that divides gpus")
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    c = DTYPE_BYTES[dtype]
    peak = hw.tf32_tflops if dtype == "fp32" else hw.peak_tflops
    rate = peak * 1e12 * (hw.efficiency if efficiency is None else efficiency)
    tokens = micro_batch * seq
    d, s = model.d_model, seq
    k = gpus if strategy == "NO_SHARD" else shard_group or gpus  # (a shard_group above gpus is refused above)
    if gpus % k:
        raise ValueError(f"shard group {k} does not divide world size {gpus}")
    g = hw.gpus_per_node
    if k < gpus and (g % k if k < g else k % g):  # contiguous groups would straddle nodes, priced as NVLink
        raise ValueError(f"shard group {k} neither divides nor is a multiple of the {g} GPUs per node: some groups "
                         "would straddle two nodes, which this model does not price")
    replicas = gpus // k
    a_s, b_s = link(hw, k, min(k, hw.gpus_per_node))  # shard groups are contiguous ranks
    a_r, b_r = link(hw, replicas, max(1, hw.gpus_per_node // k))  # one rank per shard group
    units = [(model.root_params, 0.0, True)] + [(model.block_params, 1.0, False)] * model.layers
    fwd, bwd, ag_f, ag_b, rs = [], [], [], [], []
    sent = {"forward all_gather": 0.0, "backward all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    for p, is_block, root in units:
        attn = 12 * d * s * is_block  # per token, forward + backward
        fwd.append(tokens * (2 * p + attn / 3) / rate)
        bwd.append(tokens * (4 * p + 2 * attn / 3 + ac * is_block * (2 * p + attn / 3)) / rate)
        nbytes = p * c
        if strategy == "NO_SHARD":  # DDP: all-reduce the whole gradient
            ag_f.append(0.0), ag_b.append(0.0)
            rs.append(2 * ring_time(nbytes, gpus, a_s, b_s))
            sent["all_reduce"] += 2 * nbytes * (gpus - 1) / gpus
            continue
        ag = ring_time(nbytes, k, a_s, b_s)
        regather = strategy == "FULL_SHARD" and not root
        ag_f.append(ag), ag_b.append(ag if regather else 0.0)
        rs.append(ring_time(nbytes, k, a_s, b_s) + 2 * ring_time(nbytes / k, replicas, a_r, b_r))
        ring = nbytes * (k - 1) / k
        sent["forward all_gather"] += ring
        sent["backward all_gather"] += ring * regather
        sent["reduce_scatter"] += ring
        sent["all_reduce"] += 2 * nbytes / k * (replicas - 1) / replicas
    model_tok, hw_tok = step_flops_per_token(model, seq, ac)
    return Result(schedule(fwd, bwd, ag_f, ag_b, rs, prefetch), sum(fwd) + sum(bwd),
                  sum(ag_f) + sum(ag_b) + sum(rs), tokens, tokens * model_tok, tokens * hw_tok, peak,
                  {name: b for name, b in sent.items() if b})


AWS_2022 = ('"Training a 1 Trillion Parameter Model With PyTorch Fully Sharded Data Parallel on AWS", '
            "P. Belevich, Y. Zhao, S. Li, J. Choi, R. Varma, P. Damania, G. Chauhan, M. Yadav, "
            "P.-Y. Aquilanti, S. Ranganathan; PyTorch on Medium, 15 Mar 2022, https://medium.com/pytorch/"
            "training-a-1-trillion-parameter-model-with-pytorch-fully-sharded-data-parallel-on-aws-3ac13aa96cff; "
            'same figures in "Introducing PyTorch Fully Sharded Data Parallel (FSDP) API", Y. Zhao, R. Varma, '
            "C.-C. Huang, S. Li, M. Xu, A. Desmaison, PyTorch blog, Mar 2022, section Benchmark Results")
IBM_2024 = ('"Maximizing training throughput using PyTorch FSDP", Team PyTorch at IBM and Team PyTorch at '
            "Meta, PyTorch blog, 13 Mar 2024, https://pytorch.org/blog/maximizing-training/, Table 1; "
            "sharding strategy per row from the fms-fsdp README (github.com/foundation-model-stack/fms-fsdp)")
# Llama shapes: fms-fsdp fms_fsdp/utils/config_utils.py (get_model_config) and fms LLaMAConfig defaults.
LLAMA2 = {"7B": llama("Llama2-7B", 32, 4096, 11008, 32000), "13B": llama("Llama2-13B", 40, 5120, 13824, 32000),
          "34B": llama("Llama2-34B", 48, 8192, 22016, 32000, 1024),
          "70B": llama("Llama2-70B", 80, 8192, 28672, 32000, 1024)}
# "Selective" AC: the source does not give n (checkpoint every n-th block); its HFU/MFU implies a
# recomputed fraction 3·(HFU/MFU − 1) = 3·(0.59/0.51 − 1) = 0.47 (A100), 0.43 (H100): we use 1/2.
IBM_ROWS = [("7B", None, 8, 3700, 7500, "No AC, HSDP"), ("13B", 0.5, None, 1800, 3800, "selective AC, FSDP"),
            ("34B", 1.0, None, 700, 1550, "full AC, FSDP"), ("70B", 1.0, None, 370, 800, "full AC, FSDP")]

PUBLISHED = [
    dict(name="GPT-3 175B, B=20, s=512", model=gpt("GPT-3 175B", 96, 12288, 50000), gpus=128, hardware="a100-400g",
         micro_batch=20, seq=512, dtype="fp16", ac=1.0, published=159.0, metric="TFLOPS/GPU", source=AWS_2022,
         quote="The maximum per-GPU throughput of 159 teraFLOP/s/GPU is 51% of the NVIDIA A100 peak theoretical "
               "performance 312 teraFLOP/s/GPU (batch size 20 on 128 GPUs, sequence length 512; Fig. 5)",
         notes="A100-40GB p4d, EFA 400 Gbps; fp16, SGD, activation checkpointing, parameter CPU offload"),
    dict(name="GPT 1T, B=4, s=2048", model=gpt("GPT 1T", 128, 25600, 50000), gpus=128, hardware="a100-400g",
         micro_batch=4, seq=2048, dtype="fp16", ac=1.0, published=84.0, metric="TFLOPS/GPU", source=AWS_2022,
         quote="The maximum per-GPU throughput of 84 teraFLOP/s/GPU was achieved with a batch size of 4 on 128 "
               "GPUs (sequence length 2048; Fig. 11)",
         notes="source: the bottleneck is cudaMalloc near the memory limit, which this model does not see"),
] + [
    dict(name=f"Llama2-{size} {hw[:4].upper()}, B=2, s=4096", model=LLAMA2[size], gpus=gpus,
         hardware=hw, micro_batch=2, seq=4096, dtype="bf16", ac=ac or 0.0, shard_group=group, published=pub,
         metric="tokens/s/GPU", source=IBM_2024,
         quote=f"Table 1, {size}, batch size 2: {pub} tokens/sec/GPU ({label})", notes=how)
    for size, ac, group, a100, h100, how in IBM_ROWS
    for hw, gpus, pub, label in (("a100-400g", 128, a100, "A100 80GB and 400Gbps interconnect, 128 GPUs"),
                                 ("h100-800g", 96, h100, "H100 80GB and 800Gbps interconnect, 96 GPUs"))
]
SIM_KEYS = ("model", "gpus", "hardware", "micro_batch", "seq", "dtype", "ac", "shard_group")


def predict(setup: dict) -> tuple[Result, float]:
    """(Result, predicted value in the setup's published metric)."""
    r = simulate(**{k: setup[k] for k in SIM_KEYS if k in setup})
    # The AWS figures use Megatron's eq. (3), which counts recomputation: our executed FLOPs.
    return r, r.hw_tflops if setup["metric"] == "TFLOPS/GPU" else r.tokens_per_s


def comparison_table(setups=PUBLISHED) -> str:
    head = ["setup", "GPUs", "hardware", "metric", "published", "predicted", "predicted/published",
            "step s", "tokens/s/GPU", "TFLOPS/GPU", "MFU", "comm/compute", "exposed comm s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in setups:
        r, pred = predict(s)
        cells = [s["name"], s["gpus"], s["hardware"], s["metric"], f"{s['published']:,.0f}", f"{pred:,.0f}",
                 f"{pred / s['published']:.2f}", f"{r.step_s:.2f}", f"{r.tokens_per_s:,.0f}", f"{r.tflops:.0f}",
                 f"{r.mfu:.0%}", f"{r.comm_ratio:.2f}", f"{r.exposed_comm_s:.3f}"]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out)


def custom_report(r: Result, title: str) -> str:
    lines = [title, "", "| quantity | value |", "|---|---|"]
    rows = [("step time", f"{r.step_s:.3f} s"), ("compute", f"{r.compute_s:.3f} s"),
            ("communication (serial sum)", f"{r.comm_s:.3f} s"), ("exposed communication", f"{r.exposed_comm_s:.3f} s"),
            ("comm/compute", f"{r.comm_ratio:.2f}"), ("tokens/s/GPU", f"{r.tokens_per_s:,.0f}"),
            ("model TFLOPS/GPU", f"{r.tflops:.1f}"), ("MFU", f"{r.mfu:.1%}"),
            ("executed TFLOPS/GPU (with recompute)", f"{r.hw_tflops:.1f}")]
    rows += [(f"bytes sent/rank/step: {k}", f"{v:,.0f} ({v / 2**30:.2f} GiB)") for k, v in r.comm_bytes.items()]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows])


def _fraction(low_open: bool):
    def parse(text: str) -> float:
        value = positive_float(text) if low_open else float(text)
        if not 0 <= value <= 1:
            raise argparse.ArgumentTypeError(f"{value} must be between 0 and 1")
        return value
    return parse


def main(argv=None) -> str:
    # allow_abbrev=False: which flags were given is read from argv below, so "--world 8" must not pass as one.
    ap = argparse.ArgumentParser(prog="python -m zeroshard.simulate", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--params", type=parameter_count, help="custom setup: Ψ (e.g. 7e9), split evenly over --layers units")
    ap.add_argument("--world-size", type=positive_int, default=64)
    ap.add_argument("--hardware", default="a100-400g", choices=list(HARDWARE))
    ap.add_argument("--layers", type=positive_int, default=32, help="transformer blocks (one FSDP unit each)")
    ap.add_argument("--d-model", type=positive_int, help="width (default: from Ψ ≈ 12·L·d²)")
    ap.add_argument("--seq", type=positive_int, default=4096)
    ap.add_argument("--micro-batch", type=positive_int, default=2, help="sequences per GPU per step")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPE_BYTES))
    ap.add_argument("--strategy", default="FULL_SHARD", choices=STRATEGIES)
    ap.add_argument("--shard-group", type=positive_int, help="HYBRID_SHARD: shard over this many ranks, replicate across")
    ap.add_argument("--ac", type=_fraction(False), default=0.0, help="fraction of blocks with activation checkpointing")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--efficiency", type=_fraction(True), help="override the preset's achievable fraction of peak (0-1]")
    args = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(args)
    # Given, not merely different from the default: --world-size 64 describes a custom setup too.
    custom = [x.dest for x in ap._actions if x.dest not in ("help", "params")
              and any(arg == o or arg.startswith(o + "=") for o in x.option_strings for arg in args)]
    if a.params is None and custom:
        ap.error(f"--{custom[0].replace('_', '-')} describes a custom setup: give --params too "
                 "(without it the published setups are printed)")
    if a.shard_group is not None and a.strategy == "NO_SHARD":
        ap.error("--shard-group shards within groups (HYBRID_SHARD); NO_SHARD shards nothing: drop one of them")
    if a.shard_group is not None and (a.shard_group > a.world_size or a.world_size % a.shard_group):
        ap.error(f"--shard-group {a.shard_group} must divide --world-size {a.world_size}")
    if a.params is None:
        text = ("Published FSDP throughput vs this α-β model (one efficiency per GPU type: "
                + ", ".join(f"{k} {h.efficiency:.2f}" for k, h in HARDWARE.items()) + ")\n\n" + comparison_table())
    else:
        d = a.d_model or 128 * max(1, round(math.sqrt(a.params / (12 * a.layers)) / 128))
        model = Model(f"{a.params:.3g} params", a.layers, d, a.params / a.layers, 0.0)
        try:
            r = simulate(model, a.world_size, a.hardware, a.micro_batch, a.seq, a.dtype, a.strategy, a.ac,
                         not a.no_prefetch, a.shard_group, a.efficiency)
        except ValueError as e:
            ap.error(f"--shard-group {a.shard_group}: {e}" if a.shard_group else str(e))
        hw = HARDWARE[a.hardware]
        text = custom_report(r, f"Ψ = {a.params:,.0f} in {a.layers} units (d = {d}), N = {a.world_size}, "
                                f"{hw.name}, {a.strategy}{f' (shard group {a.shard_group})' if a.shard_group else ''}, "
                                f"{a.dtype}, {a.micro_batch}×{a.seq} tokens/GPU, ac = {a.ac}, "
                                f"prefetch = {not a.no_prefetch}, efficiency = {a.efficiency or hw.efficiency}")
    print(text)
    return text


if __name__ == "__main__":
    main()
