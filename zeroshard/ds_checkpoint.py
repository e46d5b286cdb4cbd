"""DeepSpeed checkpoint directories for the ``Engine`` (``save_checkpoint`` /
``load_checkpoint`` of ``deepspeed/runtime/engine.py``).

Layout of ``save_dir``:

* ``tag/mp_rank_00_model_states.pt`` (rank 0 writes it), DeepSpeed's model
  file: ``module`` (the plain model's FULL state dict), ``lr_scheduler``,
  ``global_steps``, ``global_samples``, ``skipped_steps``, ``dp_world_size``,
  ``mp_world_size``, ``ds_config``; ``optimizer``, torch's optimizer state, at
  stage 0 without a master (DeepSpeed keeps the non-ZeRO optimizer there too,
  else None); the user's ``client_state`` keys at the top level, as DeepSpeed
  merges them; and zeroshard's own entries under ``zeroshard``;
* ``tag/zero_optim_states.ID.pt`` (ID: random per save, named by the model
  file): at the other stages the optimizer state in a world-size independent
  form: FSDP's FULL optimizer state dict at stages 2/3, ZeRO-1's gathered flat
  states at stage 1 and for a stage-0 fp16/bf16 master. DeepSpeed writes each
  rank's partition instead (``zero_pp_rank_R_mp_rank_00_optim_states.pt``);
* ``latest``: the newest tag. A tag names a folder inside ``save_dir``: empty,
  ``latest``, absolute, ``..`` or space-padded tags are refused.

So the two read each other's model files: DeepSpeed loads a zeroshard
checkpoint's weights (``load_module_only=True``, or at stage 0 everything),
and zeroshard loads a DeepSpeed stage 0-2 checkpoint's weights, scheduler and
counters (and at stage 0 its optimizer, unless DeepSpeed's fp16/bf16 optimizer
wrote it: its flattened fp32 masters are refused too); DeepSpeed's partitioned optimizer
states, and a stage-3 checkpoint's partitioned weights, are refused with the
route that works (``load_optimizer_states=False``; DeepSpeed's own
``zero_to_fp32.py``). Checkpoints of earlier zeroshard versions still load.

Every file is written atomically (``checkpoint.save``: temp file, fsync,
rename), the optimizer file first under a new name, then the model file that
names it (the rename that switches the tag to the new save), then ``latest``:
so a save killed half-way leaves the previous checkpoint loadable, under its
own tag or one the new save reuses (the old model file still names the old
optimizer file). Rank 0 writes; its error is raised on every rank. A load
reads and checks the optimizer state before it changes the engine; then the
weights load (at stages 0/1 torch's ``load_state_dict``, which copies the
matching keys before a strict key mismatch raises; at stages 2/3 FSDP's,
which checks every key first).
"""
from __future__ import annotations

import contextlib
import copy
import glob
import os
import re
import warnings

import torch

from . import checkpoint, comm
from .fully_sharded import FullyShardedDataParallel
from .options import StateDictType
from .state_dict import clean_fqn

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_optim_states.pt"  # before optimizer files were named per save (still read)
OWN = "zeroshard"  # zeroshard's own entries in the model file
# DeepSpeed's entries of a model file (its engine's _common_checkpoint_state); the other top-level keys are
# the client_state, which DeepSpeed merges in.
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
    "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info",
    "sparse_tensor_module_names"})
# What a load restores: DeepSpeed's engine does not restore micro_steps, so a
# resumed run counts its accumulation from 0 whatever micro-step it was saved at.
_RESTORED = ("global_steps", "global_samples", "skipped_steps")
_DS_ZERO3_MODEL = "zero_pp_rank_*_mp_rank_*_model_states.pt"
_DS_ZERO_OPTIM = "*zero_pp_rank_*_optim_states.pt"  # bf16_zero_pp_rank_... too


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


def _optimizer_in_model_file(engine) -> bool:
    """Stage 0 without a master: torch's optimizer state goes where DeepSpeed's non-ZeRO engine keeps it."""
    return engine.stage == 0 and engine.zero1 is None


def _bad_tag(tag: str) -> ValueError | None:
    """A tag names a folder inside save_dir, which 'latest' can name back."""
    parts = tag.replace(os.sep, "/").split("/")
    if tag != tag.strip() or tag in ("", ".", "latest") or os.path.isabs(tag) or ".." in parts:
        return ValueError(f"zeroshard save_checkpoint: tag {tag!r} cannot name a checkpoint folder inside save_dir "
                          "(empty, 'latest', absolute, with '..', or with leading or trailing whitespace, which the "
                          "'latest' file loses, as DeepSpeed strips it). Fix: pass a tag such as 'global_step100'.")
    return None


def save(engine, save_dir, tag=None, client_state=None, save_latest: bool = True,
         exclude_frozen_parameters: bool = False) -> bool:
    """``Engine.save_checkpoint`` (collective). At stage 3 every rank's
    ``client_state`` is kept (DeepSpeed writes a model file per rank there), and
    each rank gets its own back; at stages 0-2 rank 0's is the one stored."""
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    client_state = dict(client_state or {})
    clash = sorted(map(str, set(client_state) & (DS_KEYS | {OWN})))
    per_rank = client_state if engine.stage == 3 else None
    seen = comm.gather_objects((tag, clash, per_rank), what="save_checkpoint (comparing the tags)")
    if len({t for t, _, _ in seen}) > 1:
        raise ValueError(f"zeroshard save_checkpoint: ranks passed different tags {[t for t, _, _ in seen]}. Fix: pass "
                         "the same tag on every rank.")
    bad = _bad_tag(tag)
    if bad is not None:  # after the comparison: a tag bad on one rank only is a difference there
        raise bad
    if seen[0][1]:  # rank 0's client_state is the one stored
        raise ValueError(f"zeroshard save_checkpoint: client_state keys {seen[0][1]} are entries of the checkpoint itself "
                         "(client_state is merged into the model file, as DeepSpeed does). Fix: rename them.")
    path = os.path.join(os.fspath(save_dir), tag)
    model_sd, optim_sd = model_state_dict(engine), optimizer_state_dict(engine)  # collectives first, on every rank
    if exclude_frozen_parameters:  # as DeepSpeed's: a later load needs load_module_strict=False
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                model_sd.pop(clean_fqn(name), None)

    def write():
        os.makedirs(path, exist_ok=True)
        in_model_file = _optimizer_in_model_file(engine)
        optim_file = None
        if optim_sd is not None and not in_model_file:
            optim_file = f"zero_optim_states.{os.urandom(6).hex()}.pt"
            checkpoint.save({"optimizer": optim_sd, "format": optim_format(engine), "zero_stage": engine.stage},
                            os.path.join(path, optim_file))
        checkpoint.save({
            "module": model_sd, "optimizer": optim_sd if in_model_file else None,
            "lr_scheduler": engine.lr_scheduler.state_dict() if hasattr(engine.lr_scheduler, "state_dict") else None,
            **{k: getattr(engine, k) for k in _RESTORED}, "dp_world_size": engine.world_size, "mp_world_size": 1,
            "ds_config": engine.config.raw,
            OWN: {"zero_stage": engine.stage, "micro_steps": engine.micro_steps, "optim_file": optim_file,
                  "client_states": [c for _, _, c in seen] if per_rank is not None else None,
                  "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None},
            **client_state,
        }, os.path.join(path, MODEL_FILE))
        for old in glob.glob(os.path.join(glob.escape(path), "zero_optim_states*.pt")):
            if os.path.basename(old) != optim_file:  # the previous save's, or a killed one's
                os.remove(old)
        # a killed save's temporary optimizer file: its name is random, so no later save writes the same path
        checkpoint.remove_stale(path, ".zero_optim_states.*.tmp", _optim_tmp_prefix)
        if save_latest:
            checkpoint.write_atomic(os.path.join(os.fspath(save_dir), "latest"), lambda f: f.write(tag.encode()))

    checkpoint.on_rank0(write, "save_checkpoint (rank 0 writing the files)")
    return True


def _optim_tmp_prefix(name: str) -> str | None:
    found = re.match(r"\.zero_optim_states\.[0-9a-f]{12}\.pt\.", name)
    return found.group(0) if found else None


def save_16bit(engine, save_dir, save_filename: str) -> bool:
    """``Engine.save_16bit_model`` (collective): rank 0 writes the full state dict atomically."""
    dtype = engine.config.low_precision_dtype
    sd = model_state_dict(engine)

    def write():
        low = {k: v.to(dtype) if dtype is not None and torch.is_tensor(v) and v.is_floating_point() else v
               for k, v in sd.items()}
        os.makedirs(os.fspath(save_dir), exist_ok=True)
        checkpoint.save(low, os.path.join(os.fspath(save_dir), save_filename))

    checkpoint.on_rank0(write, "save_16bit_model (rank 0 writing the file)")
    return True


def _no_model_file(load_dir: str, tag: str) -> ValueError:
    folder = os.path.join(load_dir, tag)
    if glob.glob(os.path.join(glob.escape(folder), _DS_ZERO3_MODEL)):
        return ValueError(f"zeroshard load_checkpoint: {folder} is a DeepSpeed ZeRO-3 checkpoint, whose weights are "
                          "partitioned in DeepSpeed's own format. Fix: run the zero_to_fp32.py script DeepSpeed saved in "
                          f"{load_dir} to write a full state dict, and load that into the model before zeroshard.initialize.")
    tags = sorted(t for t in os.listdir(load_dir) if os.path.isfile(os.path.join(load_dir, t, MODEL_FILE))) \
        if os.path.isdir(load_dir) else []
    return ValueError(f"zeroshard load_checkpoint: no checkpoint with tag '{tag}' in {load_dir} (no {MODEL_FILE}); "
                      f"tags there: {tags}. Fix: pass one of them, or tag=None for the one 'latest' names.")


def _read_optimizer(engine, ckpt: dict, folder: str, by_deepspeed: bool):
    """The saved optimizer state, checked to be in the form this engine steps."""
    named = ckpt.get(OWN, {}).get("optim_file")
    optim_file = os.path.join(folder, named or OPTIM_FILE)  # the one this save wrote
    if ckpt.get("optimizer") is not None:  # stage 0's, in the model file (zeroshard or DeepSpeed)
        form, osd = "torch", ckpt["optimizer"]
        if by_deepspeed and not (isinstance(osd, dict) and "param_groups" in osd):
            raise ValueError(f"zeroshard load_checkpoint: the optimizer state in {folder} is DeepSpeed's fp16/bf16 "
                             "optimizer's (its fp32 master weights flattened per param group), not a torch optimizer's, "
                             "which zeroshard cannot map onto its parameters. Fix: load_optimizer_states=False to "
                             "load the weights, LR scheduler and counters.")
    elif named is not None and not os.path.isfile(optim_file):
        raise ValueError(f"zeroshard load_checkpoint: {folder} is missing {named}, the optimizer file its model file "
                         "names (deleted or not copied with it?). Fix: copy the whole tag folder, or "
                         "load_optimizer_states=False to load the weights without the optimizer state.")
    elif os.path.isfile(optim_file):
        optim = checkpoint.load(optim_file, weights_only=False)
        form, osd = optim["format"], optim["optimizer"]
    elif by_deepspeed and glob.glob(os.path.join(glob.escape(folder), _DS_ZERO_OPTIM)):
        raise ValueError(f"zeroshard load_checkpoint: the optimizer state in {folder} is DeepSpeed's ZeRO partitions "
                         "(one file per rank, in DeepSpeed's layout), which zeroshard cannot read. Fix: "
                         "load_optimizer_states=False to load the weights, LR scheduler and counters.")
    else:
        raise ValueError(f"zeroshard load_checkpoint: {folder} holds no optimizer state. Fix: load_optimizer_states=False.")
    if form != optim_format(engine):
        raise ValueError(f"zeroshard load_checkpoint: the optimizer state in {folder} is in the '{form}' form, this "
                         f"engine needs '{optim_format(engine)}' (stage {engine.stage}, "
                         f"{engine.config.low_precision_dtype or 'fp32'}). Fix: load_optimizer_states=False (weights "
                         "only), or the stage and precision of the save.")
    _check_same_kind(engine.optimizer, osd["param_groups"], folder)
    return osd


def load(engine, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """``Engine.load_checkpoint``: ``(load_path, client_state)``; ``(None, None)``
    with a warning if ``tag`` is None and no ``latest`` file names one (as in
    DeepSpeed), a ``ValueError`` if the tag has no checkpoint. The optimizer
    state is read and checked before the engine is changed (for the weights,
    see the module docstring)."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if os.path.isfile(latest):
            with open(latest) as f:
                tag = f.read().strip()
    folder = os.path.join(load_dir, str(tag))
    path = os.path.join(folder, MODEL_FILE)
    # Every rank must load the same checkpoint: one that finds none (node-local disks, a path
    # wrong on one rank) would train on with other weights, or hang the others' collectives.
    found = None if tag is None else (str(tag), os.path.isfile(path))
    differs = comm.first_difference(found, what="load_checkpoint (comparing the checkpoint each rank found)")
    if differs is not None:
        def said(f):
            return "found no 'latest' file" if f is None else f"resolved tag '{f[0]}' ({'found' if f[1] else 'no'} model file)"
        raise RuntimeError(f"zeroshard load_checkpoint: ranks found different checkpoints in {load_dir}: rank 0 "
                           f"{said(differs[1])}, rank {differs[0]} {said(differs[2])}. Fix: put the checkpoint (and its "
                           "'latest' file) at the same path on every rank (shared storage), or pass the same tag.")
    if tag is None:
        warnings.warn(f"zeroshard load_checkpoint: no 'latest' file in {load_dir} and no tag given; nothing loaded.")
        return None, None
    if not found[1]:
        raise _no_model_file(load_dir, str(tag))
    # Read and checked on every rank before any collective: a file bad on one rank's copy
    # (node-local disks) is named on every rank instead of failing the others' next collective.
    try:
        ckpt, client, osd, scaler = _read(engine, path, folder, load_optimizer_states, load_module_only,
                                          load_lr_scheduler_states)
        problem = None
    except Exception as e:  # noqa: BLE001 - re-raised below, and told to the other ranks
        problem, error = f"{type(e).__name__}: {e}", e
    bad = comm.first_problem(problem, what="load_checkpoint (reading the checkpoint files)")
    if bad is not None:
        if problem is not None:
            raise error
        raise RuntimeError(f"zeroshard load_checkpoint: rank {bad[0]} could not read the checkpoint in {folder}: "
                           f"{bad[1]}")
    # Checks first: nothing below may fail once the weights are loaded.
    if engine.zero1 is not None and osd is not None:
        engine.zero1.check_state_dict(osd)
    elif osd is not None:
        if engine.stage >= 2:
            with _full_state(engine):
                osd = FullyShardedDataParallel.optim_state_dict_to_load(engine.wrapped, engine.optimizer, osd)
        _check_groups(engine.optimizer, osd, folder)
    with _full_state(engine):
        engine.module.load_state_dict(ckpt["module"], strict=load_module_strict)
        if osd is not None and engine.zero1 is None:
            engine.optimizer.load_state_dict(osd)
    if engine.zero1 is not None and osd is not None:
        engine.zero1.load_state_dict(osd)
    elif engine.zero1 is not None:  # the fp32 master follows the loaded weights
        engine.zero1.sync_master_from_params()
    if not load_module_only:
        if load_lr_scheduler_states and ckpt.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        changed = engine.loss_scaler.resume(scaler) if scaler is not None else []
        if changed:
            warnings.warn(f"zeroshard load_checkpoint: {', '.join(changed)} differ from the checkpoint's in {folder}; "
                          "the fp16 loss scaler resumes its scale and step count under this config's values "
                          "(DeepSpeed would keep the saved ones). Fix: nothing if the change is meant.", stacklevel=3)
        engine.global_steps, engine.skipped_steps = ckpt["global_steps"], ckpt["skipped_steps"]
        engine.global_samples = ckpt.get("global_samples", engine.global_steps * engine.train_batch_size())
    return path, client


def _read(engine, path: str, folder: str, load_optimizer_states: bool, load_module_only: bool,
          load_lr_scheduler_states: bool):
    """This rank's model file, client_state, optimizer state and loss-scaler state to load."""
    ckpt = checkpoint.load(path, weights_only=False)
    need = ("module",) if load_module_only else ("module", "global_steps", "skipped_steps")
    missing = [k for k in need if k not in ckpt] if isinstance(ckpt, dict) else None
    if missing != []:  # read after the weights load: a KeyError there left them loaded
        held = f"a {type(ckpt).__name__}" if missing is None else f"a dict without {', '.join(map(repr, missing))}"
        raise ValueError(f"zeroshard load_checkpoint: {path} holds {held}, not a model file (zeroshard's and "
                         f"DeepSpeed's are dicts with {', '.join(map(repr, need))}): another file under that name, or "
                         "one edited by hand? Fix: copy the tag folder again from where it was saved.")
    legacy = OWN not in ckpt and "client_state" in ckpt and "zero_stage" in ckpt  # zeroshard before DeepSpeed's layout
    by_deepspeed = OWN not in ckpt and not legacy
    if legacy:
        own, client = {"loss_scaler": ckpt["loss_scaler"]}, ckpt["client_state"]
    else:
        own, client = ckpt.get(OWN, {}), {k: v for k, v in ckpt.items() if k not in DS_KEYS and k != OWN}
        per_rank = own.get("client_states")
        if per_rank is not None and len(per_rank) == engine.world_size:  # a stage-3 save: this rank's own
            client = per_rank[engine.global_rank]
    osd = None
    if load_optimizer_states and not load_module_only and engine.optimizer is not None:
        osd = _read_optimizer(engine, ckpt, folder, by_deepspeed)
    scaler = None if load_module_only else _scaler_state(engine, own.get("loss_scaler"), folder)
    if load_lr_scheduler_states and not load_module_only and ckpt.get("lr_scheduler") is not None:
        _check_scheduler(engine.lr_scheduler, ckpt["lr_scheduler"], folder)
    return ckpt, client, osd, scaler


def _check_scheduler(scheduler, saved: dict, folder: str) -> None:
    """Another scheduler's state (WarmupLR's into a LambdaLR) raised from its load_state_dict after
    the weights had loaded: tried first on a copy, all but its optimizer (a shallow one shares
    SequentialLR's child schedulers and LambdaLR's callable objects, which the trial would load)."""
    if scheduler is None or not hasattr(scheduler, "load_state_dict"):
        return
    optimizer = getattr(scheduler, "optimizer", None)
    try:
        trial = copy.deepcopy(scheduler, {id(optimizer): optimizer})
    except Exception:  # noqa: BLE001 - a scheduler that cannot be copied: its own load decides
        return
    try:
        trial.load_state_dict(copy.deepcopy(saved))  # LambdaLR's load pops from the dict it is given
    except Exception as e:  # noqa: BLE001 - named below, and told to the other ranks
        raise ValueError(f"zeroshard load_checkpoint: the LR scheduler state in {folder} does not load into this engine's "
                         f"{type(scheduler).__name__} ({type(e).__name__}: {e}): saved by another scheduler? Fix: "
                         "configure the scheduler used when saving, or load_lr_scheduler_states=False.") from e


def _scaler_state(engine, saved: dict | None, folder: str) -> dict | None:
    """The fp16 loss-scaler state to resume, decided before anything loads: a dynamic scaler
    takes a dynamic one's position (scale, step count, hysteresis left) and keeps the config's
    settings (window, floor, hysteresis), with a warning naming those the config changed; a
    static scale is the config's. A scaler whose kind or static scale the config changed since
    the save (a static scale chosen after a diverging run) starts as configured, with a
    warning; loading the other kind's state crashed half-way or gave a static scaler the
    dynamic scale. (DeepSpeed takes the saved scaler whole, so a config changed after its
    "lower min_loss_scale" error did nothing on resume.)"""
    mine = engine.loss_scaler
    if saved is None or mine is None:
        return None
    was_dynamic = "cur_iter" in saved
    if was_dynamic and mine.dynamic:
        return saved
    if was_dynamic or mine.dynamic or saved["cur_scale"] != mine.cur_scale:
        def kind(dynamic, scale):
            return "dynamic" if dynamic else f"static ({scale:g})"
        warnings.warn(f"zeroshard load_checkpoint: the checkpoint in {folder} was saved with a "
                      f"{kind(was_dynamic, saved['cur_scale'])} fp16 loss scale, this engine's config asks for a "
                      f"{kind(mine.dynamic, mine.cur_scale)} one, which it keeps (the saved scaler state is not "
                      "loaded). Fix: nothing if the change is meant; else set fp16.loss_scale as when saving.",
                      stacklevel=5)
    return None


def _check_same_kind(optimizer, saved_groups: list, folder: str) -> None:
    """Another optimizer's state (SGD's into AdamW) failed half-way, after the weights had loaded
    (AdamW: a KeyError 'step'), or at the first step (SGD: 'momentum' missing from the groups that
    load_state_dict took from the file). Refused when the saved groups, filled in as this
    optimizer's load_state_dict fills them (its __setstate__ defaults keys that older torch
    versions did not save), lack one of this optimizer's defaults: not any key of its groups, as
    an LR scheduler's 'initial_lr' or a user's own keys, which load_state_dict drops. (ZeRO-1's
    groups are saved without their parameters.)"""
    try:
        probe = object.__new__(type(optimizer))
        probe.defaults = dict(optimizer.defaults)
        type(optimizer).__setstate__(probe, {"state": {}, "param_groups": [{"params": [], **g} for g in saved_groups]})
        loaded = probe.param_groups
    except Exception:  # noqa: BLE001 - an optimizer whose __setstate__ needs more: torch's load decides
        return
    for i, theirs in enumerate(loaded):
        missing = sorted(set(optimizer.defaults) - set(theirs))
        if missing:
            raise ValueError(f"zeroshard load_checkpoint: the optimizer state in {folder} lacks {missing} in param group "
                             f"{i}, which this engine's {type(optimizer).__name__} needs: it was saved by another "
                             "optimizer. Fix: configure the optimizer used when saving, or load_optimizer_states=False "
                             "(weights, LR scheduler and counters only).")


def _check_groups(optimizer, osd: dict, folder: str) -> None:
    """torch's optimizer.load_state_dict check, made before the weights are loaded."""
    saved, own = [len(g["params"]) for g in osd["param_groups"]], [len(g["params"]) for g in optimizer.param_groups]
    if saved != own:
        raise ValueError(f"zeroshard load_checkpoint: the optimizer state in {folder} has param groups of {saved} "
                         f"parameters, this engine's optimizer {own}. Fix: build the optimizer with the param groups "
                         "used when saving, or load_optimizer_states=False.")
