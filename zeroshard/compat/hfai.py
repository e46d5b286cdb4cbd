"""hfai-style FSDP: scripts written for ``hfai.distributed.fsdp`` run with the
import changed to ``from zeroshard.compat.hfai import ...``.

The class is zeroshard's engine with hfai's constructor and checkpoint habits:

* ``reshard_after_forward=True`` is ZeRO-3 (FULL_SHARD), ``False`` ZeRO-2
  (SHARD_GRAD_OP: one all-gather per unit per step instead of two);
  ``fsdp_group_size=k`` shards within consecutive blocks of k ranks and
  replicates across blocks (the HYBRID strategies).
* ``model.summon_full_params()`` is a method; inside it ``state_dict()``
  returns the full parameters under the plain model's keys **without any
  collective** (hfai saves on rank 0 only) and ``load_state_dict()`` writes
  into them, persisting on exit; every rank must load (leaving the block checks
  that, in one small collective), with ``writeback=True``.
* Outside it, ``state_dict()`` is this rank's flat shards (no communication),
  tagged with the world and group size and the rank's place in its shard group,
  so that a load at another layout, or of another rank's file, fails with both named.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm, parent_load
from .. import state_dict as sd
from ..fully_sharded import FLAT_PARAM, FullyShardedDataParallel as _Engine
from ..options import BackwardPrefetch, ShardingStrategy, StateDictType
from ..wrap import size_based_auto_wrap_policy

__all__ = ["FullyShardedDataParallel", "BackwardPrefetch", "size_based_auto_wrap_policy"]

LAYOUT_KEY = "_zeroshard_layout"


class FullyShardedDataParallel(_Engine):
    _local_sharded_tensors = False  # per-rank shards are plain tensors: torch.save/torch.load them as they are
    def __init__(self, module: nn.Module, process_group=None, auto_wrap_policy=None, reshard_after_forward: bool = True,
                 backward_prefetch: BackwardPrefetch | None = None, forward_prefetch: bool = False,
                 fsdp_group_size: int | None = None):
        if fsdp_group_size is None:
            strategy = ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        else:
            strategy = ShardingStrategy.HYBRID_SHARD if reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
        super().__init__(module, process_group=process_group, sharding_strategy=strategy, auto_wrap_policy=auto_wrap_policy,
                         backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                         fsdp_group_size=fsdp_group_size)
        for unit in _Engine.fsdp_modules(self):  # auto-wrapped units are engine instances
            unit._state_dict_type = StateDictType.LOCAL_STATE_DICT
        self._fsdp_group_size = fsdp_group_size
        self._summon_recurse, self._summon_writeback, self._summon_loaded = True, True, None

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True):
        """All ranks enter; inside, parameters are full and state_dict() is the plain model's
        (the block marks its units ``_plain_dicts``). A load inside must run on every rank:
        each writes back only its own shard (checked on leaving the block, one small collective)."""
        with sd.summon_full_params(self, recurse=recurse, writeback=writeback, plain_dicts=True):
            self._summon_recurse, self._summon_writeback, self._summon_loaded = recurse, writeback, None
            try:
                yield
            except BaseException:
                # A rank whose load raised tells the others (they may have loaded); one that raised
                # before any load goes on with its error at once, as it would without this check.
                if self._summon_loaded is not None:
                    self._who_loaded()
                raise
            who = self._who_loaded()
            if len(set(who.values())) > 1:
                ranks = {s: sorted(r for r, v in who.items() if v == s) for s in (None, "failed", "done")}
                raise RuntimeError(
                    f"zeroshard.compat.hfai: load_state_dict() inside summon_full_params() did not load on every rank "
                    f"of this model (loaded on {ranks['done']}, raised on {ranks['failed']}, not called on "
                    f"{ranks[None]}): each rank writes back only its own shard, so the ranks now hold parts of "
                    "different models. Fix: load on every rank (hfai saves on rank 0, but every rank loads the file), "
                    "then run the load again.")

    def _who_loaded(self) -> dict[int, str | None]:
        """Global rank -> its load inside the block ("done", "failed": raised, None: not called), for every rank of this model
        (its shard group, then across replicas; not the other ranks of the job)."""
        what = "summon_full_params (did every rank load?)"
        shard = self.process_group
        mine = {dist.get_global_rank(shard, i): v
                for i, v in enumerate(comm.gather_objects(self._summon_loaded, shard, what))}
        if self._replicate_group is None:
            return mine
        return {r: v for group in comm.gather_objects(mine, self._replicate_group, what) for r, v in group.items()}

    def _check_full(self, call: str) -> None:
        """Inside ``summon_full_params(recurse=False)`` nested units still hold flat shards, not the plain model's keys."""
        if not self._summon_recurse and len(_Engine.fsdp_modules(self)) > 1:
            raise ValueError(f"zeroshard.compat.hfai: {call} inside summon_full_params(recurse=False): the nested FSDP "
                             "units are still sharded, so the full checkpoint would hold flat shards under internal "
                             "keys. Fix: use summon_full_params() (recurse=True).")

    def _layout(self) -> dict:
        replicas = self._replicate_group.size() if self._replicate_group is not None else 1
        return {"world_size": self.world_size * replicas, "shard_group_size": self.world_size, "shard_rank": self.rank}

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if sd.passthrough_active():
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self._plain_dicts:  # full parameters already here: no collective
            self._check_full("state_dict()")
            return sd.summoned_copy(self, prefix)
        out = super().state_dict(prefix=prefix, keep_vars=keep_vars)
        out[LAYOUT_KEY] = self._layout()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self._plain_dicts:
            self._check_full("load_state_dict()")
            if not self._summon_writeback:
                raise ValueError("zeroshard.compat.hfai: load_state_dict() inside summon_full_params(writeback=False): "
                                 "the loaded values would be dropped on leaving the block. Fix: summon_full_params() "
                                 "(writeback=True).")
            if LAYOUT_KEY in state_dict:
                raise ValueError("zeroshard.compat.hfai: load_state_dict() inside summon_full_params() got a local "
                                 "checkpoint (this rank's flat shards, saved outside the block). Fix: load it outside "
                                 "the block, or save a full checkpoint inside summon_full_params().")
            self._summon_loaded = "failed"  # until it returns
            with sd.plain_module_behaviour():
                actual = {sd.clean_key(k): k for k in nn.Module.state_dict(self, keep_vars=True)}
            with torch.no_grad(), parent_load.own_load():  # nn.Module's walk over the summoned units, not a parent's
                out = nn.Module.load_state_dict(self, {actual.get(k, k): v for k, v in state_dict.items()}, strict=strict)
            self._summon_loaded = "done"
            return out
        state_dict = dict(state_dict)
        saved = state_dict.pop(LAYOUT_KEY, None)
        if saved is None and state_dict and not any(k.endswith(FLAT_PARAM) for k in state_dict):
            raise ValueError("zeroshard.compat.hfai: load_state_dict() outside summon_full_params() got a full checkpoint "
                             "(the plain model's keys, no flat shards); outside the block it loads this rank's shards. "
                             "Fix: load it inside `with model.summon_full_params(): model.load_state_dict(sd)`.")
        mine = self._layout()
        if saved is not None and (saved["world_size"], saved["shard_group_size"]) != (mine["world_size"], mine["shard_group_size"]):
            raise ValueError(
                f"zeroshard.compat.hfai: this local checkpoint was saved with world size {saved['world_size']} and "
                f"shard group size {saved['shard_group_size']}, but this model runs with world size "
                f"{mine['world_size']} and shard group size {mine['shard_group_size']}. Fix: load it "
                "with the same world size and fsdp_group_size, or save a full checkpoint inside summon_full_params()."
            )
        if saved is not None and saved.get("shard_rank", mine["shard_rank"]) != mine["shard_rank"]:
            raise ValueError(f"zeroshard.compat.hfai: this local checkpoint holds the shards of rank {saved['shard_rank']} "
                             f"of its shard group, this is rank {mine['shard_rank']}. Fix: load on each rank the file that "
                             "rank saved (e.g. f'model{rank}.pt').")
        return super().load_state_dict(state_dict, strict=strict)
