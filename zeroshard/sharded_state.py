"""SHARDED state: each tensor as this rank's rows, in a DTensor that
``torch.distributed.checkpoint`` (DCP) can save and reshard.

A flat shard splits parameters anywhere and depends on the world size, so it
cannot be a checkpoint's unit. SHARDED state dicts (model and optimizer)
instead cut every full tensor into ``torch.chunk`` rows over the ranks that
shard it: rank r holds rows ``[r*ceil(d0/N), (r+1)*ceil(d0/N))`` (trailing
ranks may hold none). DCP records each chunk's offsets, so a checkpoint
written at one world size loads at any other.

* plain FULL_SHARD / SHARD_GRAD_OP: a 1-D mesh over the process group,
  placements ``(Shard(0),)``;
* hybrid sharding: a 2-D mesh (replicate, shard) built from the two groups,
  placements ``(Replicate(), Shard(0))``. Both replica groups hold the same
  rows; DCP deduplicates equal chunks, so each row is written once, and on
  load every replica reads its rows.

:func:`to_row_shard` cuts, :func:`from_row_shard` puts the rows back
together (one all-gather over the shard group). It also takes torch FSDP1's
``ShardedTensor`` (what torch returns for SHARDED on CPU without a device
mesh), so state dicts produced by torch load here too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import comm

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def device_mesh(root):
    """The mesh of ``root``'s ranks: the user's ``device_mesh`` when one was given (as
    torch's, so the DTensors mix with the user's own), else one made once and cached:
    1-D over its process group, or 2-D (replicate, shard) under hybrid sharding."""
    mesh = getattr(root, "_device_mesh", None) or root.__dict__.get("_zeroshard_mesh")
    if mesh is not None:
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    device = root.compute_device.type
    shard, replicate = root.process_group, root._replicate_group
    if replicate is None:
        mesh = DeviceMesh.from_group(shard, device)
    else:
        # Row i of the mesh is the shard group of the i-th rank of this
        # rank's replica group; only those ranks know it, so they tell.
        rows = comm.gather_objects(dist.get_process_group_ranks(shard), replicate, "state dict (the HSDP device mesh)")
        mesh = DeviceMesh.from_group([replicate, shard], device, mesh=torch.tensor(rows), mesh_dim_names=("replicate", "shard"))
    root.__dict__["_zeroshard_mesh"] = mesh
    return mesh


def _shard_dim(mesh) -> int:
    return mesh.ndim - 1  # 1-D: the only dim; 2-D (replicate, shard): the last


def to_row_shard(full: torch.Tensor, mesh) -> DTensor:
    """This rank's rows of ``full`` as a DTensor (a copy); 0-dim tensors are replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard  # heavy: only for SHARDED

    replicated = [Replicate()] * (mesh.ndim - 1)
    if full.dim() == 0:
        return DTensor.from_local(full.detach().clone(), mesh, [*replicated, Replicate()], run_check=False)
    dim = _shard_dim(mesh)
    d0, n, r = full.shape[0], mesh.size(dim), mesh.get_local_rank(dim)
    rows = -(-d0 // n)
    local = full.detach()[min(r * rows, d0) : min((r + 1) * rows, d0)].clone()
    return DTensor.from_local(local, mesh, [*replicated, Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def to_chunk_sharded_tensor(full: torch.Tensor, group):
    """This rank's ``torch.chunk`` rows of ``full`` as a ``ShardedTensor`` over
    ``group``: torch FSDP1's non-DTensor sharded form, which its LOCAL_STATE_DICT
    optimizer state dicts hold. Metadata is built locally (no communication);
    a rank past the last chunk holds no shard. 0-dim tensors stay plain copies."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

    if full.dim() == 0:
        return full.detach().clone()
    n, rank = group.size(), dist.get_rank(group)
    chunks = full.detach().chunk(n, dim=0)
    rows = -(-full.shape[0] // n)
    kind = full.device.type
    per_node = 1 if kind == "cpu" else torch.get_device_module(kind).device_count()

    def placement(i):  # torch's: global rank, and on accelerators the device index it would use
        g = dist.get_global_rank(group, i)
        return f"rank:{g}/cpu" if kind == "cpu" else f"rank:{g}/{kind}:{g % per_node}"

    metas = [ShardMetadata([i * rows] + [0] * (full.dim() - 1), list(c.shape), placement(i)) for i, c in enumerate(chunks)]
    local = [Shard(chunks[rank].clone(), metas[rank])] if rank < len(chunks) else []
    props = TensorProperties(dtype=full.dtype, layout=full.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    md = ShardedTensorMetadata(shards_metadata=metas, size=full.shape, tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, process_group=group)


def is_sharded(value) -> bool:
    """A DTensor or a ShardedTensor (torch FSDP1's SHARDED values on CPU)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) or type(value).__name__ == "ShardedTensor"


def _gather_rows(local: torch.Tensor, shape, group) -> torch.Tensor:
    """Every rank's ``torch.chunk`` rows, zero-padded to equal size and
    all-gathered, trimmed to ``shape`` (collective over ``group``)."""
    n = group.size()
    rows = -(-shape[0] // n)
    padded = local.new_zeros((rows, *shape[1:]))
    padded[: local.shape[0]].copy_(local)
    out = local.new_empty((rows * n, *shape[1:]))
    comm.all_gather(out, padded, group, async_op=False, what="SHARDED state rows")
    return out[: shape[0]]


def check_row_shard(value) -> None:
    """Raises :func:`from_row_shard`'s ValueError for a value it cannot load,
    without communicating (a load checks every value before it gathers any)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if type(value).__name__ == "ShardedTensor":
        shape = tuple(value.metadata().size)
        for m in value.metadata().shards_metadata:
            if any(m.shard_offsets[1:]) or tuple(m.shard_sizes[1:]) != shape[1:]:
                raise ValueError(f"zeroshard: cannot load a ShardedTensor with shard {m}: only dim-0 chunks (torch "
                                 "FSDP1's SHARDED format) are supported.")
        for shard in value.local_shards():
            if list(shard.tensor.shape) != list(shard.metadata.shard_sizes):
                raise ValueError(f"zeroshard: a ShardedTensor's local shard has shape {tuple(shard.tensor.shape)} but its "
                                 f"metadata says {tuple(shard.metadata.shard_sizes)}.")
    elif isinstance(value, DTensor):
        sharded = [i for i, p in enumerate(value.placements) if not isinstance(p, Replicate)]
        if sharded and (len(sharded) != 1 or value.placements[sharded[0]] != Shard(0)):
            raise ValueError(f"zeroshard: cannot load a DTensor with placements {value.placements}; expected Shard(0) on "
                             "one mesh dimension and Replicate() on the others, as zeroshard's SHARDED state dicts "
                             "hold. Fix: load into the state dict zeroshard's state_dict() / optim_state_dict() returns.")
        want = tuple(value.shape)
        if sharded and value.dim() > 0:  # torch.chunk's rows of this rank (the gather pads short ones silently)
            n, r = value.device_mesh.size(sharded[0]), value.device_mesh.get_local_rank(sharded[0])
            rows = -(-want[0] // n)
            want = (max(0, min(rows, want[0] - r * rows)), *want[1:])
        if tuple(value.to_local().shape) != want:
            raise ValueError(f"zeroshard: a DTensor of shape {tuple(value.shape)} holds local rows of shape "
                             f"{tuple(value.to_local().shape)} on this rank, where torch.chunk's rows are {want}. Fix: "
                             "load a state dict saved by state_dict() under SHARDED_STATE_DICT (or torch FSDP1's).")


def row_keys_differ(keys: list[str], group, what: str = "row-sharded keys") -> RuntimeError | None:
    """A problem if the ranks of ``group`` (the shard group) hold different
    ``keys`` (collective). Row-sharded ones: a load all-gathers rows key by key,
    and mismatched all-gathers abort the process under gloo. Any key of a FULL
    dict: loaded on some ranks only, it would leave a unit's shards a mix of
    old and new values."""
    everyone = comm.gather_objects(keys, group, f"load_state_dict: comparing the {what}")
    other = next((r for r, ks in enumerate(everyone) if ks != keys), None)
    if other is None:
        return None
    only_here, only_there = sorted(set(keys) - set(everyone[other])), sorted(set(everyone[other]) - set(keys))
    return RuntimeError(f"zeroshard: load_state_dict: this rank and rank {other} of the shard group hold different {what} "
                        f"(only here: {only_here[:3]}, only there: {only_there[:3]}). Fix: give every rank the state dict "
                        "that state_dict() returned on it (or that DCP loaded), the same keys on every rank.")


def from_row_shard(value):
    """The full tensor of a row-sharded DTensor or ShardedTensor (collective
    over the ranks that shard it); other values are returned as they are."""
    from torch.distributed.tensor import DTensor, Replicate

    check_row_shard(value)
    if type(value).__name__ == "ShardedTensor":
        return _from_sharded_tensor(value)
    if not isinstance(value, DTensor):
        return value
    sharded = [i for i, p in enumerate(value.placements) if not isinstance(p, Replicate)]
    if not sharded:
        return value.to_local()
    return _gather_rows(value.to_local(), value.shape, value.device_mesh.get_group(sharded[0]))


def _from_sharded_tensor(st) -> torch.Tensor:
    """The full tensor of torch FSDP1's ShardedTensor: dim-0 chunks, at most
    one per rank of its process group (``_create_chunk_sharded_tensor``)."""
    md, group = st.metadata(), st._process_group or dist.group.WORLD
    shape = tuple(md.size)
    by_rank = {dist.get_group_rank(group, m.placement.rank()): m for m in md.shards_metadata}  # dim-0 chunks (checked)
    n = group.size()
    rows = max((m.shard_sizes[0] for m in by_rank.values()), default=0)
    shards = st.local_shards()
    if shards:
        local = shards[0].tensor
    else:
        local = torch.empty((0, *shape[1:]), dtype=md.tensor_properties.dtype)
    padded = local.new_zeros((rows, *shape[1:]))
    padded[: local.shape[0]].copy_(local)
    gathered = local.new_empty((rows * n, *shape[1:]))
    comm.all_gather(gathered, padded, group, async_op=False, what="SHARDED state (ShardedTensor) rows")
    full = local.new_empty(shape)
    for r, m in by_rank.items():
        full[m.shard_offsets[0] : m.shard_offsets[0] + m.shard_sizes[0]].copy_(gathered[r * rows : r * rows + m.shard_sizes[0]])
    return full
