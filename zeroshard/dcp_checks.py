"""Checks a DCP (sharded) checkpoint gets before it is written or read.

Part of the checkpoint path of FSDP's SHARDED_STATE_DICT (see ``checkpoint``):
``torch.distributed.checkpoint`` saves a plain tensor once, as if every rank
held the same one, and reads whatever keys, shapes and dtypes it is given,
converting or failing deep inside its planner. Before a save,
:func:`_plain_tensors_agreed` compares every plain tensor across ranks
(refusing per-rank ones, taking rank 0's copy of unsynchronized buffers);
before a load, :func:`_describe_problem` compares the state to load into with
the checkpoint's metadata and names the first key, shape, dtype or
world-size problem.
"""
from __future__ import annotations

import glob
import json
import os
import re

import torch
import torch.distributed as dist

from . import comm

SIDECAR = "zeroshard.json"  # {"world_size": N}: what DCP's metadata does not say

# When the optimizer states saved and those to load into cover different parameters.
_OTHER_STATES = ("The checkpoint's optimizer states cover other parameters than this optimizer's: one frozen now "
                 "that had state when saved, or one that had none then (never stepped). Fix: build the state to load "
                 "from the checkpoint itself: torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict("
                 "model_state_dict, '{top}', torch.distributed.checkpoint.FileSystemReader('{path}')), then "
                 "FSDP.optim_state_dict_to_load(model, optim, that['{top}']).")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _flatten(state: dict):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's own key scheme

    return flatten_state_dict(state)


_PER_RANK = re.compile(r"(^|\.)_flat_param$|(^|\.)state\.\d+\.")  # a LOCAL flat shard; optim.state_dict()'s id-keyed rows


def _plain_tensors_agreed(state: dict) -> dict:
    """DCP saves a plain tensor (not DTensor / ShardedTensor) once, as if
    every rank held the same one, taking whichever rank's copy balances the
    files. Digests are compared across ranks: a per-rank tensor (a LOCAL flat
    shard, ``optim.state_dict()``'s rows of this rank's shard) would lose all
    but one rank's copy, so it is refused, naming it; any other tensor that
    differs (buffers, which FSDP does not synchronize: BatchNorm's running
    statistics) is saved as rank 0's, with a warning, as torch FSDP1's FULL
    state dict takes rank 0's buffers. Returns ``state`` with those replaced
    by rank 0's copy (containers along their paths copied, ``state`` itself
    untouched)."""
    import hashlib
    import warnings

    from .sharded_state import is_sharded

    if not _distributed() or dist.get_world_size() == 1:
        return state
    flat, mapping = _flatten(state)
    mine = {}
    for k, v in flat.items():
        if torch.is_tensor(v) and not is_sharded(v):
            data = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            mine[k] = (tuple(v.shape), str(v.dtype), hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest())
    everyone = comm.gather_objects(mine, what="save_sharded (comparing plain tensors across ranks)")
    differing = []
    for k in sorted(set().union(*everyone)):
        seen = [(r, d[k]) for r, d in enumerate(everyone) if k in d]  # a key only one rank has is kept as it is
        if all(v == seen[0][1] for _, v in seen):
            continue
        ranks = [r for r, v in seen if v != seen[0][1]]
        if _PER_RANK.search(k) or len(seen) != len(everyone) or any(v[:2] != seen[0][1][:2] for _, v in seen):
            raise ValueError(f"zeroshard: save_sharded: '{k}' is a plain tensor that differs between ranks (rank "
                             f"{seen[0][0]} vs rank(s) {ranks}) and is per rank (a LOCAL_STATE_DICT flat shard, "
                             "optim.state_dict(), or a shape or holder that differs); torch.distributed.checkpoint "
                             "keeps one copy of a plain tensor, so the others would be lost. Fix: save "
                             "SHARDED_STATE_DICT / FSDP.optim_state_dict under SHARDED_STATE_DICT (DTensor rows), "
                             "or put per-rank values under per-rank keys.")
        differing.append(k)
    if not differing:
        return state
    warnings.warn(f"zeroshard: save_sharded: {len(differing)} plain tensor(s) differ between ranks ('{differing[0]}'"
                  f"{', ...' if len(differing) > 1 else ''}): FSDP synchronizes neither buffers (BatchNorm's running "
                  "statistics) nor ignored parameters; rank 0's values are saved, as in torch FSDP1's FULL state "
                  "dict.", stacklevel=3)
    state = dict(state)
    for k in differing:
        value = flat[k].detach().clone()
        comm.broadcast(value, 0, what=f"save_sharded (rank 0's '{k}')")
        *parents, leaf = mapping[k]
        holder = state
        for part in parents:
            child = holder[part]
            holder[part] = child = dict(child) if isinstance(child, dict) else list(child)
            holder = child
        holder[leaf] = value
    return state


def _bare(key: str) -> str:
    """A flattened key without its top-level entry and wrapper prefixes, to suggest what was meant."""
    return ".".join(p for p in key.split(".")[1:] if p not in ("module", "_fsdp_wrapped_module", "_orig_mod"))


def _describe_problem(state: dict, path: str, strict: bool) -> str | None:
    """The first way ``state`` cannot load from the checkpoint at ``path``, or None."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .sharded_state import is_sharded

    if not os.path.isfile(os.path.join(path, ".metadata")):
        interrupted = glob.glob(os.path.join(glob.escape(os.path.dirname(path)), glob.escape(f".{os.path.basename(path)}.") + "*.tmp"))
        return (f"zeroshard: load_sharded: '{path}' holds no complete checkpoint (no .metadata file)"
                + (f"; an interrupted save left {interrupted[0]}" if interrupted else "")
                + ". Fix: pass the path given to save_sharded (or torch.distributed.checkpoint.save).")
    try:
        saved = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - EOFError, UnpicklingError, ...: told to every rank
        return (f"zeroshard: load_sharded: the checkpoint's .metadata in '{path}' cannot be read ({type(e).__name__}: "
                f"{e}); it is truncated or corrupt, so it changed after its save completed (save_sharded only swaps "
                "in complete checkpoints). Fix: load another checkpoint.")
    try:
        with open(os.path.join(path, SIDECAR)) as f:
            saved_world = json.load(f).get("world_size")
    except (OSError, ValueError):  # not saved by save_sharded: DCP's FileSystemWriter writes __{rank}_{i}.distcp per rank
        saved_world = len({n.split("_")[2] for n in os.listdir(path) if n.startswith("__") and n.endswith(".distcp")}) or None
    world = dist.get_world_size() if _distributed() else 1
    at = f" (saved at world size {saved_world}, loading at {world})" if saved_world is not None else ""
    flat, mapping = _flatten(state)
    entries = saved.state_dict_metadata
    for key, value in flat.items():
        meta = entries.get(key)
        is_tensor = torch.is_tensor(value) or is_sharded(value)
        if meta is None:
            near = [k for k in entries if _bare(k) == _bare(key)][:1]
            return (f"zeroshard: load_sharded: the checkpoint '{path}' has no '{key}'{at}"
                    + (f"; it has '{near[0]}'" if near else "")
                    + (f". {_OTHER_STATES.format(top=mapping[key][0], path=path)}" if ".state." in key else
                       ". Fix: load into a state dict with the keys it was saved with (same model, same top-level names)."))
        if is_tensor != isinstance(meta, TensorStorageMetadata):
            return (f"zeroshard: load_sharded: '{key}' is {'a tensor' if is_tensor else 'not a tensor'} here but "
                    f"{'a tensor' if not is_tensor else 'not a tensor'} in the checkpoint '{path}'.")
        if not is_tensor:
            continue
        shape, saved_shape = tuple(value.size()), tuple(meta.size)
        if shape != saved_shape:
            per_rank = key.endswith("_flat_param") and not is_sharded(value)
            return (f"zeroshard: load_sharded: '{key}' has shape {saved_shape} in the checkpoint but {shape} here{at}. "
                    + ("A FlatParameter shard (LOCAL_STATE_DICT) is per rank: it only loads at the world size it was "
                       "saved with. Fix: save SHARDED_STATE_DICT to change world size."
                       if per_rank else "Fix: load into the same model configuration as was saved."))
        if meta.properties.dtype != value.dtype:
            return (f"zeroshard: load_sharded: '{key}' is {meta.properties.dtype} in the checkpoint but {value.dtype} "
                    "here; DCP would convert it silently. Fix: load into a model / optimizer of the saved dtype.")
    if strict:
        tops = {mapping[k][0] for k in flat}
        for key in entries:
            top = saved.planner_data.get(key, (key,))[0]
            if key not in flat and top in tops:
                empty = not any(".state." in k for k in flat if mapping[k][0] == top)
                head = f"zeroshard: load_sharded: the checkpoint '{path}' has '{key}' but the state to load into does not"
                if ".state." in key and empty:
                    return (f"{head} (strict=True). An optimizer that has not stepped yet has no state to load into. "
                            "Fix: call zeroshard.optim_state.init_optim_state(optim) before optim_state_dict().")
                if ".state." in key:  # strict=False would drop that state silently
                    return f"{head}. {_OTHER_STATES.format(top=top, path=path)}"
                return f"{head} (strict=True). Fix: load into a state dict with the same keys, or pass strict=False."
    return None
