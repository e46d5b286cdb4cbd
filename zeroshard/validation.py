"""Checks a unit passes before it is sharded: its ignored states, its compute
device, parameters no other unit owns, one dtype, one device, uniform
requires_grad (without use_orig_params); and, at an optimizer's first step,
that it was not built over parameters the FlatParameters replaced; at every
step, that no sharded unit's gradient is still the unreduced, unsharded one
``no_sync`` accumulates. (Checks that compare ranks: ``agreement``.)

A FlatParameter is one tensor, so its parameters must agree on dtype and
device.
"""
from __future__ import annotations

import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import groups
from .flat_param import FlatParameter


def check_uniform(entries, use_orig_params: bool, unit_name: str):
    for _, _, fqn, p in entries:
        if p.dim() == 0:  # torch FSDP1 refuses them too (its optimizer-state mapping assumes >= 1 dim)
            raise ValueError(
                f"zeroshard: unit '{unit_name}' has the scalar (0-dim) parameter '{fqn}'; FSDP does not support "
                "scalar parameters. Fix: make it a 1-D tensor with one element (nn.Parameter(torch.tensor([v]))), "
                "or keep it out of sharding with ignored_states.")
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


_unreduced = weakref.WeakSet()  # sharded units whose gradient no_sync accumulated and no backward reduced yet


def note_unreduced(handle, unreduced: bool) -> None:
    (_unreduced.add if unreduced else _unreduced.discard)(handle)


def _check_no_unreduced(optimizer):
    """Inside ``no_sync`` a sharded unit's gradient stays full-size and
    unreduced; a step then fails on a size mismatch deep in the optimizer
    (torch FSDP1 too), or, where the unit did not run in the synchronizing
    micro-batch, torch asserts. A NO_SHARD unit's gradient has the right shape
    but differs by rank: a step makes the replicas diverge silently (torch
    FSDP1 too). Name the unit and the fix instead."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for h in list(_unreduced):
        params = h.orig_params if h.use_orig_params else [h.flat_param]
        if all(p.grad is None for p in params):
            _unreduced.discard(h)  # discarded (zero_grad)
            continue
        bad = next((p for p in params if id(p) in mine and p.grad is not None
                    and (not h.sharded or p.grad.shape != p.shape)), None)
        if bad is not None:
            raise RuntimeError(
                f"zeroshard: {type(optimizer).__name__}.step() on unit '{h.unit_name}', whose gradient was accumulated "
                f"inside no_sync() and not yet reduced across ranks (gradient shape {tuple(bad.grad.shape)}, parameter "
                f"shape {tuple(bad.shape)}). Fix: run the last micro-batch's forward and backward outside no_sync() "
                "(that backward reduces the accumulated gradient of every unit it runs through: a unit it skips "
                "keeps its gradient unreduced) before stepping, or zero_grad() to discard it.")


optimizer_steps = [0]  # optimizer.step() calls in this process (any optimizer): see kept.drop_stale_kept


def _check_optimizer_params(optimizer, args, kwargs):
    optimizer_steps[0] += 1
    if _unreduced:
        _check_no_unreduced(optimizer)
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


def check_unowned(entries, unit: str):
    """No parameter may belong to two units (or be a FlatParameter already)."""
    for _, _, fqn, p in entries:
        if isinstance(p, FlatParameter):  # the inner module of a unit, reached under a second name
            where = fqn.rpartition(".")[0] or "the root module"
            raise ValueError(
                f"zeroshard: module '{where}' inside unit '{unit}' is already the module of another unit (it holds that "
                "unit's FlatParameter): the module was wrapped twice, or it is registered under two names and the "
                "wrapping policy wrapped it under the other name only. Fix: wrap each module once (use the unit the "
                "first FullyShardedDataParallel(...) returned), register the module once (call it twice in forward), "
                "or leave it out of auto_wrap_policy."
            )
        if hasattr(p, "_zeroshard_unit"):
            owner = p._zeroshard_unit
            raise ValueError(
                f"zeroshard: parameter '{fqn}' of unit '{unit}' is already managed by unit '{owner}' "
                "(a parameter shared across two units, or a module wrapped twice). Fix: put every module that "
                "uses a shared parameter inside one unit (e.g. wrap their common parent), and wrap each module once."
            )


def compute_device(module: nn.Module, device_id, group) -> torch.device:
    """Where the unit computes: ``device_id``, else the one device its tensors are on (meta excluded)."""
    devices = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
    devices.discard(torch.device("meta"))  # materialized on the compute device (see materialize)
    if device_id is not None:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if device.type == "meta":
            raise ValueError("zeroshard: device_id=meta: a unit cannot compute on the meta device (it holds no values). "
                             'Fix: pass the device to materialize on, e.g. device_id=torch.device("cpu") or the GPU\'s '
                             "index, and param_init_fn= to initialize the meta-built module there.")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"zeroshard: device_id={device} but CUDA is not available on this machine. "
                'Fix: pass device_id=torch.device("cpu") (gloo) or run where a GPU is visible.'
            )
        for d in devices:
            if d.type != "cpu" and d != device:
                raise ValueError(
                    f"zeroshard: the module has parameters on {d} but device_id={device}. "
                    "Fix: move the module to device_id (or to CPU) before wrapping."
                )
        if device.type != "cpu" and any(d.type == "cpu" for d in devices):
            module.to(device)
    elif len(devices) > 1:
        raise ValueError(f"zeroshard: the module's parameters are on several devices {sorted(map(str, devices))}. Fix: move it to one device.")
    else:
        device = next(iter(devices), torch.device("cpu"))
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"zeroshard: the process group uses NCCL but the module is on {device}. "
            "Fix: pass device_id=torch.cuda.current_device() or move the module to its GPU."
        )
    return device


def split_ignored(ignored_modules, ignored_states, module, is_unit):
    """torch FSDP1's ``ignored_states``: modules (as ``ignored_modules``) or
    parameters (kept out of every FlatParameter: replicated, not reduced)."""
    if isinstance(ignored_modules, nn.Module) and not hasattr(ignored_modules, "__iter__"):  # (a ModuleList iterates)
        raise ValueError(f"zeroshard: FullyShardedDataParallel({type(module).__name__}): ignored_modules takes a list "
                         f"of modules, got one {type(ignored_modules).__name__}. Fix: ignored_modules=[module].")
    ignored_modules, ignored_params = _split_ignored(ignored_modules, ignored_states, module)
    if any(m is module for m in ignored_modules or ()):  # torch accepts it: no unit reduces anything, replicas drift
        raise ValueError(f"zeroshard: FullyShardedDataParallel({type(module).__name__}): ignored_modules holds the wrapped "
                         "module itself, so no parameter would be sharded or have its gradient reduced (the ranks would "
                         "train apart, silently). Fix: ignore submodules only, or do not wrap the model.")
    if any(is_unit(m) for m in ignored_modules or ()):  # torch FSDP1's rule, with the fix
        raise ValueError(f"zeroshard: FullyShardedDataParallel({type(module).__name__}): ignored_modules should not "
                         "include FSDP modules (the unit would be sharded anyway). Fix: ignore the module it wraps "
                         "before wrapping it, or do not wrap it.")
    return ignored_modules, ignored_params


def _split_ignored(ignored_modules, ignored_states, module):
    if ignored_states is None:
        others = sorted({type(m).__name__ for m in ignored_modules or () if not isinstance(m, nn.Module)})
        if others:  # torch's check too; a Parameter here is the likely slip (it belongs in ignored_states)
            raise ValueError(f"zeroshard: FullyShardedDataParallel({type(module).__name__}): ignored_modules takes "
                             f"nn.Modules, got {others}. Fix: pass parameters as ignored_states=[...] instead.")
        return ignored_modules, frozenset()
    if ignored_modules is not None:
        raise ValueError(f"zeroshard: FullyShardedDataParallel({type(module).__name__}): pass ignored_modules or "
                         "ignored_states, not both. Fix: put the modules in ignored_states (or use ignored_modules alone).")
    one = "parameter" if isinstance(ignored_states, torch.Tensor) else "module" if (  # list() would give a tensor's rows
        isinstance(ignored_states, nn.Module) and not hasattr(type(ignored_states), "__iter__")) else None
    if one is not None:
        raise ValueError(f"zeroshard: FullyShardedDataParallel({type(module).__name__}): ignored_states takes a list of "
                         f"parameters or modules, got a single {one}. Fix: ignored_states=[{one}].")
    states = list(ignored_states)
    if all(isinstance(s, nn.Module) for s in states):
        return states, frozenset()
    if all(isinstance(s, nn.Parameter) for s in states):
        return None, frozenset(states)
    raise ValueError(f"zeroshard: FullyShardedDataParallel({type(module).__name__}): ignored_states must be all "
                     f"nn.Parameters or all nn.Modules, got {sorted({type(s).__name__ for s in states})}. "
                     "Fix: split them, passing one kind.")


def check_new_root(states) -> None:
    """At the root's first forward (``states``: its units, itself first): no
    inner unit is a root already, the units agree on what must be shared, and
    each hybrid unit's (shard, replicate) groups form a grid."""
    for s in states[1:]:
        if s._is_root:
            raise RuntimeError(
                f"zeroshard: the inner unit wrapping {type(s.module).__name__} already became a root: its forward, "
                "state_dict, load_state_dict, register_comm_hook, no_sync, check_is_root or "
                "fsdp_modules(root_only=True) was called on it directly, before the outer model's first forward. "
                "Fix: make those calls on the outermost FullyShardedDataParallel.")
    check_homogeneous(states)
    warn_if_nothing_quantized(states)
    for shard, replicate in dict.fromkeys((s.process_group, s._replicate_group) for s in states):
        if replicate is not None:  # once per pair (auto-wrapped units share the root's)
            groups.check_grid(shard, replicate)


def refuse_unmanaged_parameters(states) -> None:
    """A parameter registered in the model after wrapping (``model.head = nn.Linear(...)``, on the
    wrapper or inside it) belongs to no unit: never sharded nor reduced, each rank trains its own copy
    and the replicas drift apart, silently (as under torch FSDP1); one on the wrapper is not even
    called. Refused at the root's first forward outside summon_full_params (whose stand-in
    parameters are the units' own), naming it. An ignored parameter replaced where it was (a meta
    one filled in after wrapping) stays ignored."""
    managed, slots = set(), set()
    for s in states:
        h = s._handle
        slots |= s._ignored_slots
        managed.update(id(p) for p in s._ignored_params)
        managed.update(id(p) for m in s._ignored_modules for p in m.parameters(recurse=False))
        if h is not None:
            managed.add(id(h.flat_param))
            managed.update(id(p) for p in (h.orig_params if h.use_orig_params else ()))
    for prefix, m in states[0].named_modules():
        for name, p in m._parameters.items():
            if p is None or id(p) in managed or (id(m), name) in slots:
                continue
            where = f"{prefix}.{name}" if prefix else name
            raise ValueError(
                f"zeroshard: parameter '{where.replace('_fsdp_wrapped_module.', '')}' belongs to no "
                "FullyShardedDataParallel unit: it was added to the model after wrapping, so it would be neither "
                "sharded nor reduced (each rank would train its own copy; one set on the wrapper is not even "
                "called). Fix: add it to the module before wrapping, wrap the new module in a "
                "FullyShardedDataParallel of its own before assigning it, or pass it in ignored_states at construction.")


def refuse_torch_fsdp_inside(module: nn.Module) -> None:
    """A torch FSDP1 (or FSDP2) module inside: its FlatParameter (or DTensor
    shards) would be sharded again as if they were plain parameters, and the
    model trains on wrong values (0.15 off after two steps, silently)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as TorchFSDP
    for name, m in module.named_modules():
        if isinstance(m, (TorchFSDP, FSDPModule)):
            raise ValueError(f"zeroshard: FullyShardedDataParallel({type(module).__name__}): "
                             f"{name or 'the module itself'} is already wrapped by torch's {type(m).__name__}. Fix: wrap the "
                             "plain model with zeroshard only (unwrap it, or let zeroshard's auto_wrap_policy make the units).")


def check_option_types(cpu_offload, mixed_precision, device_id) -> None:
    """The config objects by what they hold (torch's own classes pass too), so a
    bool or a dict is named here instead of failing as an AttributeError later."""
    if cpu_offload is not None and not hasattr(cpu_offload, "offload_params"):
        raise ValueError(f"zeroshard: cpu_offload={cpu_offload!r} is not a CPUOffload. "
                         "Fix: pass cpu_offload=CPUOffload(offload_params=True) (or leave it None).")
    if mixed_precision is not None and not hasattr(mixed_precision, "param_dtype"):
        raise ValueError(f"zeroshard: mixed_precision={mixed_precision!r} is not a MixedPrecision. "
                         "Fix: pass mixed_precision=MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=...).")
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):  # else a raw error at the first backward, or
        value = getattr(mixed_precision, field, None)             # buffers truncated to ints, silently
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise ValueError(f"zeroshard: MixedPrecision({field}={value!r}) is not a floating-point torch.dtype. "
                             f"Fix: pass e.g. {field}=torch.bfloat16 (or None for the parameters' own dtype).")
    if device_id is not None and (isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device))):
        raise ValueError(f"zeroshard: device_id={device_id!r} ({type(device_id).__name__}) is not a device. "
                         'Fix: pass an int (a CUDA index) or a torch.device, e.g. device_id=torch.device("cpu").')


def check_extensions(bucket_cap_mb, param_persistence_threshold, quantized_all_gather, hpz_group_size):
    """The keywords beyond torch FSDP (see bucket, quantize, hpz): checked at
    construction, so a bad value never reaches the first forward."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    problems = [
        (bucket_cap_mb is not None and not (number(bucket_cap_mb) and bucket_cap_mb > 0),
         f"bucket_cap_mb={bucket_cap_mb!r} must be a positive number of MiB", "pass e.g. 25, or None for no buckets"),
        (param_persistence_threshold is not None and not (number(param_persistence_threshold) and param_persistence_threshold >= 0),
         f"param_persistence_threshold={param_persistence_threshold!r} must be a number of elements >= 0",
         "pass e.g. 100_000, or None to shard every unit"),
        (quantized_all_gather is not None and (isinstance(quantized_all_gather, type) or not all(
            callable(getattr(quantized_all_gather, m, None)) for m in ("quantize", "dequantize"))),
         f"quantized_all_gather={quantized_all_gather!r} is not a quantizer (an instance)",
         "pass zeroshard.quantize.Int8BlockQuant() (called), or None"),
        (hpz_group_size is not None and not (isinstance(hpz_group_size, int) and not isinstance(hpz_group_size, bool) and hpz_group_size >= 1),
         f"hpz_group_size={hpz_group_size!r} must be a positive number of ranks", "pass a divisor of the world size, or None"),
    ]
    for bad, what, fix in problems:
        if bad:
            raise ValueError(f"zeroshard: FullyShardedDataParallel: {what}. Fix: {fix}.")


def check_homogeneous(states):
    """Units under one root share one runtime, so (as torch FSDP1 requires at
    the first forward) they must agree on ``use_orig_params``,
    ``limit_all_gathers`` and ``FSDP_USE_FULL_PREC_IN_EVAL`` (read at wrap
    time); and on ``bucket_cap_mb``, whose buckets span units."""
    for attr, name in (("use_orig_params", "use_orig_params"), ("limit_all_gathers", "limit_all_gathers"),
                       ("_use_full_prec_in_eval", "the FSDP_USE_FULL_PREC_IN_EVAL environment variable"),
                       ("bucket_cap_mb", "bucket_cap_mb")):
        values = {getattr(s, attr) for s in states}
        if len(values) > 1:
            odd = [type(s.module).__name__ for s in states if getattr(s, attr) != getattr(states[0], attr)]
            raise ValueError(f"zeroshard: the units under one root disagree on {name}: the root's is "
                             f"{getattr(states[0], attr)}, units wrapping {', '.join(odd)} differ. Fix: wrap every unit with the same {name} "
                             "(auto_wrap_policy passes the root's settings on).")


def warn_if_nothing_quantized(states) -> None:
    """``quantized_all_gather`` acts on sharded units only (an unsharded one
    all-gathers nothing): say so where it acts on none, instead of training
    unquantized silently."""
    handles = [s._handle for s in states if s._handle is not None]
    if any(s.quantized_all_gather is not None for s in states) and not any(h.quant is not None for h in handles):
        warnings.warn("zeroshard: quantized_all_gather has no effect: no unit of this model is sharded (NO_SHARD, a "
                      "world size of 1, or param_persistence_threshold keeps them all whole) with floating-point "
                      "parameters, so nothing is quantized. Fix: shard the model (FULL_SHARD / SHARD_GRAD_OP / "
                      "HYBRID_SHARD on 2 or more ranks), or drop quantized_all_gather.", stacklevel=4)
        return
    # Each rank's shard is padded to whole blocks: a shard smaller than a block sends more than it saves.
    larger = [h.unit_name for h in handles if h.quant is not None and hasattr(h.quant, "payload_bytes")
              and h.quant.payload_bytes(h.layout.shard_numel) > h.layout.shard_numel * h.compute_dtype.itemsize]
    if larger:
        warnings.warn(f"zeroshard: quantized_all_gather sends more bytes than the plain all-gather for units "
                      f"{', '.join(repr(n) for n in larger[:5])}{' ...' if len(larger) > 5 else ''}: their shards are "
                      "smaller than a block, which is padded to full size. Fix: a smaller block_size, "
                      "param_persistence_threshold for small units, or fewer ranks per shard group.", stacklevel=4)


def refuse_replaced_flat_param(handle) -> None:
    """``torch.func.functional_call`` / ``nn.utils.stateless`` (``use_orig_params=False``)
    given ``..._flat_param`` swaps it on the module, and given the state dict's names
    (``0.weight``) swaps the plain attributes the unit sets; but the unit all-gathers its own
    shard and sets its own views: the given values would be ignored silently (torch FSDP1
    ignores them)."""
    if handle.use_orig_params:
        return
    fix = ("the unit all-gathers its own shard, so those values would be ignored. Fix: call functional_call on the "
           "unwrapped module, or copy the values in (flat_param.data.copy_(...) or inside summon_full_params()).")
    host = handle.flat_param_host
    now = host._parameters.get("_flat_param") if host is not None else None
    if now is not None and now is not handle.flat_param:
        raise RuntimeError(f"zeroshard: the _flat_param of unit '{handle.unit_name}' was replaced by another tensor "
                           f"(torch.func.functional_call or nn.utils.stateless do this); {fix}")
    for view, info in zip(handle.installed_views or (), handle.layout.params):
        now = info.module.__dict__.get(info.name)
        if now is not None and now is not view:  # (None: registered as a Parameter inside summon_full_params)
            raise RuntimeError(f"zeroshard: '{info.fqn}' in unit '{handle.unit_name}' was replaced by a tensor of shape "
                               f"{tuple(now.shape)} (torch.func.functional_call or nn.utils.stateless do this); {fix}")


def refuse_outputs_on_the_freed_buffer(handle, outputs) -> None:
    """A unit returning a view of its own parameter (``self.q.expand(b, -1, -1)``)
    hands out memory its reshard is about to free: the next reader segfaults or
    reads garbage (torch FSDP1 too). Name the unit and the fix instead."""
    buf = handle._full.untyped_storage().data_ptr()
    for t in outputs:
        try:
            shared = t.numel() > 0 and t.untyped_storage().data_ptr() == buf
        except (RuntimeError, NotImplementedError):  # no storage of its own (a subclass, a functorch wrapper)
            continue
        if shared:
            raise RuntimeError(f"zeroshard: unit '{handle.unit_name}' returned a view of its own parameters (shape "
                               f"{tuple(t.shape)}), whose memory is freed when the unit reshards after its forward. "
                               "Fix: return a copy (.clone()) or a result computed from them, or keep this module "
                               "inside its parent's unit.")


def refuse_forward_inside_summon(handle) -> None:
    """A forward of a unit summoned with writeback (or use_orig_params=False) would reshard the
    summoned parameters: the block's edits lost and its exit failing on the freed buffer, or a
    read of a freed view (torch FSDP1 asserts 'Expects tensor to be unsharded'). With
    use_orig_params=True and writeback=False it gathers and frees as any forward. Under
    rank0_only the ranks hold different layouts (rank 0 the summoned one, the others their
    shards): refused on every rank alike."""
    if handle.summoned_rank0_only and not handle.always_full and (handle.sharded or not handle.use_orig_params):
        raise RuntimeError(f"zeroshard: forward of unit '{handle.unit_name}' inside its summon_full_params(rank0_only=True): "
                           "only rank 0 holds the full parameters, so the ranks would compute on different layouts (a "
                           "sharded unit's other ranks all-gathering alone: a hang in torch FSDP1). Fix: run the "
                           "forward after the with block, or summon with rank0_only=False.")
    wb = handle.summoned_writeback
    if wb is None or handle.always_full or (handle.use_orig_params and not wb):
        return
    raise RuntimeError(f"zeroshard: forward of unit '{handle.unit_name}' inside its summon_full_params("
                       f"writeback={wb}){'' if handle.use_orig_params else ' (use_orig_params=False)'}: the forward "
                       "would free the summoned parameters and lose the block's changes. Fix: run the forward after "
                       "the with block (it gathers what it needs), or summon with writeback=False and "
                       "use_orig_params=True.")
