"""``summon_full_params`` over a model: every FSDP unit in a module's tree
gathered and shown under its original names (as ``nn.Parameter``s) for the
duration of a block, as torch FSDP1's ``summon_full_params``; with
``writeback`` the changes made inside are copied back into the shards on exit.
One unit's part (gather, register, write back) is :mod:`zeroshard.full_params`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .handle import HandleState


def units_of(module: nn.Module, recurse: bool = True):
    """The FSDP units in ``module``'s tree; with ``recurse=False`` only ``module``
    itself if it is one (a plain module holding units gives none, as in torch)."""
    # By the child's name, not hasattr: an activation-checkpoint wrapper forwards unknown attributes to the unit inside.
    from_tree = [m for m in module.modules() if "_fsdp_wrapped_module" in m._modules and hasattr(m, "_handle")]
    return from_tree if recurse else [m for m in from_tree[:1] if m is module]


@contextlib.contextmanager
def summon_full_params(module, recurse=True, writeback=True, rank0_only=False, offload_to_cpu=False, with_grads=False,
                       inside_summon=False, plain_dicts=False):
    """torch FSDP1's summon_full_params. ``inside_summon`` (state dicts): units
    already summoned by an enclosing block are used as they are, as torch's
    state-dict hooks do, instead of refused. ``plain_dicts`` (``compat.hfai``):
    meanwhile a LOCAL ``state_dict()`` of any unit in the block is its plain
    module's full dict (``unit._plain_dicts``) instead of refused."""
    if rank0_only and writeback:
        raise NotImplementedError("zeroshard: summon_full_params(rank0_only=True, writeback=True) is not supported (torch FSDP "
                                  "forbids it too): other ranks would write back parameters they never saw. Fix: pass writeback=False.")
    units = units_of(module, recurse)
    if with_grads and any(u._handle is not None and not u._handle.use_orig_params for u in units):
        raise NotImplementedError("zeroshard: summon_full_params(with_grads=True) needs use_orig_params=True (as in torch FSDP).")
    if offload_to_cpu and any(u.compute_device.type != "cpu" for u in units):
        raise ValueError("zeroshard: summon_full_params(offload_to_cpu=True) on a GPU module is not supported yet. Fix: leave offload_to_cpu=False.")
    busy = next((u for u in units if u._summoning), None)
    if busy is not None and not inside_summon:  # torch refuses too; gathering twice would free the outer block's buffer
        raise RuntimeError(f"zeroshard: summon_full_params (or apply) entered again inside summon_full_params of unit "
                           f"{type(busy.module).__name__}. Fix: do the work inside the open block.")
    handles = [u._handle for u in units if u._handle is not None and not u._summoning]
    for h in handles:
        if h.state != HandleState.IDLE:
            raise RuntimeError(f"zeroshard: summon_full_params called while unit '{h.unit_name}' is in {h.state.name.lower()}; "
                               "it can only run between training steps. Fix: call it outside forward/backward (after "
                               "a backward that raised and was caught, run the next forward first: it puts the units "
                               "back; torch FSDP1 refuses here too).")
    for h in handles:
        # optimizer.zero_grad() cleared the original parameters' grads but not
        # the flat gradient they viewed; leaving the block re-points them at
        # it, so drop it now or the next backward accumulates onto stale
        # gradients (torch's state_dict / optim_state_dict reset it too).
        h.reset_grad_if_orig_grads_none()
    undo, body_ok = [], False
    for u in units:  # named_parameters() / named_buffers() drop the wrapper prefix meanwhile
        u._summoning += 1
        if plain_dicts:
            u._plain_dicts = True
    with torch.no_grad():
        try:
            for h in handles:
                undo.append((h, h.enter_full_params(writeback, with_grads)))
            rank = handles[0].rank if handles else 0
            if rank0_only and rank != 0:  # gathered with everyone (a collective), then dropped
                while undo:
                    h, u = undo.pop()
                    h.exit_full_params(False, u)
            for h in handles:  # on every rank: a forward inside is refused alike (forward_pass.pre_forward)
                h.summoned_rank0_only = rank0_only
            yield
            body_ok = True
        finally:
            for h in handles:
                h.summoned_rank0_only = False
            for u in units:
                u._summoning -= 1
                if plain_dicts:
                    u._plain_dicts = False
            problems, copies = [], []
            try:  # every replacement read (copied) before any is written or any unit resharded: see take_rebinds
                for h, u in undo:
                    found, pairs = h.take_rebinds(writeback, u)
                    problems += found
                    copies += pairs
                for view, value in copies:
                    view.copy_(value)
            finally:
                while undo:
                    h, u = undo.pop()
                    h.exit_full_params(writeback, u)
            if problems and body_ok:  # (not over an exception from the block)
                raise ValueError(f"zeroshard: {problems[0]}; it was discarded"
                                 f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}. Fix: change "
                                 "parameters in place inside the block (`p.copy_(new)` under torch.no_grad()), or "
                                 "replace one by a tensor of its own shape.")
