"""Checkpoints of ZeRO-1's sharded optimizer state (zero1.ZeroOneOptimizer's).

Rank r holds chunk r of each param group's flat master and of the inner
optimizer's per-element states. Two forms:

* :meth:`Zero1Checkpoints.state_dict` gathers every chunk into full flat tensors
  (collective), so the checkpoint reloads at any world size: each rank cuts its
  own chunk back out of it;
* the inner optimizer's own ``state_dict()`` stays this rank's chunks, tagged
  with the rank and world size, and its ``load_state_dict`` takes only that rank's
  (a DDP habit, saving on rank 0 and loading everywhere, would silently give every
  rank rank 0's Adam moments for elements it does not own).
"""
from __future__ import annotations

import torch

from . import comm
from .flat_param import shard_of

_RANK_KEY = "zeroshard_zero1_rank"  # in the inner optimizer's state_dict(): whose chunks it holds


class Zero1Checkpoints:
    """ZeroOneOptimizer's checkpoint methods (a mixin: it holds ``partitions``, ``optimizer``,
    ``group``, ``rank``, ``world`` and the inner optimizer's own ``_inner_state_dict``/``_inner_load``)."""

    def _rank_state_dict(self) -> dict:
        """The inner optimizer's ``state_dict()``: this rank's chunks, tagged with the rank and world size."""
        return {**self._inner_state_dict(), _RANK_KEY: {"rank": self.rank, "world": self.world}}

    def _load_rank_state_dict(self, sd: dict) -> None:
        """The inner optimizer's ``load_state_dict``: only what :meth:`_rank_state_dict` gave on this
        rank. Collective where sharded: rank 0 loading its own dict would train on alone, into the
        next collective, while the others refuse theirs."""
        here = {"rank": self.rank, "world": self.world}
        saved = sd.get(_RANK_KEY) if isinstance(sd, dict) else None
        problem = None
        if saved != here:
            what = (f"rank {saved['rank']} of {saved['world']}'s chunks" if isinstance(saved, dict) and saved.keys() == here.keys()
                    else "no ZeRO-1 rank tag (a plain optimizer's state, or saved before zeroshard tagged them)")
            problem = f"on rank {self.rank} of {self.world} the state dict holds {what}"
        if self.world > 1:
            found = comm.first_problem(problem, self.group, "ZeRO-1 optimizer.load_state_dict (checking whose chunks)")
            problem = found[1] if found is not None else None
        if problem is not None:
            raise ValueError(f"zeroshard: ZeRO-1's optimizer.load_state_dict: {problem}; each rank's optimizer holds only "
                             "its own chunk of the flat master. Fix: save and load with ZeroOneOptimizer.state_dict()/"
                             "load_state_dict() (collective, any world size) or engine.save_checkpoint()/"
                             "load_checkpoint(), or give each rank its own state_dict().")
        self._inner_load({k: v for k, v in sd.items() if k != _RANK_KEY})

    def _full(self, part, shard: torch.Tensor) -> torch.Tensor:
        """The whole flat tensor (padding dropped) from every rank's chunk (collective)."""
        if self.world == 1:
            return shard.detach().clone()[: part.layout.numel]
        wire = self.wire_device()  # offload_optimizer: the CPU masters travel through the GPU under NCCL
        full = torch.empty(part.layout.padded_numel, dtype=shard.dtype, device=wire)
        comm.all_gather(full, shard.detach().to(wire).contiguous(), self.group, async_op=False,
                        what="ZeRO-1 checkpoint gather")
        return full[: part.layout.numel].to(shard.device, copy=True)

    def state_dict(self) -> dict:
        """World-size independent: full flat masters and states per group (collective: call on every rank)."""
        self._take_edits()  # else a load would write the master from before them over the saved model
        inner = self._inner_state_dict()
        groups = []
        for part in self.partitions:
            if part is None:
                groups.append(None)
                continue
            st = self.optimizer.state.get(part.master, {})
            state = {k: self._full(part, v) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in st.items()}
            groups.append({"numel": part.layout.numel, "master": self._full(part, part.master), "state": state})
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        return {"groups": groups, "param_groups": hparams}

    def check_state_dict(self, sd: dict) -> None:
        """Raise, changing nothing, if :meth:`load_state_dict` could not take ``sd``."""
        if len(sd["groups"]) != len(self.partitions):
            raise ValueError(f"zeroshard: the ZeRO-1 checkpoint has {len(sd['groups'])} param groups but the optimizer has "
                             f"{len(self.partitions)}. Fix: build the optimizer with the param groups used when saving.")
        for gi, (part, saved) in enumerate(zip(self.partitions, sd["groups"])):
            if part is not None and (saved is None or saved["numel"] != part.layout.numel):
                got = None if saved is None else saved["numel"]
                raise ValueError(f"zeroshard: param group {gi} of the ZeRO-1 checkpoint holds {got} elements but this "
                                 f"model's group has {part.layout.numel}. Fix: load a checkpoint of the same model.")

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Cut a :meth:`state_dict` (saved at any world size) into this rank's chunks."""
        self.check_state_dict(sd)  # before the first group is written
        state, param_groups, index = {}, [], 0
        for part, saved, hp in zip(self.partitions, sd["groups"], sd["param_groups"]):
            if part is None:
                param_groups.append({**hp, "params": []})
                continue
            master = saved["master"].to(part.master.device, part.dtype)
            part.master.data.copy_(shard_of(part.padded(master), part.layout))
            state[index] = {k: shard_of(part.padded(v), part.layout) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in saved["state"].items()}
            param_groups.append({**hp, "params": [index]})
            index += 1
            self._write_params(part, master)
        self._inner_load({"state": {k: v for k, v in state.items() if v}, "param_groups": param_groups})
