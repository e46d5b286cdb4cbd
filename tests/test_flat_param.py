"""FlatParameter layout and sharding: the same padding, shard boundaries and
shard contents as torch FSDP1, and flatten -> shard -> all-gather -> unflatten
is the identity."""
from __future__ import annotations

import warnings

import torch
import torch.distributed.fsdp as tfsdp
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import zeroshard as zs
from models import ParamBag
from zeroshard.flat_param import build_layout, collect_params, flatten_params, shard_of

shape_st = st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple)
shapes_st = st.lists(shape_st, min_size=1, max_size=7)


def _layout(shapes, world_size, rank, align):
    bag = ParamBag(shapes)
    entries, aliases = collect_params(bag, skip=set())
    return bag, entries, build_layout(entries, aliases, world_size, rank, align)


def test_documented_example():
    """numels [15, 5, 15, 3]: 16-byte alignment of fp32 inserts 1, 3, 1 pad
    elements, then the total (43) is padded to a multiple of 4 ranks."""
    bag = nn.Module()
    for i, n in enumerate([15, 5, 15, 3]):
        bag.register_parameter(f"w{i}", nn.Parameter(torch.ones(n)))
    entries, aliases = collect_params(bag, skip=set())
    aligned = build_layout(entries, aliases, 4, 0, align_numel=4)
    assert [p.offset for p in aligned.params] == [0, 16, 24, 40]
    assert aligned.numel == 44 and aligned.shard_numel == 11
    plain = build_layout(entries, aliases, 4, 3, align_numel=0)
    assert plain.numel == 38 and plain.shard_numel == 10 and plain.padded_numel == 40
    assert (plain.shard_start, plain.shard_end) == (30, 38)  # last rank: 8 real + 2 padding


@given(shapes_st, st.integers(1, 5), st.sampled_from([0, 4]))
def test_flatten_shard_gather_unflatten_is_identity(shapes, world_size, align):
    bag, entries, _ = _layout(shapes, world_size, 0, align)
    layouts = [build_layout(entries, [], world_size, r, align) for r in range(world_size)]
    flat = flatten_params(layouts[0], [e[3] for e in entries])
    shards = [shard_of(flat, lay) for lay in layouts]
    assert all(s.numel() == layouts[0].shard_numel for s in shards)
    gathered = torch.cat(shards)  # what all_gather produces
    assert gathered.numel() == layouts[0].padded_numel
    assert torch.all(gathered[layouts[0].numel :] == 0)
    chunks = torch.split(gathered[: layouts[0].numel], layouts[0].split_sizes)
    for i, (_, _, fqn, p) in enumerate(entries):
        assert torch.equal(chunks[2 * i + 1].view(p.shape), p.detach()), fqn
    for i in range(0, len(chunks), 2):  # alignment gaps are zeros
        assert torch.all(chunks[i] == 0)
    # Each parameter's in-shard slices, over all ranks, tile it exactly once.
    for i, (_, _, _, p) in enumerate(entries):
        pieces = sorted(
            (lay.shard_slices[i].offset_in_param, shards[r][lay.shard_slices[i].offset_in_shard :][: lay.shard_slices[i].numel_in_shard])
            for r, lay in enumerate(layouts)
            if lay.shard_slices[i] is not None
        )
        rebuilt = torch.cat([t for _, t in pieces]) if pieces else p.detach().new_empty(0).reshape(-1)
        assert torch.equal(rebuilt, p.detach().reshape(-1))


def _shards_vs_torch(rank, world_size, shapes, use_orig_params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = tfsdp.FullyShardedDataParallel(ParamBag(shapes), device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    ours = zs.FSDP(ParamBag(shapes), use_orig_params=use_orig_params)
    a, b = ref._handle.flat_param.detach(), ours._handle.flat_param.detach()
    assert a.shape == b.shape, f"rank {rank}: shard sizes differ {a.shape} vs {b.shape}"
    # Same elements at the same places; only padding differs in value (torch
    # fills it with the marker 42, zeroshard with zeros), so compare real ones.
    real = torch.zeros_like(b, dtype=torch.bool)
    for sl in ours._handle.layout.shard_slices:
        if sl is not None:
            real[sl.offset_in_shard : sl.offset_in_shard + sl.numel_in_shard] = True
    assert torch.equal(a[real], b[real]), f"rank {rank}: shard differs {a} vs {b}"
    assert torch.all(b[~real] == 0)
    assert ref._handle.flat_param._unpadded_unsharded_size.numel() == ours._handle.layout.numel
    if use_orig_params:
        for (n1, p1), (n2, p2) in zip(ref.named_parameters(), ours.named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2), (n1, n2)
    return a.numel()


# torch FSDP1 rejects 0-d parameters (zeroshard accepts them), so compare on >= 1-d.
@given(st.lists(shape_st.filter(len), min_size=1, max_size=7), st.integers(2, 4), st.booleans())
def test_shards_equal_torch_fsdp(ranks, shapes, world_size, use_orig_params):
    sizes = ranks.run(world_size, _shards_vs_torch, shapes, use_orig_params)
    assert len(set(sizes)) == 1
