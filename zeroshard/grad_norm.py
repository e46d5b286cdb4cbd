"""Gradient clipping over a sharded model: each rank holds 1/N of every
gradient, so the global norm is assembled from per-rank partial sums.

Computed as torch FSDP1 does, step for step, so the returned norm and the
clipped gradients are bit-identical to it: per-tensor fp32 norms, the norm of
their stack, raised to ``norm_type``, summed over ranks with one all-reduce,
then the ``1/norm_type`` root; parameters not sharded (NO_SHARD units, ignored
modules) are identical on all ranks and are added after the all-reduce. Units
a policy shards over groups of their own are summed over their own group
(torch sums them over the root's, which gives each replica another norm).
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.distributed as dist

from . import comm


def _local_norm(params, norm_type: float, device) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0, device=device)
    # A complex gradient's norm is its magnitudes' (vector_norm refuses a real dtype for complex input).
    per_tensor = [torch.linalg.vector_norm(g.detach().abs() if g.is_complex() else g.detach(), norm_type, dtype=torch.float32)
                  for g in grads]
    return torch.linalg.vector_norm(torch.stack(per_tensor), norm_type, dtype=torch.float32).to(device)


def _refuse_inside_summon(root) -> None:
    """Inside summon_full_params a unit's parameters (and, with_grads, gradients) are full, so a
    norm over them counts each element once per rank (torch FSDP1 refuses: not IDLE)."""
    summoning = [s for s in root._runtime.states if s._summoning]
    if summoning:
        raise RuntimeError(f"zeroshard: clip_grad_norm_ / the gradient norm was called inside summon_full_params "
                           f"(unit {type(summoning[0].module).__name__} is summoned), where gradients may be full "
                           "copies and the norm would count them once per rank (torch FSDP1 raises too). Fix: call "
                           "it after the `with summon_full_params(...)` block.")


@torch.no_grad()
def clip_grad_norm_(root, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    _refuse_inside_summon(root)
    handles = root._runtime.handles
    if all(not h.sharded for h in handles):
        return torch.nn.utils.clip_grad_norm_(root.parameters(), max_norm, norm_type)
    total, grads = _total_norm(root, float(norm_type))
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    if not grads:
        # torch's warning, word for word: with no local gradient the dtype is fp32 whatever the others'.
        warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {root.rank} with no gradients -- returning the total "
                      f"norm in the default dtype {total.dtype}", stacklevel=4)
        return total
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]).to_real())  # a norm is real


@torch.no_grad()
def total_norm(root, norm_type: float = 2.0) -> torch.Tensor:
    """The norm :func:`clip_grad_norm_` would return (in fp32), gradients untouched
    (collective when a unit is sharded)."""
    _refuse_inside_summon(root)
    if all(not h.sharded for h in root._runtime.handles):
        return local_total_norm(root.parameters(), norm_type)
    return _total_norm(root, float(norm_type))[0]


def local_total_norm(params, norm_type: float = 2.0) -> torch.Tensor:
    """The norm ``torch.nn.utils.clip_grad_norm_(params)`` would return, gradients untouched (0 without any)."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.tensor(0.0)


def _total_norm(root, norm_type: float):
    handles = root._runtime.handles
    # Sharded parameters by the members of their unit's shard group: one group, the root's, unless
    # a policy gave units groups of their own (a unit over the world under a hybrid root), whose
    # partial sums then each need their own all-reduce (torch FSDP1 sums all over the root's).
    sharded: dict[tuple, tuple] = {}
    nonsharded, seen, grads = [], set(), []

    def take(p, target):
        if p not in seen:
            seen.add(p)
            target.append(p)
            if p.grad is not None:
                grads.append(p.grad)

    for h in handles:
        if h.sharded:
            target = sharded.setdefault(tuple(dist.get_process_group_ranks(h.group)), (h.group, []))[1]
        else:
            target = nonsharded
        for p in h.orig_params if h.use_orig_params else [h.flat_param]:
            take(p, target)
    for p in root.parameters():  # parameters outside any unit (ignored modules)
        take(p, nonsharded)
    device = root.compute_device
    extra = _local_norm(nonsharded, norm_type, device) if nonsharded else None
    total = None
    for group, params in sharded.values():
        local = _local_norm(params, norm_type, device)
        if norm_type == math.inf:
            local = torch.maximum(local, extra) if extra is not None else local
            comm.all_reduce(local, group, op=dist.ReduceOp.MAX, what="clip_grad_norm_ (max norm)")
            total = local if total is None else torch.maximum(total, local)
        else:
            local = local**norm_type
            comm.all_reduce(local, group, what="clip_grad_norm_ (sum of squares)")
            total = local if total is None else total + local
    if norm_type != math.inf:
        if extra is not None:
            total += extra**norm_type
        total = total ** (1.0 / norm_type)
    return total, grads
