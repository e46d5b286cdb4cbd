"""A transformer with the knobs a real FSDP job turns, and a sharded
checkpoint that resumes bit for bit.

* ``transformer_auto_wrap_policy`` over ``nn.TransformerEncoderLayer``: one
  FSDP unit per layer, so only a layer or two is ever gathered at once.
* ``BackwardPrefetch.BACKWARD_PRE``: while layer i runs backward, layer i-1's
  all-gather is already in flight.
* ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)``:
  all-gathers, forward, backward and the gradient reduce-scatter run in
  bfloat16 (half the bytes of fp32), while each rank's shard, the master copy
  that AdamW steps, stays fp32. zeroshard supports bf16 and fp16 on CPU (and
  is bit-identical to torch FSDP1 there).
* A checkpoint in the middle of training: the model and AdamW's state as
  SHARDED state dicts (``FSDP.optim_state_dict`` under SHARDED_STATE_DICT),
  written with ``torch.distributed.checkpoint`` through
  ``zeroshard.checkpoint.save_sharded`` (every rank writes only its rows of
  each parameter and state, into a directory swapped into place once complete;
  it reloads at another world size too). A fresh optimizer has no state for
  DCP to load into: ``init_optim_state`` makes it first.
* The resume check: a fresh model (other initial weights) and optimizer
  load the checkpoint and train the remaining steps; their losses and final
  parameters must equal the uninterrupted run's exactly (``torch.equal``).

The model is a small causal character LM on Python's stdlib source (no
download). Run: ``python -m zeroshard.examples.transformer`` (2 ranks, 40
steps, checkpoint at step 20); ``--small`` is CI's size (8 steps, at 4).
"""
from __future__ import annotations

import argparse
import functools
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as fsdp
from zeroshard import checkpoint
from zeroshard.demo import _batches, load_text
from zeroshard.cli_args import check_output_path, positive_int
from zeroshard.optim_state import init_optim_state
from zeroshard.testing import spawn
from zeroshard.wrap import transformer_auto_wrap_policy

FSDP = fsdp.FullyShardedDataParallel


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, d: int = 64, heads: int = 4, layers: int = 3, ctx: int = 32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        # dropout=0: a resumed run must draw no random numbers the checkpoint did not save
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = self.causal[:t, :t].to(x.dtype)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def make_model(vocab: int, args, seed: int):
    torch.manual_seed(seed)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.TransformerEncoderLayer})
    bf16 = fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(CharTransformer(vocab, ctx=args["ctx"]), auto_wrap_policy=policy,
                 backward_prefetch=fsdp.BackwardPrefetch.BACKWARD_PRE, mixed_precision=bf16)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train_steps(model, opt, batches, first: int, last: int):
    losses = []
    for step, (x, y) in enumerate(batches):
        if step < first:
            continue
        if step >= last:
            break
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded_state(model, opt) -> dict:
    """Model and optimizer as DTensors of this rank's rows (and AdamW's scalar ``step``)."""
    with FSDP.state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}


def save_checkpoint(model, opt, path: str):
    """Every rank writes its rows of the model and of AdamW's states (DCP), atomically."""
    checkpoint.save_sharded(_sharded_state(model, opt), path)


def load_checkpoint(model, opt, path: str):
    init_optim_state(opt)  # a fresh AdamW has no state yet for DCP to fill
    state = _sharded_state(model, opt)  # the template DCP fills in place: this rank's rows
    checkpoint.load_sharded(state, path)
    with FSDP.state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))


def run(rank, world_size, args):
    text = load_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text[:40_000]], dtype=torch.long)

    def batches():
        return _batches(ids, rank, args["steps"], args["batch"], args["ctx"])

    model, opt = make_model(len(chars), args, seed=0)
    k, n = args["save_at"], args["steps"]
    losses = train_steps(model, opt, batches(), 0, k)
    save_checkpoint(model, opt, args["ckpt"])
    losses += train_steps(model, opt, batches(), k, n)
    final = model.state_dict()  # FULL_STATE_DICT (collective)

    fresh, fresh_opt = make_model(len(chars), args, seed=1)  # other weights: the load must overwrite them all
    load_checkpoint(fresh, fresh_opt, args["ckpt"])
    resumed = train_steps(fresh, fresh_opt, batches(), k, n)
    resumed_final = fresh.state_dict()
    same_params = all(torch.equal(v, resumed_final[key]) for key, v in final.items())
    if rank == 0:
        for step, loss in enumerate(losses):
            again = f"   resumed {resumed[step - k]:.6f}" if step >= k else ""
            print(f"step {step:3d}  loss {loss:.6f}{again}" + ("   <- checkpoint saved after this step" if step == k - 1 else ""),
                  flush=True)
        files = sorted(os.listdir(args["ckpt"]))
        gone = " (temporary: deleted at exit; pass --ckpt to keep it)" if args["temporary"] else ""
        print(f"checkpoint: {args['ckpt']} ({', '.join(files)}): model and optimizer rows{gone}", flush=True)
    return {"losses": losses, "resumed": resumed, "same_params": same_params}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zeroshard.examples.transformer", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=None, help="default: 40, or 8 with --small")
    p.add_argument("--save-at", type=int, default=None, help="save the checkpoint after this many steps (default: half)")
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--ctx", type=positive_int, default=32)
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: a temporary one)")
    p.add_argument("--small", action="store_true", help="CI size: 8 steps, checkpoint at 4 (explicit --steps / --save-at win)")
    args = vars(p.parse_args(argv))
    if args["steps"] is None:
        args["steps"] = 8 if args["small"] else 40
    if args["save_at"] is None:
        args["save_at"] = args["steps"] // 2
    if not 0 < args["save_at"] < args["steps"]:
        p.error(f"--save-at {args['save_at']} must be between 0 and --steps {args['steps']} (exclusive)")
    if args["ckpt"] is not None and os.path.isdir(args["ckpt"]) and not checkpoint.is_checkpoint_dir(os.path.realpath(args["ckpt"])):
        p.error(f"--ckpt {args['ckpt']} holds other files than a checkpoint's; pass a new folder or an old checkpoint's")
    check_output_path(p, "--ckpt", args["ckpt"], is_dir=True)
    args["temporary"] = args["ckpt"] is None
    with tempfile.TemporaryDirectory() as tmp:
        args["ckpt"] = os.path.abspath(args["ckpt"] or tmp)
        results = spawn(run, args["world_size"], args, timeout=600)
    r0 = results[0]
    k = args["save_at"]
    same_losses = all(r["resumed"] == r["losses"][k:] for r in results)
    same_params = all(r["same_params"] for r in results)
    falls = r0["losses"][-1] < r0["losses"][0]
    print(f"loss {r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f}; resumed from the step-{k} checkpoint: "
          f"losses {'identical' if same_losses else 'DIFFERENT'}, final parameters "
          f"{'identical' if same_params else 'DIFFERENT'} (all {args['world_size']} ranks)")
    return 0 if same_losses and same_params and falls else 1


if __name__ == "__main__":
    raise SystemExit(main())
