"""What the module's code sees: its parameter attributes as views of the FlatParameter.

While a unit computes, each original parameter name on its module is a view of
the unsharded FlatParameter, taken under grad mode so that autograd sends every
parameter's gradient into one flat gradient. While it is sharded
(``use_orig_params=False``) the names hold :class:`~zeroshard.flat_param.FreedView`
placeholders that raise on use instead of reading freed memory
(``use_orig_params=True`` shows views of the shard instead: see ``orig_params``).

A mixin of :class:`~zeroshard.handle.FlatParamHandle` (its ``layout``,
``flat_param``, ``_full``, ``local_shard``, ``state``, ``forward_views`` and the
placeholder bookkeeping).
"""
from __future__ import annotations

import enum

import torch
import torch.nn as nn

from .flat_param import FreedView


class HandleState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class ModuleViews:
    """The module attributes a unit installs: unsharded views, or placeholders."""

    def _placeholder_views(self):
        """While the unit is sharded (use_orig_params=False) each module attribute
        is a :class:`~zeroshard.flat_param.FreedView`: the module prints and
        introspects (repr, apply, shapes) as under torch FSDP1, and reading its
        values raises instead of reading freed memory. A buffer still gathered
        (the root between forward and backward) keeps its real views."""
        full = self._full_buffer(self.compute_dtype)
        if full.untyped_storage().nbytes() != 0:
            views = [p.unflat(full[p.offset : p.offset + p.numel]) for p in self.layout.params]
        else:
            if self._freed_views is None or self._freed_views[0].dtype != self.compute_dtype:
                self._freed_views = [FreedView(p.shape, p.stride, self.compute_dtype, self.device, p.fqn, self)
                                     for p in self.layout.params]
            views = self._freed_views
        self.installed_views = views  # (validation.refuse_replaced_flat_param)
        for view, info in zip(views, self.layout.params):
            info.module.__dict__[info.name] = view
        for info in self.layout.shared:
            info.module.__dict__[info.name] = views[info.prim_index]

    def use_unsharded_views(self):
        """Make each module attribute a view of the (unsharded) FlatParameter.

        The views are taken under grad mode from the FlatParameter itself so
        that autograd routes every parameter's gradient into ``flat_param.grad``.
        Under mixed precision a sharded unit's backward gets its first forward's
        views back, as torch FSDP1's does (see below).
        """
        views = self.forward_views  # forward_pass.pre_forward: those made as the post-backward hook was placed
        if not (self.state == HandleState.BACKWARD_PRE and views and self._full.dtype != self.local_shard.dtype
                and views[0].untyped_storage().data_ptr() == self._full.untyped_storage().data_ptr()):
            # Views made under no_grad would carry requires_grad without a grad_fn:
            # a reentrant checkpoint's recomputation (run from inside backward, in
            # the pre-backward's views) would then send no gradient to the unit.
            with torch.enable_grad():
                chunks = torch.split(self.flat_param, self.layout.split_sizes)
                views = [p.unflat(chunks[2 * i + 1]) for i, p in enumerate(self.layout.params)]
            # Each change of .data's dtype (the low-precision gather, the fp32 shard) drops autograd's
            # AccumulateGrad node, so under mixed precision views made now would feed a new node, not
            # the one the post-backward hook is on: a reentrant checkpoint's recomputation would then
            # leave every unit gathered and unreduced until the end of backward. Those the hooking
            # forward made, still over this same buffer, feed the hooked node: reused above.
        for view, info in zip(views, self.layout.params):
            _set_tensor(info.module, info.name, view, self.use_orig_params)
        for info in self.layout.shared:
            _set_tensor(info.module, info.name, views[info.prim_index], self.use_orig_params)
        self.orig_exposed = False
        self.installed_views = views


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor, in_parameters: bool):
    if in_parameters:
        # use_orig_params: the slot stays in _parameters (named_parameters
        # keeps the name) but holds the plain view while the unit computes.
        module._parameters[name] = tensor
    else:
        module.__dict__[name] = tensor
