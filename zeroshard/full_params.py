"""``summon_full_params`` on one unit: the full parameters under their original names.

State dicts, ``summon_full_params`` and ``apply`` need every parameter whole
and registered as an ``nn.Parameter`` where the plain module has it. The
unit gathers its shard in the parameters' own dtype (never the mixed-precision
compute dtype), registers views of the gathered buffer as parameters (with
``with_grads``, the gradient gathered likewise), and on exit copies this rank's
chunk back into the shard (``writeback``) and returns to its sharded layout.

A mixin of :class:`~zeroshard.handle.FlatParamHandle` (its ``layout``,
``local_shard``, ``flat_param``, gather and view methods).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from . import comm

_OWNER = WeakIdKeyDictionary()  # each parameter a summon registered -> its unit (weakly both)


class FullParams:
    def enter_full_params(self, writeback: bool, with_grads: bool) -> dict:
        """Gather the full parameters and register them under their original
        names as ``nn.Parameter``s (for summon_full_params / state dicts).
        Returns what :meth:`exit_full_params` needs to undo it."""
        # Asked before anything changes: a refusal must leave the unit as it was.
        any_grad = self._any_rank_has_grad() if with_grads else False
        self.follow_cast()
        self.writeback_orig_params()
        if self.unsharded and not self.always_full:
            # A copy gathered for compute may be in low precision, int8-quantized (qwZ), or kept by a forward
            # whose backward has not come (stale after an optimizer step); and which units hold one may differ
            # by rank: every rank gathers exactly again.
            self.reshard(free=True)
        # NO_SHARD in place (always_full): the views are the parameters themselves, so changes
        # persist whatever ``writeback`` says, as torch FSDP1 documents for NO_SHARD.
        undo = {"was_unsharded": self.unsharded, "grads": None}
        if not self.always_full:
            self.wait_unshard(full_precision=True)
        flat = self.flat_param.detach()
        views = [p.unflat(flat[p.offset : p.offset + p.numel]) for p in self.layout.params]
        if self.use_orig_params:
            params = self.orig_params
            for p, view in zip(params, views):
                p.data = view
        else:
            params = [nn.Parameter(v, requires_grad=self.flat_param.requires_grad) for v in views]
            self.flat_param_host._parameters.pop("_flat_param", None)
        for p, info in zip(params, self.layout.params):
            _register(info.module, info.name, p)
        for info in self.layout.shared:
            _register(info.module, info.name, params[info.prim_index])
        if with_grads and any_grad:
            undo["grads"] = self._gather_full_grads(params)
        undo["params"] = (params, views)
        for p in params:  # whose they are, for another unit's take_rebinds
            _OWNER[p] = weakref.ref(self)
        self.summoned_writeback = writeback  # (forward_pass.pre_forward: a forward inside the block)
        return undo

    def _any_rank_has_grad(self) -> bool:
        """Whether any rank holds a gradient for this unit (one all-reduce when sharded,
        so that every rank joins the gradient all-gather or none does); every rank
        refuses if any holds a ``no_sync`` gradient: full-size and unreduced, it is no shard."""
        g = self.flat_param.grad
        if not self.sharded:
            return g is not None
        have = torch.tensor([g is not None, self.grad_unreduced()], dtype=torch.int32, device=self.local_shard.device)
        comm.all_reduce(have, self.group, op=dist.ReduceOp.MAX, what=f"summon_full_params(with_grads) of unit '{self.unit_name}'")
        if have[1].item():
            raise RuntimeError(
                f"zeroshard: summon_full_params(with_grads=True) on unit '{self.unit_name}', whose gradient was "
                "accumulated inside no_sync() and not yet reduced across ranks (on at least one rank): there is no "
                "gradient shard to gather. Fix: run a synchronizing backward (outside no_sync()) first, or use "
                "with_grads=False: the parameters' .grad then still show this rank's accumulated gradient.")
        return bool(have[0].item())

    def _gather_full_grads(self, params) -> torch.Tensor:
        """The full flat gradient (some rank has one), with ``params``' grads viewing it."""
        g = self.flat_param.grad
        if self.sharded:
            g = g if g is not None else torch.zeros_like(self.local_shard)
            full = g.new_empty(self.layout.padded_numel)
            comm.all_gather(full, g, self.group, async_op=False, what=f"summon_full_params(with_grads) of unit '{self.unit_name}'")
            g = full
        for p, info in zip(params, self.layout.params):
            view = info.unflat(g[info.offset : info.offset + info.numel])
            p.grad = None
            self._point_grad(p, view)
        return g

    def exit_full_params(self, writeback: bool, undo: dict):
        """Write back (``writeback``) and reshard; :meth:`take_rebinds` first."""
        self.summoned_writeback = None
        if self.sharded and writeback:
            start = self.rank * self.layout.shard_numel
            # Through .data: the write does not bump the version counter the forward's saved views share (a
            # backward pending since would refuse to run), as torch writes back.
            self.local_shard.data.copy_(self._full[start : start + self.layout.shard_numel])
            self.secondary = None  # hpZ: kept from a forward before the edit; a pending backward gathers the new shard
            # with_grads: this rank's part of the (maybe edited) gradient. A rank that had no gradient (its
            # shard all frozen parameters) gathered zeros for it and has none again, as in torch.
            if undo["grads"] is not None and self.flat_param.grad is not None:
                self.flat_param.grad.copy_(undo["grads"][start : start + self.layout.shard_numel])
        if not self.use_orig_params:
            for info in (*self.layout.params, *self.layout.shared):
                info.module._parameters.pop(info.name, None)
            self.flat_param_host._parameters["_flat_param"] = self.flat_param
            if self.always_full:
                self.use_unsharded_views()
            else:
                self._placeholder_views()
        self.reshard(free=not undo["was_unsharded"])
        if self.use_orig_params:
            self.use_grad_views()  # a no_sync gradient still unreduced keeps its unsharded views

    def take_rebinds(self, writeback: bool, undo: dict) -> tuple[list[str], list]:
        """A parameter replaced inside the block (``w.data = new``, ``module.w = nn.Parameter(new)``)
        no longer views the gathered buffer, so the write-back would drop it silently (torch FSDP1
        does). With ``writeback`` a replacement of the parameter's shape is to be copied into the
        buffer; the module gets the unit's own parameter back either way. Called for every unit of
        the block before any is resharded or written to (a replacement may be another unit's
        gathered parameter, or two swapped): returns (the replacements that cannot be written back,
        for the caller to raise once every unit is resharded; the (buffer view, copy of the value)
        pairs to write). Decided alike on every rank: a parameter of a unit no longer summoned (an
        inner block's, freed or back to shard views) is refused by whose it is, not by its values."""
        params, views = undo["params"]
        problems, copies = [], []
        named = [*enumerate(self.layout.params), *((info.prim_index, info) for info in self.layout.shared)]
        for i, info in named:
            now, ours, view = info.module._parameters.get(info.name), params[i], views[i]
            if not writeback:  # discarded, whatever it was (a forward inside re-points use_orig_params' .data itself)
                if now is not ours:
                    _register(info.module, info.name, ours)
                continue
            if now is ours and now.data_ptr() == view.data_ptr() and now.shape == view.shape:
                continue
            where = f"'{info.fqn}' of unit '{self.unit_name}'"
            owner = _OWNER.get(now) if torch.is_tensor(now) else None
            owner = owner() if owner is not None else None
            if owner is not None and owner.summoned_writeback is None:
                problems.append(f"{where} was replaced inside summon_full_params by a parameter of unit "
                                f"'{owner.unit_name}', whose own block has ended (its full values are gone)")
            elif not torch.is_tensor(now) or now.is_meta or tuple(now.shape) != tuple(view.shape):
                got = "deleted" if now is None else f"{tuple(now.shape)}" if torch.is_tensor(now) else type(now).__name__
                problems.append(f"{where} was replaced inside summon_full_params by {got}, not a tensor of its shape "
                                f"{tuple(view.shape)}{' (meta)' if torch.is_tensor(now) and now.is_meta else ''}")
            else:
                copies.append((view, now.detach().clone()))
            if ours.data_ptr() != view.data_ptr() or ours.shape != view.shape:
                ours.data = view
            _register(info.module, info.name, ours)
        return problems, copies


def _register(module: nn.Module, name: str, param: nn.Parameter):
    module.__dict__.pop(name, None)  # a plain view attribute would shadow the parameter
    module._parameters[name] = param
