"""ext.CopyPlan: flatten/unflatten of a fixed tensor list, validated once and replayed.

A plan is a cache of checked raw addresses, so the danger is a stale one: these tests
re-point, resize and free members between replays and demand either the bytes the
pure-torch path writes or the same named error, never a write through an old address.
"""
import pytest
import torch
from hypothesis import given

from test_ext import DTYPES, SETTINGS, as_bytes, build, case_st, random_bits, run, same_bytes, storage_bytes
from zeroshard import ext

try:
    import zeroshard._C  # noqa: F401

    HAVE_EXT = True
except ImportError:
    HAVE_EXT = False

needs_ext = pytest.mark.skipif(not HAVE_EXT, reason="zeroshard._C not built")


def replay(backend, plan, method, flat):
    return run(backend, getattr(plan, method), flat)


@needs_ext
@SETTINGS
@given(case_st)
def test_replays_match_one_shot_python(case):
    tensors, offsets, total, gen = build(case)
    plan = ext.CopyPlan(tensors, offsets)
    for _ in range(3):  # fresh values every round: a plan caches addresses, not bytes
        for t in tensors:
            t.copy_(random_bits(t.shape, t.dtype, gen))
        flat = random_bits([total + 1], case["dtype"], gen)
        got, want = flat.clone(), flat.clone()
        assert replay("ext", plan, "flatten_into", got) is got
        run("python", ext.flatten_into, tensors, offsets, want)
        assert same_bytes(got, want)
        src = random_bits([total + 1], case["dtype"], gen)
        before = [storage_bytes(t).clone() for t in tensors]
        copies = [torch.empty(0, dtype=t.dtype).set_(b.clone(), t.storage_offset(), t.shape, t.stride())
                  for t, b in zip(tensors, [t.untyped_storage() for t in tensors])]
        replay("ext", plan, "unflatten_into", src)
        run("python", ext.unflatten_into, src, offsets, copies)
        for t, c, o, b in zip(tensors, copies, offsets, before):
            assert torch.equal(storage_bytes(t), storage_bytes(c)), "bytes outside a view moved"
            assert torch.equal(as_bytes(t), as_bytes(src[o : o + t.numel()]))
    assert plan.rebuilds == 1, "an unchanged plan must not rebuild its table"


@needs_ext
def test_repointed_members_rebuild_the_table():
    a, b = torch.arange(4.0), torch.arange(3.0) + 10
    plan = ext.CopyPlan([a, b], [0, 5])
    flat = torch.zeros(8)
    plan.flatten_into(flat)
    assert flat.tolist() == [0, 1, 2, 3, 0, 10, 11, 12] and plan.rebuilds == 1
    a.data = torch.full((4,), 7.0)  # a new storage behind the same tensor
    plan.flatten_into(flat)
    assert flat[:4].tolist() == [7.0] * 4 and plan.rebuilds == 2
    b.set_(torch.full((6,), 5.0)[3:])  # same numel, another storage and offset
    plan.flatten_into(flat)
    assert flat[5:].tolist() == [5.0] * 3 and plan.rebuilds == 3
    old = a.data
    a.data = torch.empty(4)
    plan.unflatten_into(torch.arange(8.0))
    assert a.tolist() == [0, 1, 2, 3] and old.tolist() == [7.0] * 4, "wrote through a stale address"
    plan.flatten_into(torch.zeros(8, dtype=torch.float32))  # another flat: no rebuild
    assert plan.rebuilds == 4


@needs_ext
def test_stale_plans_raise_the_one_shot_errors():
    a = torch.ones(4)
    plan = ext.CopyPlan([a], [2])
    plan.flatten_into(torch.zeros(6))
    with pytest.raises(ValueError, match="out of bounds"):
        plan.flatten_into(torch.zeros(5))  # a smaller flat
    with pytest.raises(ValueError, match="dtype"):
        plan.flatten_into(torch.zeros(6, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D contiguous"):
        plan.flatten_into(torch.zeros(12)[::2])
    a.resize_(6)  # same storage pointer may move; more elements than the slot
    with pytest.raises(ValueError, match="out of bounds"):
        plan.flatten_into(torch.zeros(6))
    b = torch.ones(4)
    plan_b = ext.CopyPlan([b], [0])
    plan_b.unflatten_into(torch.zeros(4))
    b.untyped_storage().resize_(0)  # freed as FSDP frees unsharded storage
    with pytest.raises(RuntimeError, match="storage"):
        plan_b.unflatten_into(torch.zeros(4))
    flat = torch.zeros(4)
    plan_b2 = ext.CopyPlan([torch.ones(4)], [0])
    plan_b2.flatten_into(flat)
    flat.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="storage"):
        plan_b2.flatten_into(flat)
    with pytest.raises(ValueError, match="offsets"):
        ext.CopyPlan([torch.ones(2)], [0, 1])


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_versions_and_autograd(backend):
    """Replays are raw data movement like the one-shot calls: no autograd history,
    but version counters move, so autograd still catches a saved tensor overwritten."""
    if backend == "ext" and not HAVE_EXT:
        pytest.skip("zeroshard._C not built")
    w = torch.nn.Parameter(torch.ones(3))
    plan = ext.CopyPlan([w], [1])
    flat = torch.arange(5.0)
    v = w._version
    replay(backend, plan, "unflatten_into", flat)
    assert w.tolist() == [1, 2, 3] and w._version > v and w.grad_fn is None and w.is_leaf
    out = torch.zeros(5, requires_grad=True).clone()
    v = out._version
    replay(backend, plan, "flatten_into", out)
    assert out._version > v and out[1:4].tolist() == [1, 2, 3]


def parallel_members(n=64, numel=4099):
    """n members of ~16 KB: a 1 MB payload cut into 4 KiB chunks across threads,
    with most runs split between two of them (numel is odd, so runs straddle chunks)."""
    gen = torch.Generator().manual_seed(n)
    tensors = [torch.randn(numel, generator=gen) for _ in range(n)]
    offsets = [i * (numel + 1) for i in range(n)]
    return tensors, offsets, n * (numel + 1)


@needs_ext
@pytest.mark.parametrize("changed", [0, 31, 63])
def test_a_member_changed_since_the_last_replay_is_caught_inside_the_parallel_copy(
    four_threads, changed
):
    tensors, offsets, total = parallel_members()
    plan = ext.CopyPlan(tensors, offsets)
    flat = torch.zeros(total)
    plan.flatten_into(flat)
    old = tensors[changed].data
    tensors[changed].data = torch.full_like(old, 7.0)  # re-pointed: the plan's address is stale
    plan.flatten_into(flat)
    want = torch.zeros(total)
    run("python", ext.flatten_into, tensors, offsets, want)
    assert torch.equal(flat, want) and plan.rebuilds == 2
    old_bytes = old.clone()
    tensors[changed].data = torch.empty_like(old)
    src = torch.arange(float(total))
    plan.unflatten_into(src)
    assert torch.equal(old, old_bytes), "wrote through the stale address"
    for t, o in zip(tensors, offsets):
        assert torch.equal(t, src[o : o + t.numel()])
    assert plan.rebuilds == 3
    # Changed so that it no longer fits: the one-shot call's error, and the freed
    # member's old storage is never touched.
    tensors[changed].resize_(total + 1)
    with pytest.raises(ValueError, match=rf"tensors\[{changed}\] range .* out of bounds"):
        plan.unflatten_into(src)
    tensors[changed].resize_(old.numel())
    tensors[changed].untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=rf"tensors\[{changed}\] reaches byte .* storage"):
        plan.flatten_into(flat)


@needs_ext
def test_a_member_shrunk_since_the_last_replay_lets_a_smaller_flat_through():
    """The plan's O(1) bound test fails for a flat smaller than the table reaches; when
    the members now fit it (one shrank: on CPU, not yet checked), the plan rebuilds
    instead of raising."""
    a, b = torch.randn(10), torch.randn(10)
    plan = ext.CopyPlan([a, b], [0, 10])
    plan.flatten_into(torch.zeros(20))
    b.data = torch.randn(5)
    flat = torch.zeros(15)
    assert plan.flatten_into(flat) is flat and plan.rebuilds == 2
    assert torch.equal(flat, torch.cat([a, b]))
    with pytest.raises(ValueError, match=r"tensors\[1\] range \[10, 15\) is out of bounds"):
        plan.flatten_into(torch.zeros(14))


@needs_ext
def test_long_plans_match_the_python_path(four_threads):
    """1024 members (checked in parallel slices when the table is built), strided and
    empty ones among them: replays write the python path's bytes and versions."""
    got = {}
    for backend in ("ext", "python"):
        gen = torch.Generator().manual_seed(3)
        tensors = [torch.randn(int(n), generator=gen) for n in torch.randint(0, 300, (1024,), generator=gen)]
        tensors[5] = torch.randn(40, 30, generator=gen).t()
        tensors[700] = torch.randn(90, generator=gen)[::3]
        offsets = torch.cumsum(torch.tensor([0] + [t.numel() + 1 for t in tensors[:-1]]), 0).tolist()
        total = offsets[-1] + tensors[-1].numel() + 2
        plan, flat = ext.CopyPlan(tensors, offsets), torch.full((total,), -1.0)
        replay(backend, plan, "flatten_into", flat)
        src = torch.randn(total, generator=gen)
        before = [t._version for t in tensors]
        replay(backend, plan, "unflatten_into", src)
        got[backend] = (flat, [t.clone() for t in tensors], [t._version - v for t, v in zip(tensors, before)])
    (flat, outs, versions), (want_flat, want_outs, want_versions) = got["ext"], got["python"]
    assert torch.equal(flat, want_flat) and all(torch.equal(o, w) for o, w in zip(outs, want_outs))
    nonempty = [i for i, o in enumerate(outs) if o.numel()]
    assert [versions[i] for i in nonempty] == [want_versions[i] for i in nonempty]


@needs_ext
@pytest.mark.parametrize("method", ["flatten_into", "unflatten_into"])
def test_parallel_replays_move_versions_as_the_python_path(four_threads, method):
    """Members bump their version counter once per unflatten (a run split between
    threads too), as _foreach_copy_ does; flat moves on flatten only (the python path
    bumps it once per member view, the plan once)."""
    deltas = {}
    for backend in ("ext", "python"):
        tensors, offsets, total = parallel_members()
        plan, flat = ext.CopyPlan(tensors, offsets), torch.zeros(total)
        for rep in range(3):  # the first replay builds the table, the others use it
            before = [t._version for t in tensors] + [flat._version]
            replay(backend, plan, method, flat)
            after = [t._version for t in tensors] + [flat._version]
            deltas.setdefault(backend, []).append([b - a for a, b in zip(before, after)])
    members = {b: [d[:-1] for d in ds] for b, ds in deltas.items()}
    assert members["ext"] == members["python"]
    assert set(members["ext"][-1]) == {1 if method == "unflatten_into" else 0}
    flat_moved = {b: [d[-1] > 0 for d in ds] for b, ds in deltas.items()}
    assert flat_moved["ext"] == flat_moved["python"] == [method == "flatten_into"] * 3


@needs_ext
def test_parallel_replays_into_inference_tensors(four_threads):
    """An inference tensor's version bump checks InferenceMode, which only the calling
    thread has: the plan must not bump it on the copy's worker threads."""
    with torch.inference_mode():
        tensors, offsets, total = parallel_members()
        plan = ext.CopyPlan(tensors, offsets)
        src = torch.arange(float(total))
        for _ in range(2):
            plan.unflatten_into(src)
        assert all(torch.equal(t, src[o : o + t.numel()]) for t, o in zip(tensors, offsets))
    before = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        plan.unflatten_into(torch.zeros(total))  # outside inference mode: torch's error...
    assert all(torch.equal(t, b) for t, b in zip(tensors, before)), "...before any write"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_plan_matches_python(dtype):
    if ext.ext_backend("cuda") != "cuda":
        pytest.skip("zeroshard._C was built without CUDA")
    gen = torch.Generator().manual_seed(3)
    # inline-sized tables, beyond, and a few runs of tens of MB
    for n, hi in ((7, 50_000), (1000, 2000), (3000, 40), (4, 5_000_000)):
        sizes = torch.randint(1, hi, (n,), generator=gen).tolist()
        if n == 4:
            sizes[2] = 5_000_000
        tensors = [random_bits([s], dtype, gen).cuda() for s in sizes]
        tensors[1] = random_bits([sizes[1], 2], dtype, gen).cuda()[:, 1]  # strided member
        offsets, cursor = [], 0
        for i, t in enumerate(tensors):
            cursor += i % 3  # odd gaps: every source/destination misalignment
            offsets.append(cursor)
            cursor += t.numel()
        plan = ext.CopyPlan(tensors, offsets)
        side = torch.cuda.Stream()
        for round_ in range(3):
            flat = random_bits([cursor + 5], dtype, gen).cuda()
            a, b = flat.clone(), flat.clone()
            with torch.cuda.stream(side if round_ == 2 else torch.cuda.current_stream()):
                plan.flatten_into(a)
            torch.cuda.synchronize()
            run("python", ext.flatten_into, tensors, offsets, b)
            assert same_bytes(a.cpu(), b.cpu())
            outs = [torch.empty_like(t) for t in tensors]
            ext.CopyPlan(outs, offsets).unflatten_into(a)
            for o, t in zip(outs, tensors):
                assert same_bytes(o.cpu(), t.cpu())
        assert plan.rebuilds == 1
        tensors[0].data = torch.zeros_like(tensors[0])
        a = torch.ones(cursor + 5, dtype=dtype, device="cuda")
        plan.flatten_into(a)
        assert not a[: tensors[0].numel()].any() and plan.rebuilds == 2
