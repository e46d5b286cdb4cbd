"""DeepSpeed-style checkpoint directories for the ``Engine`` (``save_checkpoint``
/ ``load_checkpoint`` of ``deepspeed/runtime/engine.py``).

Layout of ``save_dir``:

* ``tag/mp_rank_00_model_states.pt``: the plain model's FULL state dict,
  counters, LR scheduler, loss scaler and rank 0's ``client_state`` (rank 0
  writes it);
* ``tag/zero_optim_states.pt``: the optimizer state in a world-size
  independent form: FSDP's FULL optimizer state dict at stages 2/3, ZeRO-1's
  gathered flat states at stage 1, torch's own at stage 0;
* ``latest``: the newest tag.

Every file is written atomically (``checkpoint.save``: temp file, fsync,
rename), and ``latest`` names a tag only after every file of it is complete,
so a save killed half-way leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import contextlib
import os
import warnings

from . import checkpoint, comm
from .fully_sharded import FullyShardedDataParallel
from .options import StateDictType

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_optim_states.pt"
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
# What a load restores: DeepSpeed's engine does not restore micro_steps, so a
# resumed run counts its accumulation from 0 whatever micro-step it was saved at.
_RESTORED = ("global_steps", "global_samples", "skipped_steps")


def _full_state(engine):
    """FULL model and optimizer state dicts whatever state_dict_type the user set on the FSDP model."""
    if engine.stage < 2:
        return contextlib.nullcontext()
    return FullyShardedDataParallel.state_dict_type(engine.wrapped, StateDictType.FULL_STATE_DICT)


def model_state_dict(engine) -> dict:
    """The plain model's full state dict (collective at stages 2/3)."""
    with _full_state(engine):
        return engine.module.state_dict()


def optimizer_state_dict(engine):
    """The optimizer state in the form saved (collective at stages 1-3), or None without an optimizer."""
    if engine.zero1 is not None:
        return engine.zero1.state_dict()
    if engine.optimizer is None:
        return None
    if engine.stage < 2:
        return engine.optimizer.state_dict()
    with _full_state(engine):
        return FullyShardedDataParallel.optim_state_dict(engine.wrapped, engine.optimizer)


def optim_format(engine) -> str:
    return "zero1 flat master" if engine.zero1 is not None else "fsdp full" if engine.stage >= 2 else "torch"


def save(engine, save_dir, tag=None, client_state=None, save_latest: bool = True) -> bool:
    """``Engine.save_checkpoint`` (collective)."""
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    tags = comm.gather_objects(tag, what="save_checkpoint (comparing the tags)")
    if len(set(tags)) > 1:
        raise ValueError(f"zeroshard save_checkpoint: ranks passed different tags {tags}. Fix: pass the same tag on every rank.")
    path = os.path.join(os.fspath(save_dir), tag)
    model_sd, optim_sd = model_state_dict(engine), optimizer_state_dict(engine)  # collectives first, on every rank
    if engine.global_rank == 0:
        os.makedirs(path, exist_ok=True)
        checkpoint.save({
            "module": model_sd, "client_state": dict(client_state or {}), **{k: getattr(engine, k) for k in _COUNTERS},
            "lr_scheduler": engine.lr_scheduler.state_dict() if hasattr(engine.lr_scheduler, "state_dict") else None,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "zero_stage": engine.stage, "world_size": engine.world_size, "ds_config": engine.config.raw,
        }, os.path.join(path, MODEL_FILE))
        if optim_sd is not None:
            checkpoint.save({"optimizer": optim_sd, "format": optim_format(engine), "zero_stage": engine.stage},
                            os.path.join(path, OPTIM_FILE))
    comm.barrier(what="save_checkpoint (rank 0 writing the files)")  # every file is complete before 'latest' names the tag
    if save_latest and engine.global_rank == 0:
        tmp = os.path.join(os.fspath(save_dir), f".latest.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(os.fspath(save_dir), "latest"))  # atomic, like checkpoint.save
    comm.barrier(what="save_checkpoint (rank 0 writing 'latest')")
    return True


def load(engine, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """``Engine.load_checkpoint``: ``(load_path, client_state)``, or ``(None, None)``
    with a warning if there is no checkpoint. Everything is read and checked
    before the engine is changed."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            warnings.warn(f"zeroshard load_checkpoint: no 'latest' file in {load_dir} and no tag given; nothing loaded.")
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag), MODEL_FILE)
    if not os.path.isfile(path):
        warnings.warn(f"zeroshard load_checkpoint: {path} does not exist; nothing loaded.")
        return None, None
    ckpt = checkpoint.load(path, weights_only=False)
    optim = None
    if load_optimizer_states and not load_module_only and engine.optimizer is not None:
        optim = checkpoint.load(os.path.join(load_dir, str(tag), OPTIM_FILE), weights_only=False)
        if optim["format"] != optim_format(engine):
            raise ValueError(f"zeroshard load_checkpoint: the optimizer state in {load_dir}/{tag} is in the "
                             f"'{optim['format']}' form (ZeRO stage {optim['zero_stage']}), this engine needs "
                             f"'{optim_format(engine)}' (stage {engine.stage}, {engine.config.low_precision_dtype or 'fp32'}). "
                             "Fix: load_optimizer_states=False (weights only), or the stage and precision of the save.")
    with _full_state(engine):
        engine.module.load_state_dict(ckpt["module"], strict=load_module_strict)
        if optim is not None and engine.zero1 is None:
            osd = optim["optimizer"]
            if engine.stage >= 2:
                osd = FullyShardedDataParallel.optim_state_dict_to_load(engine.wrapped, engine.optimizer, osd)
            engine.optimizer.load_state_dict(osd)
    if engine.zero1 is not None and optim is not None:
        engine.zero1.load_state_dict(optim["optimizer"])
    elif engine.zero1 is not None:  # the fp32 master follows the loaded weights
        engine.zero1.sync_master_from_params()
    if not load_module_only:
        if load_lr_scheduler_states and ckpt["lr_scheduler"] is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        if ckpt["loss_scaler"] is not None and engine.loss_scaler is not None:
            engine.loss_scaler.load_state_dict(ckpt["loss_scaler"])
        for k in _RESTORED:
            setattr(engine, k, ckpt[k])
    return path, ckpt["client_state"]
