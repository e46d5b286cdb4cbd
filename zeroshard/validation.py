"""Checks a unit passes before it is sharded: one dtype, one device, uniform
requires_grad (without use_orig_params), and the same layout on every rank;
and, at an optimizer's first step, that it was not built over parameters the
FlatParameters replaced.

A FlatParameter is one tensor, so its parameters must agree on dtype and
device; ranks whose layouts differ would all-gather mismatched buffers
(garbage, or a hang), so layouts are compared once, at construction.
"""
from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import comm
from .flat_param import FlatLayout


def check_same_layout(layout: FlatLayout, dtype, group, unit_name: str):
    """Ranks that wrapped different models would all-gather mismatched
    buffers (garbage or a hang); compare the layouts once, at construction."""
    mine = (str(dtype), [(p.fqn, tuple(p.shape)) for p in layout.params])
    if group.size() == 1:
        return
    everyone = [None] * group.size()
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        raise comm.CollectiveError(f"zeroshard: rank {dist.get_rank()}: comparing the layout of unit '{unit_name}' "
                                   f"across ranks failed ({e}); ranks may be wrapping different models.") from e
    for r, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        if theirs[0] != mine[0]:
            diff = f"dtype {theirs[0]} on rank {r} vs {mine[0]} here"
        else:
            pairs = list(zip(theirs[1], mine[1]))
            i = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
            a = theirs[1][i] if i < len(theirs[1]) else "nothing"
            b = mine[1][i] if i < len(mine[1]) else "nothing"
            diff = f"parameter #{i}: rank {r} has {a}, rank {dist.get_rank()} has {b}"
        raise ValueError(
            f"zeroshard: unit '{unit_name}' has a different layout on different ranks ({diff}). "
            "Fix: build the same model, with the same wrap policy and ignored modules, on every rank."
        )


def check_uniform(entries, use_orig_params: bool, unit_name: str):
    first_name, first = entries[0][2], entries[0][3]
    warned = False
    for _, _, fqn, p in entries[1:]:
        if p.dtype != first.dtype:
            raise ValueError(
                f"zeroshard: unit '{unit_name}' mixes parameter dtypes ({first_name}: {first.dtype}, "
                f"{fqn}: {p.dtype}); one FlatParameter holds one dtype. Fix: cast the module to one dtype, "
                f"or wrap the {p.dtype} parameters in their own unit (auto_wrap_policy / nested FSDP)."
            )
        if p.device != first.device:
            raise ValueError(
                f"zeroshard: unit '{unit_name}' has parameters on {first.device} ({first_name}) and "
                f"{p.device} ({fqn}). Fix: move the module to one device before wrapping."
            )
        if use_orig_params and p.requires_grad != first.requires_grad and not warned:
            warned = True  # torch FSDP1 warns too: the flat gradient covers the frozen elements as well
            warnings.warn(
                f"zeroshard: unit '{unit_name}' mixes requires_grad ({first_name}={first.requires_grad}, "
                f"{fqn}={p.requires_grad}); its gradient buffer and reduce-scatter cover all "
                f"{sum(e[3].numel() for e in entries)} elements, frozen ones included. If possible, wrap the "
                "frozen parameters in their own unit.", stacklevel=4)
        if not use_orig_params and p.requires_grad != first.requires_grad:
            raise ValueError(
                f"zeroshard: unit '{unit_name}' mixes requires_grad ({first_name}={first.requires_grad}, "
                f"{fqn}={p.requires_grad}) with use_orig_params=False. Fix: pass use_orig_params=True, "
                f"or wrap frozen and trainable parameters in separate units."
            )


def _check_optimizer_params(optimizer, args, kwargs):
    if getattr(optimizer, "_zeroshard_checked", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            retired = getattr(p, "_zeroshard_retired", None)
            if retired is not None:
                raise RuntimeError(
                    f"zeroshard: {type(optimizer).__name__} holds the original parameter {retired}, which "
                    "FullyShardedDataParallel replaced by its FlatParameter (use_orig_params=False): stepping it "
                    "would train nothing. Fix: build the optimizer after wrapping, from the wrapped model's "
                    "parameters(), or wrap with use_orig_params=True."
                )
    optimizer._zeroshard_checked = True


_optimizer_hook = []


def watch_optimizers():
    """Install (once per process) the check above as a global optimizer step pre-hook."""
    if not _optimizer_hook:
        _optimizer_hook.append(register_optimizer_step_pre_hook(_check_optimizer_params))
