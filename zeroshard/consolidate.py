"""Consolidate a sharded (DCP) checkpoint into one plain ``torch.save`` file.

``python -m zeroshard.consolidate CKPT_DIR OUT.pt [--key model]``

A SHARDED_STATE_DICT checkpoint written with ``torch.distributed.checkpoint``
holds each parameter as row chunks from every rank plus metadata giving each
chunk's offsets. This tool reassembles the full tensors in one process, with
no process group, so that a plain (non-FSDP) model loads the result with
``load_state_dict(..., strict=True)``: the offline counterpart of
FULL_STATE_DICT. It needs memory for the whole state dict. A checkpoint that
also holds a SHARDED optimizer state dict (``{"model": ..., "optim": ...}``)
gives, with ``--key optim``, torch FSDP1's FULL optimizer state dict (FQN
keys, full-shape states), which ``FSDP.optim_state_dict_to_load`` loads at
any world size.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils._pytree import tree_leaves

from . import checkpoint


def consolidate(ckpt_dir: str, out_path: str, key: str | None = None) -> dict:
    """Write the full state dict of the DCP checkpoint ``ckpt_dir`` to ``out_path``.

    ``key`` selects one top-level entry (e.g. ``"model"`` when the checkpoint
    was saved as ``{"model": ..., "optim": ...}``). Returns the state dict.
    """
    aside = checkpoint._aside(os.path.realpath(ckpt_dir))  # a symlink's save sets its target aside
    if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")) and os.path.isfile(os.path.join(aside, ".metadata")):
        # a save_sharded killed between its two renames (filesystems without an atomic swap)
        # left the previous checkpoint aside; the next save or load puts it back, this reads it there
        ckpt_dir = aside
    if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
        raise FileNotFoundError(f"zeroshard.consolidate: '{ckpt_dir}' is not a torch.distributed.checkpoint directory "
                                "(no .metadata file). Fix: pass the path given to dcp.save / checkpoint.save_sharded.")
    parent = os.path.dirname(os.path.abspath(out_path))
    if os.path.isdir(out_path) or (os.path.lexists(parent) and not os.path.isdir(parent)):
        what = "is a directory" if os.path.isdir(out_path) else f"is under '{parent}', which is not a directory"
        raise NotADirectoryError(f"zeroshard.consolidate: the output '{out_path}' {what}. Fix: pass a file path, "
                                 "e.g. OUT.pt in an existing directory.")
    os.makedirs(parent, exist_ok=True)  # checked before reading the whole checkpoint
    tmp = out_path + ".full.tmp"
    # DCP's own offline loader: reads every chunk and places it at its offsets.
    before = checkpoint.identity(ckpt_dir)
    try:
        dcp_to_torch_save(ckpt_dir, tmp)
        failed = None
    except CheckpointException as e:  # a BaseException: `except Exception` lets it through
        causes = "; ".join(f"{type(x).__name__}: {x}" for x, _ in e.failures.values()) or str(e)
        failed = (f"reading the checkpoint '{ckpt_dir}' failed ({causes}). Its .metadata or a data file it names is "
                  "missing, truncated or corrupt. Fix: consolidate another checkpoint (save_sharded only swaps in "
                  "complete ones).")
    swapped = checkpoint.replaced_while_read(ckpt_dir, before)
    if swapped is not None or failed is not None:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise RuntimeError(f"zeroshard.consolidate: {failed if swapped is None else swapped + ' Fix: run it again.'}")
    try:
        state = torch.load(tmp, weights_only=False)
    finally:
        os.remove(tmp)
    if key is not None:
        if key not in state:
            raise KeyError(f"zeroshard.consolidate: the checkpoint has no top-level '{key}' (it has {sorted(state)[:8]}). "
                           "Fix: pass --key with one of those, or no --key for the whole state.")
        state = state[key]
    checkpoint.save(state, out_path)  # atomic: a crash leaves any previous OUT.pt intact
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroshard.consolidate", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt_dir", help="directory written by torch.distributed.checkpoint.save")
    parser.add_argument("out", help="output file (torch.save format)")
    parser.add_argument("--key", default=None, help="keep only this top-level entry (e.g. model, or optim for the FULL optimizer state dict)")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # DCP logs a damaged .metadata's traceback on the root logger; the error says it
    try:
        state = consolidate(args.ckpt_dir, args.out, args.key)
    except (OSError, KeyError, RuntimeError) as e:  # the message names the path and the fix: no traceback
        parser.exit(1, f"{e.args[0] if isinstance(e, KeyError) else e}\n")
    finally:
        logging.disable(logging.NOTSET)
    elements = sum(t.numel() for t in tree_leaves(state) if torch.is_tensor(t))  # an optimizer's sit two levels down
    print(f"wrote {args.out}: {len(state)} entries, {elements} elements", file=sys.stderr)
    nested = sorted(k for k, v in state.items() if isinstance(v, dict))
    if args.key is None and nested and len(nested) == len(state):  # {"model": ..., "optim": ...}: not one state_dict
        print(f"note: its entries {nested} are state dicts of their own; --key {nested[0]} writes that one alone "
              "(e.g. a plain model's state_dict)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
