"""``use_orig_params=True``: the original nn.Parameters live on as views of the shard.

torch FSDP1 (and zeroshard) let the optimizer hold the module's own
parameters instead of one FlatParameter. Between steps each original parameter
is a 1-D view of its slice of this rank's shard (empty where the shard holds
none of it), and its ``.grad`` a view of the same slice of the sharded
gradient, so an optimizer step updates the shard in place. Under NO_SHARD,
where each rank holds the whole flat buffer, both are full-shape views of
their segment instead. While the unit computes, the module sees plain views
of the all-gathered buffer instead.

Users may still change those parameters between steps without going through
the views: assign ``p.data = ...`` or a new Parameter to the module, assign
``p.grad = ...`` (e.g. a named optimizer's eager state init) or set one
parameter's grad to None. :meth:`OrigParams.writeback_orig_params` runs before
every unshard, as torch's does, and copies such changes into the shard and the
sharded gradient, so the next all-gather and the next accumulation see them
instead of silently overwriting them.

A mixin of :class:`~zeroshard.handle.FlatParamHandle` (its ``layout``,
``local_shard``, ``flat_param``, ``orig_params``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .flat_param import changed_elements


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class OrigParams:
    """The original parameters' views of the shard, their grads, and writeback."""

    # Indices of parameters whose grad the user set to None while the flat
    # gradient existed: their slice was zeroed and their .grad stays None until
    # a backward computes them again (torch's _is_grad_none_mask).
    grad_none: set[int]
    # True from the moment the original parameters are handed back to the user
    # (between steps) until writeback has checked them: only then can the user
    # have replaced them, and one check per exposure is enough.
    orig_exposed: bool = False
    # What the unit last set in the module's parameter slots (the handle's ``installed_views``):
    # with use_orig_params, the plain views of the full buffer while it computes or stays
    # gathered (use_unsharded_views), None while the original Parameters stand there.
    installed_views: list | None = None
    # The gradient objects the original parameters held when the current backward started,
    # and those autograd gave them before their unit's post-backward (see detach_grad_views).
    _grads_at_backward: list | None = None
    _outside: dict

    def shard_view(self, i: int) -> torch.Tensor:
        """Original parameter i's elements in this rank's shard, as a 1-D view (empty if none)."""
        sl = self.layout.shard_slices[i]
        if sl is None:
            return self.local_shard.new_empty(0)
        return self.local_shard[sl.offset_in_shard : sl.offset_in_shard + sl.numel_in_shard]

    def use_sharded_views(self):
        """Re-register the original nn.Parameters as 1-D views of this rank's
        shard (full-shape views of the flat buffer under NO_SHARD)."""
        if not self.sharded:
            flat = self.flat_param.detach()
            for p, info in zip(self.orig_params, self.layout.params):
                info.module._parameters[info.name] = p
                p.data = info.unflat(flat[info.offset : info.offset + info.numel])
        else:
            for i, (p, info) in enumerate(zip(self.orig_params, self.layout.params)):
                info.module._parameters[info.name] = p
                p.data = self.shard_view(i)
        for info in self.layout.shared:
            info.module._parameters[info.name] = self.orig_params[info.prim_index]
        self.orig_exposed = True
        self.installed_views = None

    def use_sharded_grad_views(self):
        g = self.flat_param.grad
        for i, (p, info, sl) in enumerate(zip(self.orig_params, self.layout.params, self.layout.shard_slices)):
            if g is None or not p.requires_grad or i in self.grad_none:
                p.grad = None
            elif self.sharded and sl is None:
                p.grad = None
            else:
                if self.sharded:
                    view = g[sl.offset_in_shard : sl.offset_in_shard + sl.numel_in_shard]
                else:
                    view = info.unflat(g[info.offset : info.offset + info.numel])
                self._point_grad(p, view)

    @staticmethod
    def _point_grad(p: torch.Tensor, view: torch.Tensor):
        """``p.grad = view``; a low-precision view on a full-precision parameter
        (keep_low_precision_grads) goes in through ``.data``, as torch does."""
        if view.dtype == p.dtype:
            p.grad = view
        else:
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.data = view

    def _segment_of(self, info, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a parameter's value or grad as the user sees it between steps) as its
        stretch of this rank's flat buffer: the 1-D slice itself, or the full one in memory order."""
        return x.reshape(-1) if self.sharded else info.flat_of(x)

    def grad_unreduced(self) -> bool:
        """The flat gradient is the full-size one ``no_sync`` accumulated, not yet reduce-scattered."""
        g = self.flat_param.grad
        return self.sharded and g is not None and g.numel() == self.layout.numel != self.local_shard.numel()

    def use_grad_views(self):
        """Re-point the grads at the flat gradient (after a forward, as torch does,
        and after a synchronized backward): unsharded views while it is the
        unsharded one ``no_sync`` accumulated and nothing reduced since (a unit
        the synchronizing backward skipped), whose slices at shard offsets would
        pass for reduced shards; the optimizer check then names the unit
        (validation._check_no_unreduced)."""
        if self.grad_unreduced():
            self.use_unsharded_grad_views()
        else:
            self.use_sharded_grad_views()

    def use_unsharded_grad_views(self):
        """During ``no_sync`` the original parameters' grads view the unsharded
        accumulated gradient (their data is still the 1-D shard, hence ``.data``)."""
        g = self.flat_param.grad
        for p, info in zip(self.orig_params, self.layout.params):
            if g is None:  # frozen parameters get their (zero) view too, as in torch
                p.grad = None
                continue
            view = info.unflat(g[info.offset : info.offset + info.numel])
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.data = view

    def reset_grad_if_orig_grads_none(self):
        """``optimizer.zero_grad(set_to_none=True)`` clears the original
        parameters' grads; drop the flat gradient they were views of. The
        FlatParameter requires grad while any original parameter does, so a
        unit frozen at wrap time and unfrozen later trains (torch's rule too)."""
        if not self.use_orig_params:
            return
        if all(p.grad is None for p in self.orig_params):
            self.flat_param.grad = None
        self.flat_param.requires_grad_(any(p.requires_grad for p in self.orig_params))

    def note_grads_at_backward(self):
        """At the start of a backward: the gradient objects the original
        parameters hold (see :meth:`absorb_outside_grads`)."""
        self._grads_at_backward = [p.grad for p in self.orig_params] if self.use_orig_params else None
        self._outside = {}

    def _is_outside(self, i: int, grad) -> bool:
        """``grad`` (parameter ``i``'s now) is one autograd created this backward, not a view of the flat gradient."""
        g = self.flat_param.grad
        return (grad is not None and grad is not self._grads_at_backward[i]
                and not (g is not None and _same_storage(grad, g)))

    def detach_grad_views(self):
        """At a synchronized post-backward: the original parameters' grads view
        buffers the asynchronous reduction is still combining (the gradient set
        aside before backward; under NO_SHARD the very buffer being all-reduced).
        A loss term on the parameters themselves reaching them later in this
        backward would add into those mid-flight, or before the reduced
        gradient instead of after it. torch FSDP1 reduces synchronously and
        re-points the grads at the accumulated shard at this point; here they
        are None until the end of backward, and what autograd gives them
        meanwhile is added in after the reduction (:meth:`absorb_outside_grads`).
        What autograd gave them before this point, outside the unit's own
        backward (a parent module reading this unit's parameter, a penalty built
        after the forward), is put aside for that too on a sharded unit, as
        torch adds it; on an unsharded one (NO_SHARD) it joins the gradient
        about to be all-reduced, as DDP averages it: added unreduced, a
        data-dependent term would make the replicas differ for good. (Reached
        before the pre-backward gather, writeback put it in already.)"""
        if self._grads_at_backward is None:
            return
        if not self.sharded:
            self.fold_outside_grads()
        for i, p in enumerate(self.orig_params):
            if self._is_outside(i, p.grad):
                self._outside[i] = p.grad
            p.grad = None

    def fold_outside_grads(self):
        """Add what autograd gave the original parameters outside the unit's own
        backward into the unsharded flat gradient, not yet reduced: under
        NO_SHARD at the post-backward (see :meth:`detach_grad_views`), and in
        any unit at a ``no_sync`` post-backward, whose re-pointed grad views
        would otherwise overwrite it (torch FSDP1 loses it there)."""
        g = self.flat_param.grad
        if self._grads_at_backward is None or g is None or g.numel() != self.layout.numel:
            return
        for i, p in enumerate(self.orig_params):
            if self._is_outside(i, p.grad):
                info = self.layout.params[i]
                g[info.offset : info.offset + info.numel].add_(info.flat_of(p.grad.detach()))
                self._grads_at_backward[i] = p.grad  # counted: not to be added again

    def absorb_outside_grads(self):
        """A loss term on the original parameters themselves, outside forward
        (an L2 penalty over ``model.parameters()`` computed before it), reaches
        them through their own AccumulateGrad nodes: autograd gives them a new
        ``.grad``, which pointing them at the flat gradient would drop. torch
        FSDP1 adds it into its gradient views; add it into the flat gradient
        here too (this rank's, unreduced, as in torch)."""
        if self._grads_at_backward is None:
            return
        g = self.flat_param.grad
        for i, p in enumerate(self.orig_params):
            terms = [t for t in (self._outside.get(i), p.grad if self._is_outside(i, p.grad) else None) if t is not None]
            own = self._own_range(i)
            if not terms or own is None:
                continue
            if g is None:
                g = self.flat_param.grad = torch.zeros_like(self.local_shard)
            offset, numel = own
            with torch.no_grad():
                for t in terms:
                    g[offset : offset + numel].add_(self._segment_of(self.layout.params[i], t))
            self.grad_none.discard(i)

    def _own_range(self, i: int) -> tuple[int, int] | None:
        """(offset, numel) of original parameter ``i`` in this rank's shard (the whole buffer under NO_SHARD)."""
        if not self.sharded:
            info = self.layout.params[i]
            return info.offset, info.numel
        sl = self.layout.shard_slices[i]
        return None if sl is None else (sl.offset_in_shard, sl.numel_in_shard)

    def gradients_computed(self):
        """A synchronized backward gave every parameter that requires grad a gradient."""
        self.grad_none -= {i for i, p in enumerate(self.orig_params) if p.requires_grad}

    def writeback_orig_params(self):
        """Copy what the user changed on the original parameters since the last
        reshard into the shard and the sharded gradient (torch FSDP1's
        ``_writeback_orig_params``):

        * a new Parameter assigned to the module, or ``p.data`` re-pointed: its
          values go into the shard (a new Parameter replaces the old one; its
          gradient is not carried over, as in torch);
        * ``p.grad`` assigned a tensor that is not a view of the flat gradient:
          its values go into the flat gradient (created as zeros if needed);
        * ``p.grad`` set to None while the flat gradient exists: that slice is
          zeroed and ``p.grad`` stays None until the next backward.

        Returns whether parameter values went into the shard alone: a unit
        still gathered then holds stale full parameters (kept.drop_stale_kept).
        """
        if not self.use_orig_params:
            return False
        if self.installed_views is not None and self.unsharded:
            self._take_replaced_full_views()
        if not self.orig_exposed:
            return False
        wrote = False
        flat_grad = self.flat_param.grad
        had_grad = flat_grad is not None  # one created below for another parameter says nothing of a None .grad
        # Inside a backward, flat_grad can be an unsharded gradient not yet reduced (no_sync's accumulation, or
        # one autograd added after a reentrant checkpoint's inner backward reduced this unit and it gathers
        # again): the shard's offsets below do not index it, and the parameters' None .grad says nothing of it.
        # Nor after this backward's post-backward of the unit (gathered again for a recomputation): that set
        # the grads to None itself (detach_grad_views), or to views of the flat gradient (no_sync); under
        # NO_SHARD zeroing for those Nones erased the reduced part.
        grads = not (self._grads_at_backward is not None
                     and (self.post_backward_called
                          or (self.sharded and had_grad and flat_grad.shape != self.local_shard.shape)))
        for i, info in enumerate(self.layout.params):
            now = info.module._parameters.get(info.name)
            self._refuse_plain_tensor(info, now)
            own = self._own_range(i)
            if own is None:  # none here: refuse a replacement where a rank holding a slice does (every rank, then)
                replaced = now is not self.orig_params[i] or not _same_storage(now, self.local_shard)  # or its .data
                if isinstance(now, nn.Parameter) and replaced and now.numel():
                    held = (self.layout.slice_on(info, r) for r in range(self.world_size))
                    bad = [s.numel_in_shard for s in held if s is not None and s.numel_in_shard
                           and now.shape != torch.Size([s.numel_in_shard])]
                    if bad:
                        self._write_slice(now, self.local_shard, 0, bad[0], info, "parameter")  # raises
                continue
            offset, numel = own
            p = self.orig_params[i]
            if now is None:
                continue  # deregistered (e.g. by checkpointing code), as torch skips it
            if now is not p:
                now._zeroshard_unit = self.unit_name
                self.orig_params[i] = p = now
                self._write_slice(p, self.local_shard, offset, numel, info, "parameter")
                wrote = True
            elif not _same_storage(p, self.local_shard):
                self._write_slice(p, self.local_shard, offset, numel, info, "parameter")
                wrote = True
            if not grads:
                continue
            if p.grad is None:
                if had_grad:
                    flat_grad[offset : offset + numel].zero_()
                    self.grad_none.add(i)
            elif flat_grad is None or not _same_storage(p.grad, flat_grad):
                if flat_grad is None:
                    flat_grad = self.flat_param.grad = torch.zeros_like(self.local_shard)
                self._write_slice(p.grad, flat_grad, offset, numel, info, "gradient")
                self.grad_none.discard(i)
                if self._grads_at_backward is not None:  # inside a backward (its pre-backward gather): a term autograd
                    self._grads_at_backward[i] = p.grad  # gave, now in the flat gradient; not to be added again after
        for info in self.layout.shared:
            if info.module._parameters.get(info.name) is not self.orig_params[info.prim_index]:
                raise RuntimeError(f"zeroshard: '{info.fqn}' in unit '{self.unit_name}' shares its parameter with another "
                                   "name (tied weights) and one of them was replaced; changing tied parameters is not "
                                   "supported (nor by torch FSDP1). Fix: update the shared parameter in place "
                                   "(p.data.copy_(...)), or untie them before wrapping.")
        self.orig_exposed = False
        return wrote

    def _replaced_full_views(self):
        """(index, info, what the module holds now) of each parameter whose full view was replaced
        since the unit was gathered: ``p.data = ...`` on the view, or a new Parameter in its slot."""
        base, es = self._full.data_ptr(), self._full.element_size()
        out = []
        for i, (view, info) in enumerate(zip(self.installed_views, self.layout.params)):
            now = info.module._parameters.get(info.name)
            if now is not None and (now is not view or (info.numel and now.data_ptr() != base + info.offset * es)):
                out.append((i, info, now))
        return out

    def _take_replaced_full_views(self):
        """A unit kept gathered after a forward (ZeRO-2, the root, a forward whose backward never
        came) shows plain views of its full buffer as the module's parameters. One the user
        replaced since (``p.data = ...`` over ``model.parameters()``, a new Parameter) goes into
        the full buffer and this rank's part of the shard, so the next forward, state dict and
        all-gather see it (torch FSDP1 raises an AssertionError under ZeRO-2, and a kept root
        computes with the old values)."""
        for i, info, now in self._replaced_full_views():
            new_object = now is not self.installed_views[i]
            if new_object:
                self._refuse_plain_tensor(info, now)  # a plain tensor in the slot: functional_call
                if any(s.prim_index == i for s in self.layout.shared):
                    raise RuntimeError(f"zeroshard: '{info.fqn}' in unit '{self.unit_name}' shares its parameter with "
                                       "another name (tied weights) and was replaced; changing tied parameters is not "
                                       "supported. Fix: update it in place (p.data.copy_(...)).")
            if now.shape != info.shape:
                raise RuntimeError(
                    f"zeroshard: '{info.fqn}' in unit '{self.unit_name}' was replaced by a tensor of shape "
                    f"{tuple(now.shape)} while the unit is gathered; it must keep the shape {tuple(info.shape)}. Fix: "
                    "update it in place (p.data.copy_(...)) or inside summon_full_params().")
            if new_object:
                now._zeroshard_unit = self.unit_name
                self.orig_params[i] = now
            value = info.flat_of(now.detach())
            with torch.no_grad():
                full = self._full[info.offset : info.offset + info.numel]
                # A value in the gathered copy's dtype was computed from that copy, which mixed
                # precision or qwZ rounded: only its elements that differ reach the shard, so
                # `p.data = p.data.clone()` leaves the fp32 master alone (NaN both ways, a qwZ block
                # holding an inf, is no change). A value of another dtype (fp32 EMA weights swapped
                # in) is taken whole, as given.
                changed = None
                if value.dtype == full.dtype:
                    changed = changed_elements(value, full)
                full.copy_(value)
                if self.sharded:
                    sl = self.layout.shard_slices[i]
                    at, lo, n = (None, 0, 0) if sl is None else (sl.offset_in_shard, sl.offset_in_param, sl.numel_in_shard)
                elif not _same_storage(self._full, self.local_shard):
                    at, lo, n = info.offset, 0, info.numel
                else:
                    at = None  # the shard is the buffer itself
                if at is not None:
                    own, new = self.local_shard.data[at : at + n], value[lo : lo + n]
                    if changed is not None:  # (offload: own on the CPU, the mask on the device)
                        new = torch.where(changed[lo : lo + n], new.to(own.dtype), own.to(new.device))
                    own.copy_(new)

    def refuse_replaced_full_views(self):
        """Before a backward through a unit kept gathered since its forward: a parameter replaced
        meanwhile is not what the forward computed with (torch FSDP1 raises too)."""
        if not self.use_orig_params or self.installed_views is None or not self.unsharded:
            return
        for _, info, _ in self._replaced_full_views():
            raise RuntimeError(
                f"zeroshard: '{info.fqn}' in unit '{self.unit_name}' was replaced (p.data = ..., or a new tensor) "
                "between its forward and its backward, while the unit was kept gathered; the backward would "
                "differentiate the values the forward used and drop the new ones (torch FSDP1 raises too). Fix: change "
                "parameters after the backward, or before the forward.")

    def _refuse_plain_tensor(self, info, now):
        """A plain tensor in a parameter's place (``now``) comes from ``torch.func.functional_call`` /
        ``nn.utils.stateless``: the unit computes with its own gathered parameters, so those
        values would be ignored silently (torch FSDP1 raises for full shapes)."""
        if now is not None and not isinstance(now, nn.Parameter):
            raise RuntimeError(
                f"zeroshard: '{info.fqn}' in unit '{self.unit_name}' was replaced by a plain tensor of shape "
                f"{tuple(now.shape)} (torch.func.functional_call or nn.utils.stateless do this); a unit computes with its "
                "own all-gathered parameters, so those values would be ignored. Fix: call functional_call on the "
                "unwrapped module, or copy the values in (p.data.copy_(...) or inside summon_full_params()).")

    def _write_slice(self, src: torch.Tensor, dst: torch.Tensor, offset: int, numel: int, info, what: str):
        # Between steps a parameter is this rank's 1-D slice (sharded) or its full shape (NO_SHARD).
        expected = torch.Size([numel]) if self.sharded else info.shape
        if src.shape != expected:
            raise RuntimeError(
                f"zeroshard: the {what} of '{info.fqn}' in unit '{self.unit_name}' was replaced by a tensor of shape "
                f"{tuple(src.shape)}; with use_orig_params=True it must keep the shape {tuple(expected)} of the view "
                "it replaced (this rank's slice). Fix: update it in place (p.data.copy_(...), p.grad.copy_(...)) "
                "or inside summon_full_params().")
        with torch.no_grad():
            dst[offset : offset + numel].copy_(self._segment_of(info, src))
