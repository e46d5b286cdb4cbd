"""The main job: a character-level GPT trained with ZeRO-3 on N CPU ranks.

The text is Python's own standard library source (no download). Each rank
trains on its own batches; zeroshard and torch FSDP1 (the reference) train the
same model on the same batches, and the last lines compare their losses.
Run: ``python -m zeroshard demo --world-size 2 --steps 20``.

Rank 0 reports every step: loss, tokens/s, the unsharded (all-gathered)
parameter bytes live right after forward and at their peak, and the bytes its
collectives sent. On a terminal that is a tqdm progress bar; otherwise (a pipe,
a log file, no tqdm installed) one plain line per step.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import comm, trace
from .cli_args import check_output_path, positive_int
from .fully_sharded import FullyShardedDataParallel
from .handle import unsharded_tracker
from .options import BackwardPrefetch, ShardingStrategy
from .testing import spawn
from .wrap import ModuleWrapPolicy

STDLIB_FILES = ("textwrap.py", "functools.py", "heapq.py", "bisect.py", "colorsys.py")


def load_text() -> str:
    root = os.path.dirname(os.__file__)
    return "".join(open(os.path.join(root, f), encoding="utf-8").read() for f in STDLIB_FILES)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """A small GPT (also the model of benchmarks/train_step.py)."""

    def __init__(self, vocab: int, d: int = 96, heads: int = 4, layers: int = 3, ctx: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2: both uses stay in the root unit
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def _batches(data: torch.Tensor, rank: int, steps: int, batch: int, ctx: int):
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + ctx] for s in starts])
        y = torch.stack([data[s + 1 : s + ctx + 1] for s in starts])
        yield x, y


def _wrap(engine: str, model: nn.Module, args):
    kw = dict(auto_wrap_policy=ModuleWrapPolicy({Block}))
    if engine == "torch":
        from torch.distributed.fsdp import BackwardPrefetch as TBP, FullyShardedDataParallel as TFSDP, ShardingStrategy as TSS
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TMWP

        bp = getattr(TBP, args["prefetch"]) if args["prefetch"] != "NONE" else None
        return TFSDP(model, sharding_strategy=getattr(TSS, args["strategy"]), backward_prefetch=bp,
                     auto_wrap_policy=TMWP({Block}), device_id=torch.device("cpu"))
    bp = getattr(BackwardPrefetch, args["prefetch"]) if args["prefetch"] != "NONE" else None
    return FullyShardedDataParallel(model, sharding_strategy=getattr(ShardingStrategy, args["strategy"]), backward_prefetch=bp, **kw)


class Progress:
    """Per-step report of one training run: a tqdm bar when ``mode`` is "bar",
    or "auto" on a terminal with tqdm installed; otherwise one line per step
    (``quiet`` runs print none)."""

    def __init__(self, total: int, desc: str, mode: str = "auto", stream=None, quiet: bool = False):
        self.stream = stream or sys.stderr
        self.quiet, self.bar = quiet, None
        if mode == "bar" or (mode == "auto" and self.stream.isatty()):
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: plain lines then
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, unit="step", file=self.stream, dynamic_ncols=True, leave=True)

    def update(self, line: str, **postfix):
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif not self.quiet:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _train(rank, world_size, args, engine, text_ids, vocab):
    torch.manual_seed(0)
    plain = CharGPT(vocab, ctx=args["ctx"])
    n = sum(p.numel() for p in plain.parameters())  # counted before wrapping: no padding, not per rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _wrap(engine, plain, args)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, ours = [], engine == "zeroshard"
    if rank == 0 and ours:
        strategy = getattr(model, "sharding_strategy", None)  # one rank: NO_SHARD, whatever was asked
        print(f"zeroshard demo: {n / 1e3:.0f}k parameters (sharded over {world_size} ranks, "
              f"{strategy.name if strategy is not None else args['strategy']}), "
              f"{text_ids.numel()} characters of stdlib source, vocab {vocab}", flush=True)
    elif rank == 0:
        print(f"torch FSDP1 (reference): the same {args['steps']} steps on the same batches", flush=True)
    progress = None
    if rank == 0:  # only rank 0 reports; the others train silently
        desc = f"zeroshard {args['strategy']}" if ours else "torch FSDP1"
        progress = Progress(args["steps"], desc, args.get("progress", "auto"), quiet=not ours)
    for step, (x, y) in enumerate(_batches(text_ids, rank, args["steps"], args["batch"], args["ctx"])):
        unsharded_tracker.reset_peaks(collect=step == 0)  # its gc.collect() took ~0.1 s, timed as training
        t0 = time.perf_counter()
        traced = args.get("trace") and ours and step == args["steps"] - 1
        with comm.comm_stats() as stats, (trace.record(rank) if traced else contextlib.nullcontext()) as tl:
            logits = model(x)
            # FULL_SHARD keeps only the root unit gathered here; SHARD_GRAD_OP keeps every unit until backward.
            after_forward = unsharded_tracker.live_bytes
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if progress is not None:
            tok_s = x.numel() * world_size / dt
            if ours:
                peak, sent = unsharded_tracker.peak_bytes / 1e6, stats.total_bytes() / 1e6
                progress.update(
                    f"step {step:3d}  loss {loss.item():.4f}  {tok_s:8.0f} tok/s  "
                    f"unsharded after forward {after_forward / 1e6:6.2f} MB, peak {peak:6.2f} MB  sent {sent:6.2f} MB",
                    loss=f"{loss.item():.4f}", tok_s=f"{tok_s:.0f}", unsharded_MB=f"{after_forward / 1e6:.2f}/{peak:.2f}",
                    sent_MB=f"{sent:.2f}")
            else:
                progress.update("", loss=f"{loss.item():.4f}", tok_s=f"{tok_s:.0f}")
        if traced:
            _write_trace(tl, rank, world_size, args["trace"])
    if progress is not None:
        progress.close()
    return losses


def _write_trace(tl, rank, world_size, out):
    """Each rank writes OUT.rank{r}.json; rank 0 merges them into OUT (and OUT.png with matplotlib)."""
    stem = out[:-5] if out.endswith(".json") else out
    tl.to_chrome_trace(f"{stem}.rank{rank}.json")
    dist.barrier()
    if rank != 0:
        return
    trace.merge([f"{stem}.rank{r}.json" for r in range(world_size)], out)
    print(f"trace: wrote {out} (merged from {stem}.rank{{0..{world_size - 1}}}.json; open in https://ui.perfetto.dev)", flush=True)
    try:
        png = trace.plot_trace(out, f"{stem}.png")
        print(f"trace: wrote {png}", flush=True)
    except RuntimeError as e:  # no matplotlib: the JSON is enough
        print(f"trace: no PNG ({e})", flush=True)


def _run(rank, world_size, args):
    text = load_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text[: args["chars"]]], dtype=torch.long)
    ours = _train(rank, world_size, args, "zeroshard", ids, len(chars))
    ref = _train(rank, world_size, args, "torch", ids, len(chars)) if args["compare"] else None
    return ours, ref


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zeroshard demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=positive_int, default=2, help="CPU ranks to spawn (gloo processes, one thread each)")
    p.add_argument("--steps", type=positive_int, default=20, help="training steps (each rank: one batch per step)")
    p.add_argument("--strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy if "HYBRID" not in s.name],
                   help="FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2, NO_SHARD = plain data parallelism")
    p.add_argument("--prefetch", default="BACKWARD_PRE", choices=["BACKWARD_PRE", "BACKWARD_POST", "NONE"],
                   help="when backward issues the next unit's all-gather: as a unit's backward starts, after it, or on demand")
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--ctx", type=positive_int, default=64)
    p.add_argument("--chars", type=int, default=200_000)
    p.add_argument("--no-compare", dest="compare", action="store_false", help="skip the torch FSDP1 reference run")
    p.add_argument("--trace", metavar="OUT.json", default=None,
                   help="record zeroshard's last step: OUT.rank{r}.json per rank, merged into OUT.json (+ OUT.png with matplotlib)")
    p.add_argument("--progress", default="auto", choices=["auto", "bar", "lines"],
                   help="per-step report: a tqdm bar (auto: on a terminal, when tqdm is installed) or plain lines")
    args = vars(p.parse_args(argv))
    text = load_text()
    chars = min(args["chars"], len(text))  # the text is shorter than the default --chars
    if chars < args["ctx"] + 2:
        p.error(f"--chars must exceed --ctx + 1 (a window and its next character), got {chars} characters of text "
                f"with --ctx {args['ctx']}")
    check_output_path(p, "--trace", args["trace"])
    if args["trace"]:
        args["trace"] = os.path.abspath(args["trace"])
    results = spawn(_run, args["world_size"], args, timeout=max(300.0, 5.0 * args["steps"]))
    ours, ref = results[0]
    first, last = ours[0], ours[-1]
    vocab = len(set(text))
    print(f"loss {first:.4f} -> {last:.4f} over {len(ours)} steps (chance level ln({vocab}) = {math.log(vocab):.4f})")
    if ref is not None:
        diff = max(abs(a - b) for a, b in zip(ours, ref))
        same = all(a == b for a, b in zip(ours, ref))
        verdict = "bit-identical" if same else f"max |diff| {diff:.3e}"
        print(f"zeroshard vs torch FSDP1 on the same {len(ref)} steps: losses {verdict}")
        if not same:
            return 1
    if not math.isfinite(last) or len(ours) > 1 and not last < first:
        print("the loss did not fall: exit status 1", file=sys.stderr)
        return 1
    return 0
