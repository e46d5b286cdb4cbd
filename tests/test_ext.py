"""Byte-identity of the flatten extension (zeroshard._C) against its pure-torch reference.

These copies build the FlatParameter / flat gradient buffer (flatten) and materialize
per-parameter tensors for state dicts and summon_full_params (unflatten), so any
difference between backends would silently corrupt training state.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroshard import ext

try:
    import zeroshard._C  # noqa: F401

    HAVE_EXT = True
except ImportError:
    HAVE_EXT = False

needs_ext = pytest.mark.skipif(
    not HAVE_EXT, reason="zeroshard._C not built (pip install --no-build-isolation -e .)"
)
BACKENDS = [pytest.param("ext", marks=needs_ext), "python"]
SETTINGS = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Integer types of the same width, for filling floats with arbitrary bit patterns
# (NaN payloads included): a copy must move bytes, not values.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(shape, dtype, gen):
    bits = BITS[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, tuple(shape), dtype=bits, generator=gen)
    return raw.view(dtype)


def as_bytes(t):
    # A fresh clone: even an empty view may carry strides that .view() rejects.
    return t.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)


def storage_bytes(t):
    """Every byte of t's storage, including those outside the view."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def run(backend, fn, *args):
    """Call fn with ZEROSHARD_DISABLE_EXT set for "python" and unset otherwise."""
    with pytest.MonkeyPatch.context() as mp:
        if backend == "python":
            mp.setenv("ZEROSHARD_DISABLE_EXT", "1")
        else:
            mp.delenv("ZEROSHARD_DISABLE_EXT", raising=False)
        return fn(*args)


def make_view(base_shape, kind, dtype, gen, device="cpu"):
    """A tensor of logical shape base_shape that is a (possibly strided) view."""
    shape = list(base_shape)
    if kind == "transpose" and len(shape) >= 2:
        base = random_bits(shape[::-1], dtype, gen)
        return base.to(device).permute(*reversed(range(len(shape))))
    if kind == "step" and len(shape) >= 1:
        big = shape[:-1] + [shape[-1] * 2 + 1]
        return random_bits(big, dtype, gen).to(device)[..., 1::2]
    if kind == "offset":  # contiguous but not at the start of its storage
        return random_bits([int(torch.Size(shape).numel()) + 3], dtype, gen).to(device)[3:].view(
            shape
        )
    return random_bits(shape, dtype, gen).to(device)


shape_st = st.lists(st.integers(0, 5), min_size=0, max_size=3)  # [] is a scalar
case_st = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPES),
        "specs": st.lists(
            st.tuples(
                shape_st,
                st.sampled_from(["contig", "transpose", "step", "offset"]),
                st.integers(0, 3),  # padding before this tensor
            ),
            max_size=8,
        ),
        "tail": st.integers(0, 4),
        "order": st.randoms(use_true_random=False),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def build(case, device="cpu"):
    """tensors (views), offsets (with gaps, in shuffled placement order), total numel."""
    gen = torch.Generator().manual_seed(case["seed"])
    tensors = [make_view(s, k, case["dtype"], gen, device) for s, k, _ in case["specs"]]
    placement = list(range(len(tensors)))
    case["order"].shuffle(placement)
    offsets, cursor = [0] * len(tensors), 0
    for i in placement:
        cursor += case["specs"][i][2]
        offsets[i] = cursor
        cursor += tensors[i].numel()
    return tensors, offsets, cursor + case["tail"], gen


def check_flat_contents(flat, tensors, offsets):
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for t, o in zip(tensors, offsets):
        assert torch.equal(as_bytes(flat[o : o + t.numel()]), as_bytes(t))
        covered[o : o + t.numel()] = True
    assert not as_bytes(flat[~covered.to(flat.device)]).any(), "padding must be zero"


@needs_ext
@SETTINGS
@given(case_st)
def test_flatten_matches_python(case):
    tensors, offsets, total, _ = build(case)
    got = run("ext", ext.flatten, tensors, offsets, total)
    want = run("python", ext.flatten, tensors, offsets, total)
    assert got.is_contiguous() and same_bytes(got, want)
    assert got.dtype == (case["dtype"] if tensors else torch.get_default_dtype())
    check_flat_contents(got, tensors, offsets)


@needs_ext
@SETTINGS
@given(case_st)
def test_flatten_into_matches_python(case):
    tensors, offsets, total, gen = build(case)
    flat = random_bits([total + 2], case["dtype"], gen)  # uncovered bytes must survive
    got, want = flat.clone(), flat.clone()
    assert run("ext", ext.flatten_into, tensors, offsets, got) is got
    run("python", ext.flatten_into, tensors, offsets, want)
    assert same_bytes(got, want)
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for t, o in zip(tensors, offsets):
        covered[o : o + t.numel()] = True
    assert torch.equal(as_bytes(got[~covered]), as_bytes(flat[~covered]))


@needs_ext
@SETTINGS
@given(case_st)
def test_unflatten_matches_python(case):
    tensors, offsets, total, gen = build(case)
    flat = random_bits([total], case["dtype"], gen)
    shapes = [t.shape for t in tensors]
    got = run("ext", ext.unflatten, flat, offsets, shapes)
    want = run("python", ext.unflatten, flat, offsets, shapes)
    assert len(got) == len(want) == len(shapes)
    for g, w, s, o in zip(got, want, shapes, offsets):
        assert g.shape == s and g.is_contiguous() and same_bytes(g, w)
        assert torch.equal(as_bytes(g), as_bytes(flat[o : o + s.numel()]))
        if g.numel():
            assert g.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


@needs_ext
@SETTINGS
@given(case_st)
def test_unflatten_into_matches_python(case):
    tensors, offsets, total, gen = build(case)
    flat = random_bits([total], case["dtype"], gen)
    # The outs are the strided views themselves: compare whole storages, so bytes
    # outside each view must be left alone too.
    outs_ext = tensors
    outs_py = [
        torch.empty(0, dtype=t.dtype).set_(
            t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride()
        )
        for t in tensors
    ]
    before = [storage_bytes(t).clone() for t in tensors]
    assert run("ext", ext.unflatten_into, flat, offsets, outs_ext) is None
    run("python", ext.unflatten_into, flat, offsets, outs_py)
    for g, w, o, b in zip(outs_ext, outs_py, offsets, before):
        assert torch.equal(storage_bytes(g), storage_bytes(w))
        assert torch.equal(as_bytes(g), as_bytes(flat[o : o + g.numel()]))
        if g.numel() == 0:
            assert torch.equal(storage_bytes(g), b)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_parallel_chunks(four_threads, dtype):
    """Payloads of several MB so at::parallel_for really splits, with chunk borders
    inside tensors and spanning many small ones, plus strided members; 703 members,
    so the checks run in parallel slices too."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 17_000, (700,), generator=gen).tolist() + [1_000_000, 1, 0]
    tensors = [random_bits([n], dtype, gen) for n in sizes]
    tensors[5] = random_bits([700, 300], dtype, gen).t()
    tensors[17] = random_bits([90_000], dtype, gen)[::3]
    offsets, cursor = [], 0
    for i, t in enumerate(tensors):
        cursor += i % 3  # odd gaps: unaligned destinations
        offsets.append(cursor)
        cursor += t.numel()
    total = cursor + 17
    got = run("ext", ext.flatten, tensors, offsets, total)
    assert same_bytes(got, run("python", ext.flatten, tensors, offsets, total))
    check_flat_contents(got, tensors, offsets)
    shapes = [t.shape for t in tensors]
    got_u = run("ext", ext.unflatten, got, offsets, shapes)
    for g, t in zip(got_u, tensors):
        assert same_bytes(g, t)
    outs = [torch.empty_like(t) for t in tensors]
    outs[5] = torch.empty(700, 300, dtype=dtype).t()  # strided destination
    run("ext", ext.unflatten_into, got, offsets, outs)
    for o, t in zip(outs, tensors):
        assert same_bytes(o, t)


@needs_ext
def test_every_run_length_at_every_alignment():
    """The CPU copy loop moves a run in 128-byte vector steps and then its tail: runs of
    0..520 bytes (four steps and every tail), read from and written to addresses at every
    offset 0..31 from a 32-byte boundary (each length at one source and one destination
    offset, the two independent), in both directions, byte for byte."""
    gen = torch.Generator().manual_seed(1)
    lengths = list(range(521))
    src_buf = random_bits([sum(lengths) + 64 * len(lengths)], torch.uint8, gen)
    sources, offsets, at, cursor = [], [], 0, 0
    for k, n in enumerate(lengths):
        at = -(-at // 32) * 32 + k % 32  # the source's offset from a 32-byte boundary (fresh storages are 64-aligned)
        sources.append(src_buf[at : at + n])
        at += n
        cursor = -(-cursor // 32) * 32 + (k * 7) % 32  # the destination's, independently
        offsets.append(cursor)
        cursor += n
    flat = random_bits([cursor + 5], torch.uint8, gen)
    expect = flat.clone()
    for s, o in zip(sources, offsets):
        expect[o : o + s.numel()] = s
    assert run("ext", ext.flatten_into, sources, offsets, flat) is flat
    assert torch.equal(flat, expect)
    dst_buf = torch.zeros_like(src_buf)
    outs = [dst_buf[s.storage_offset() : s.storage_offset() + s.numel()] for s in sources]
    run("ext", ext.unflatten_into, flat, offsets, outs)
    covered = torch.zeros_like(src_buf, dtype=torch.bool)
    for o in outs:
        covered[o.storage_offset() : o.storage_offset() + o.numel()] = True
    assert torch.equal(dst_buf[covered], src_buf[covered])
    assert not dst_buf[~covered].any()  # nothing written beside the runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    flat = torch.arange(4.0)
    assert run(backend, ext.flatten_into, [], [], flat) is flat
    assert torch.equal(flat, torch.arange(4.0))
    assert torch.equal(run(backend, ext.flatten, [], [], 3), torch.zeros(3))
    assert run(backend, ext.unflatten, flat, [], []) == []
    assert run(backend, ext.unflatten_into, flat, [], []) is None
    z = run(backend, ext.flatten, [torch.empty(0, 3)], [0], 0)
    assert z.shape == (0,)
    (u,) = run(backend, ext.unflatten, torch.empty(0), [0], [torch.Size([2, 0])])
    assert u.shape == (2, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_errors(backend):
    flat = torch.zeros(10)
    bad = [
        (ext.flatten_into, ([torch.ones(3, dtype=torch.float16)], [0], flat), "dtype"),
        (ext.flatten_into, ([torch.ones(3, device="meta")], [0], flat), "flat is on"),
        (ext.flatten_into, ([torch.ones(3)], [8], flat), "out of bounds"),
        (ext.flatten_into, ([torch.ones(3)], [-1], flat), "out of bounds"),
        (ext.flatten_into, ([torch.ones(3)], [0, 1], flat), "offsets"),
        (ext.flatten_into, ([torch.ones(3)], [0], torch.zeros(2, 5)), "1-D contiguous"),
        (ext.flatten_into, ([torch.ones(3)], [0], torch.zeros(20)[::2]), "1-D contiguous"),
        (ext.flatten, ([torch.ones(3)], [0], 2), "out of bounds"),
        (ext.flatten, ([torch.ones(3), torch.ones(2, dtype=torch.int32)], [0, 3], 5), "dtype"),
        (ext.flatten, ([torch.ones(3)], [0], -1), "total_numel"),
        (ext.unflatten_into, (flat, [9], [torch.empty(2)]), "out of bounds"),
        (ext.unflatten_into, (flat, [0], [torch.empty(2, dtype=torch.bfloat16)]), "dtype"),
        (ext.unflatten, (flat, [9], [torch.Size([2])]), "out of bounds"),
        (ext.unflatten, (flat, [0], [(2, -1)]), "negative"),
    ]
    for fn, args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            run(backend, fn, *args)
    assert not flat.any(), "a rejected call must not write"


@needs_ext
def test_freed_storage_is_rejected():
    """FSDP frees unsharded storage with resize_(0); data_ptr() is then 0, so the
    extension must check storage bounds itself instead of writing through it."""
    flat = torch.zeros(10)
    flat.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="storage"):
        run("python", ext.flatten_into, [torch.ones(3)], [0], flat)
    with pytest.raises(RuntimeError, match="storage"):
        run("ext", ext.flatten_into, [torch.ones(3)], [0], flat)
    with pytest.raises(RuntimeError, match="storage"):
        run("ext", ext.unflatten, flat, [0], [(3,)])
    src = torch.ones(4)
    src.untyped_storage().resize_(0)  # torch's own copy_ would segfault on this one
    with pytest.raises(RuntimeError, match="storage"):
        run("ext", ext.flatten, [src], [0], 4)
    with pytest.raises(RuntimeError, match="storage"):
        run("ext", ext.unflatten_into, torch.zeros(4), [0], [src])


@pytest.mark.parametrize("backend", BACKENDS)
def test_aliasing_and_autograd(backend):
    """Params that already view the FlatParameter copy onto themselves; writes are raw
    data movement (no autograd graph) but bump version counters like copy_."""
    flat = torch.nn.Parameter(torch.arange(10.0))
    views = [flat.detach()[0:4].view(2, 2), flat.detach()[4:10]]
    v0 = flat._version
    run(backend, ext.flatten_into, views, [0, 4], flat)
    assert torch.equal(flat.detach(), torch.arange(10.0)) and flat._version > v0
    src = [torch.ones(4, requires_grad=True)]
    out = run(backend, ext.flatten, src, [2], 8)
    assert not out.requires_grad and out.grad_fn is None
    run(backend, ext.flatten_into, src, [0], flat)  # in-place into a leaf Parameter
    assert flat.grad_fn is None and torch.equal(flat.detach()[:4], torch.ones(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_conj_and_neg_views_are_resolved(backend):
    """A conj/neg view's bytes are not its values: both paths must copy values."""
    z = torch.randn(6, dtype=torch.complex64)
    srcs = [z.conj(), z.conj().imag]
    assert srcs[0].is_conj() and srcs[1].is_neg()
    want0, want1 = z.conj().resolve_conj(), -z.imag
    flat = run(backend, ext.flatten, [srcs[0]], [0], 6)
    assert torch.equal(flat, want0)
    flat_r = run(backend, ext.flatten, [srcs[1]], [1], 7)
    assert torch.equal(flat_r[1:], want1)
    out = torch.zeros(6, dtype=torch.complex64).conj()
    run(backend, ext.unflatten_into, z, [0], [out])
    assert torch.equal(out.resolve_conj(), z)


@needs_ext
def test_backend_cpp_when_built():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ZEROSHARD_DISABLE_EXT", raising=False)
        assert ext.ext_backend() == "cpp"
        assert ext.ext_backend("cpu") == "cpp"
        assert ext.ext_backend(torch.device("meta")) == "python"


@pytest.mark.skipif(
    os.environ.get("ZEROSHARD_REQUIRE_EXT") != "1", reason="set ZEROSHARD_REQUIRE_EXT=1 to demand it"
)
def test_extension_required():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ZEROSHARD_DISABLE_EXT", raising=False)
        assert ext.ext_backend() == "cpp", "zeroshard._C failed to build or import"


def test_backend_python_when_disabled(monkeypatch):
    monkeypatch.setenv("ZEROSHARD_DISABLE_EXT", "1")
    assert ext.ext_backend() == "python"
    assert ext.ext_backend("cuda") == "python"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# uint8 puts runs at odd byte offsets: the kernel's 1- and 3-byte funnel shifts.
@pytest.mark.parametrize("dtype", DTYPES + [torch.uint8])
def test_cuda_matches_python(dtype):
    if ext.ext_backend("cuda") != "cuda":
        pytest.skip("zeroshard._C was built without CUDA")
    rnd = __import__("random").Random(0)
    for seed in range(20):  # small random cases, inline-table path
        specs = [
            ([rnd.randint(0, 5) for _ in range(rnd.randint(0, 3))],
             rnd.choice(["contig", "transpose", "step", "offset"]), rnd.randint(0, 3))
            for _ in range(rnd.randint(0, 8))
        ]
        case = {"dtype": dtype, "specs": specs, "tail": 3, "order": rnd, "seed": seed}
        _check_cuda_case(*build(case, "cuda"))
    gen = torch.Generator().manual_seed(1)  # thousands of pieces: device-table path
    sizes = torch.randint(0, 300_000, (500,), generator=gen).tolist() + [5_000_000]
    tensors = [random_bits([n], dtype, gen).cuda() for n in sizes]
    tensors[3] = tensors[3][::2]
    offsets, cursor = [], 0
    for i, t in enumerate(tensors):
        cursor += i % 5
        offsets.append(cursor)
        cursor += t.numel()
    _check_cuda_case(tensors, offsets, cursor + 9, gen)
    # More runs than fit in the kernel's parameter space: the device-table path.
    tensors = [random_bits([n], dtype, gen).cuda() for n in torch.randint(1, 40, (3000,), generator=gen).tolist()]
    offsets = torch.arange(3000).mul(41).tolist()
    _check_cuda_case(tensors, offsets, 3000 * 41, gen)


def _check_cuda_case(tensors, offsets, total, gen):
    dtype = tensors[0].dtype if tensors else torch.float32
    got = run("ext", ext.flatten, tensors, offsets, total)
    want = run("python", ext.flatten, tensors, offsets, total)
    if tensors:
        assert got.is_cuda and same_bytes(got.cpu(), want.cpu())
    flat = random_bits([total + 1], dtype, gen).cuda()
    a, b = flat.clone(), flat.clone()
    run("ext", ext.flatten_into, tensors, offsets, a)
    run("python", ext.flatten_into, tensors, offsets, b)
    assert same_bytes(a.cpu(), b.cpu())
    shapes = [t.shape for t in tensors]
    for g, w in zip(run("ext", ext.unflatten, a, offsets, shapes),
                    run("python", ext.unflatten, a, offsets, shapes)):
        assert same_bytes(g.cpu(), w.cpu())
    outs_e = [torch.empty_like(t) for t in tensors]
    outs_p = [torch.empty_like(t) for t in tensors]
    run("ext", ext.unflatten_into, a, offsets, outs_e)
    run("python", ext.unflatten_into, a, offsets, outs_p)
    for g, w in zip(outs_e, outs_p):
        assert same_bytes(g.cpu(), w.cpu())
    torch.cuda.synchronize()


# --- long lists: the extension checks them in parallel slices --------------------------

LONG = 1024  # members: four slices of 256 under four_threads


def long_list(gen, numel=33):
    tensors = [random_bits([numel], torch.float32, gen) for _ in range(LONG)]
    offsets = [i * (numel + 1) for i in range(LONG)]
    return tensors, offsets, LONG * (numel + 1)


def spoil(tensors, i, how):
    """Make member i a bad one, as a user bug would."""
    if how == "dtype":
        tensors[i] = tensors[i].double()
    elif how == "bounds":
        tensors[i] = torch.zeros(10**6)
    else:  # freed, as FSDP's reshard frees: data_ptr() still answers
        tensors[i] = tensors[i].clone()
        tensors[i].untyped_storage().resize_(0)


ERRORS = {"dtype": (ValueError, "has dtype"), "bounds": (ValueError, "out of bounds"),
          "freed": (RuntimeError, "storage")}


@needs_ext
@pytest.mark.parametrize("how", sorted(ERRORS))
@pytest.mark.parametrize("bad", [(5, 900), (900,), (300, 301, 1023)])
def test_long_lists_raise_the_first_bad_members_error_before_any_write(four_threads, how, bad):
    """Slices are checked concurrently, yet the error names the first bad member (as
    the serial check and the python path do) and nothing is written before it."""
    gen = torch.Generator().manual_seed(len(bad))
    tensors, offsets, total = long_list(gen)
    for i in bad:
        spoil(tensors, i, how)
    kind, what = ERRORS[how]
    first = rf"\[{bad[0]}\]"
    flat = torch.zeros(total)
    with pytest.raises(kind, match=first + ".*" + what):
        run("ext", ext.flatten_into, tensors, offsets, flat)
    with pytest.raises(kind, match=first + ".*" + what):
        run("ext", ext.flatten, tensors, offsets, total)
    assert not flat.any() and flat._version == 0
    if how == "dtype":  # a double destination is a fine tensor to read back into
        return
    before = [storage_bytes(t).clone() for t in tensors]
    with pytest.raises(kind, match=first + ".*" + what):
        run("ext", ext.unflatten_into, torch.ones(total), offsets, tensors)
    assert all(torch.equal(storage_bytes(t), b) for t, b in zip(tensors, before))


@needs_ext
def test_long_lists_with_a_subclass_member_go_to_the_python_path_whole(four_threads):
    """A member the extension cannot touch (here a meta tensor, late in the list)
    sends the whole call to the pure-torch path before any check raises, even when
    an earlier slice holds a bad member: the python path then gives its own error."""
    from zeroshard import _C

    tensors, offsets, total = long_list(torch.Generator().manual_seed(0))
    tensors[1000] = torch.empty(33, device="meta")
    flat = torch.zeros(total)
    assert _C.flatten_into(tensors, offsets, flat) is False and not flat.any()
    spoil(tensors, 3, "dtype")
    assert _C.flatten_into(tensors, offsets, flat) is False
    assert _C.unflatten_into(flat, offsets, tensors) is False
    assert _C.flatten(tensors, offsets, total) is None
    assert not flat.any() and flat._version == 0
    # The same within one slice (and in a short list): no member is checked before all are seen.
    short = [torch.ones(3, dtype=torch.float64), torch.empty(3, device="meta")]
    assert _C.flatten_into(short, [0, 3], flat) is False and not flat.any()


@needs_ext
def test_long_unflatten_moves_versions_as_the_python_path(four_threads):
    """Each destination's version moves once per one-shot unflatten, bumped on the thread
    that starts its copy (a run split between threads once), strided ones included."""
    deltas = {}
    for backend in ("ext", "python"):
        tensors, offsets, total = long_list(torch.Generator().manual_seed(1), numel=4099)
        tensors[7] = random_bits([4099 * 2], torch.float32, torch.Generator())[::2]
        src = torch.arange(float(total))
        before = [t._version for t in tensors]
        run(backend, ext.unflatten_into, src, offsets, tensors)
        deltas[backend] = [t._version - v for t, v in zip(tensors, before)]
        assert all(torch.equal(t, src[o : o + t.numel()]) for t, o in zip(tensors, offsets))
    assert deltas["ext"] == deltas["python"]
    assert set(deltas["ext"][:7] + deltas["ext"][8:]) == {1}


@needs_ext
def test_long_unflatten_into_inference_tensors(four_threads):
    """Inference tensors are bumped on the calling thread, where InferenceMode is known:
    inside it the copy runs, outside it torch's error comes before any write."""
    with torch.inference_mode():
        tensors, offsets, total = long_list(torch.Generator().manual_seed(2), numel=4099)
        src = torch.arange(float(total))
        run("ext", ext.unflatten_into, src, offsets, tensors)
    assert all(torch.equal(t, src[o : o + t.numel()]) for t, o in zip(tensors, offsets))
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        run("ext", ext.unflatten_into, torch.zeros(total), offsets, tensors)
    assert all(torch.equal(t, src[o : o + t.numel()]) for t, o in zip(tensors, offsets))


RACE = """
import sys, threading, time, torch
from zeroshard import ext
torch.set_num_threads(1)
n = 16 << 20  # 64 MB of fp32 a tensor: mmap'd by malloc, so unmapped when freed
flat = torch.ones(4 * n)
for call in ("unflatten_into", "flatten_into") * 2:
    tensors = [torch.zeros(n) for _ in range(4)]  # the list holds the only references
    offsets = [i * n for i in range(4)]
    released = threading.Event()
    def clear():
        released.wait(); time.sleep(0.003); tensors.clear()
    thread = threading.Thread(target=clear); thread.start()
    released.set()  # the copy below releases the GIL for ~50 ms
    if call == "unflatten_into":
        ext.unflatten_into(flat, offsets, tensors)
    else:
        ext.flatten_into(tensors, offsets, flat)
    thread.join()
    assert not tensors, "the other thread did not run during the copy"
print("ok")
"""


@needs_ext
def test_one_shot_calls_own_their_tensors_while_the_gil_is_released():
    """The copy runs without the GIL, so another thread may empty the caller's list
    meanwhile. The extension must hold its own references: borrowing the list's
    items (as it once did) let lst.clear() free 64 MB tensors mid-copy, and the
    copy segfaulted on unmapped memory in the first round."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ZEROSHARD_DISABLE_EXT"}
    proc = subprocess.run([sys.executable, "-c", RACE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


# --- inputs the raw copy must not take at face value (found by review, 2026-11-25) ---

CRASHERS = """
import os, torch
from zeroshard import ext
os.environ.pop("ZEROSHARD_DISABLE_EXT", None)
out = []
zero = torch._efficientzerotensor(4)  # storage says 16 bytes, its data pointer is null
target = torch.ones(4)
ext.unflatten_into(zero, [0], [target])
out.append(target.tolist() == [0.0] * 4 and ext.unflatten(zero, [0], [(4,)])[0].tolist() == [0.0] * 4)
def functional(x):  # functionalize's wrapper tensors have no storage of their own
    flat = torch.zeros(4)
    ext.flatten_into([x], [0], flat)
    dst = torch.zeros(4)
    ext.unflatten_into(x * 2, [0], [dst])
    return flat + dst
out.append(torch.func.functionalize(functional)(torch.arange(4.0)).tolist() == [0.0, 3.0, 6.0, 9.0])
os.environ["ZEROSHARD_DISABLE_EXT"] = "1"  # torch's copy_ reads a freed storage: the python path checks it too
src = torch.ones(4)
src.untyped_storage().resize_(0)
try:
    ext.flatten_into([src], [0], torch.zeros(4))
except RuntimeError as e:
    out.append("storage" in str(e))
print(out)
"""


@needs_ext
def test_zero_tensor_flat_functionalize_and_freed_sources_do_not_crash():
    """A zero tensor as flat and functionalize's wrappers segfaulted the extension (it
    copied through a null data pointer / the wrapper's empty storage); a freed source
    segfaulted the pure-torch path. Run in a child: a regression crashes it."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CRASHERS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[True, True, True]", (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_conj_and_neg_flat_and_functorch_tensors(backend):
    """flat's own conj/neg bit was ignored (the extension copied the stored bytes, not the
    values); vmap's and grad's wrappers raised NotImplementedError. All now take the
    pure-torch path, so both backends give torch's values."""
    flat = torch.zeros(2, dtype=torch.complex64).conj()
    run(backend, ext.flatten_into, [torch.tensor([1 + 2j, 3 + 4j])], [0], flat)
    assert flat.tolist() == [1 + 2j, 3 + 4j]
    neg = torch._neg_view(torch.arange(4.0))
    assert run(backend, ext.unflatten, neg, [0], [(4,)])[0].tolist() == [-0.0, -1.0, -2.0, -3.0]
    plan_flat = torch.zeros(2, dtype=torch.complex64).conj()
    with pytest.MonkeyPatch.context() as mp:
        if backend == "python":
            mp.setenv("ZEROSHARD_DISABLE_EXT", "1")
        ext.CopyPlan([torch.tensor([1 + 2j, 3 + 4j])], [0]).flatten_into(plan_flat)
        grads = torch.func.grad(lambda x: ext.unflatten(x, [0], [(4,)])[0].sum())(torch.arange(4.0))
        batched = torch.func.vmap(lambda x: ext.unflatten(x, [1], [(2,)])[0])(torch.arange(6.0).view(2, 3))
    assert plan_flat.tolist() == [1 + 2j, 3 + 4j]
    assert grads.tolist() == [0.0] * 4  # unflatten is raw data movement: no autograd history
    assert batched.tolist() == [[1.0, 2.0], [4.0, 5.0]]


@needs_ext
def test_lazy_clones_are_written_apart_and_read_in_place():
    """Writing into a lazy (copy-on-write) clone through its raw pointer also wrote the
    tensor it was cloned from; reading a lazily cloned flat copied it needlessly."""
    for how in ("one-shot", "plan"):
        x = torch.arange(4.0)
        y = torch._lazy_clone(x)
        flat = torch.full((4,), 7.0)
        if how == "one-shot":
            ext.unflatten_into(flat, [0], [y])
        else:
            ext.CopyPlan([y], [0]).unflatten_into(flat)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and y.tolist() == [7.0] * 4, how
    # A plan built before the member was lazily cloned notices the change.
    x = torch.arange(4.0)
    plan = ext.CopyPlan([x], [0])
    plan.unflatten_into(torch.zeros(4))
    y = torch._lazy_clone(x)
    plan.unflatten_into(torch.full((4,), 5.0))
    assert x.tolist() == [5.0] * 4 and y.tolist() == [0.0] * 4
    src = torch._lazy_clone(torch.arange(4.0))
    assert ext.unflatten(src, [0], [(4,)])[0].tolist() == [0.0, 1.0, 2.0, 3.0] and torch._C._is_cow_tensor(src)



@needs_ext
def test_lazy_clones_in_long_lists_checked_in_parallel_slices(four_threads):
    """Long lists are checked in slices on several threads, and torch refuses to give a
    lazy clone its own copy inside at::parallel_for: unflatten_into, and a CopyPlan either
    way (its table treats members as destinations), failed with a PyTorch INTERNAL ASSERT
    where the python path works. The clone now gets its copy on the calling thread."""
    n = 600
    offsets = [2 * i for i in range(n)]
    flat = -torch.arange(2.0 * n)
    for how in ("one-shot", "plan unflatten", "plan flatten"):
        src = torch.arange(2.0)
        members = [torch.zeros(2) for _ in range(n)]
        members[400] = torch._lazy_clone(src)
        if how == "one-shot":
            ext.unflatten_into(flat, offsets, members)
        elif how == "plan unflatten":
            ext.CopyPlan(members, offsets).unflatten_into(flat)
        else:
            out = torch.zeros(2 * n)
            ext.CopyPlan(members, offsets).flatten_into(out)
            assert out[800:802].tolist() == [0.0, 1.0] and out[:2].tolist() == [0.0, 0.0], how
            continue
        assert members[400].tolist() == [-800.0, -801.0] and src.tolist() == [0.0, 1.0], how
        assert members[3].tolist() == [-6.0, -7.0], how

@pytest.mark.parametrize("backend", BACKENDS)
def test_refused_writes_raise_before_anything_is_written(backend):
    """A member that partly overlaps its own range of flat was memcpy'd over itself
    (copy_ refuses it); an expanded or zero-tensor destination listed before a good
    one let the extension write the good one, then raise from copy_."""
    flat = torch.arange(64.0)
    with pytest.raises(RuntimeError, match="single memory location"):
        run(backend, ext.flatten_into, [flat[0:40]], [8], flat)
    with pytest.raises(RuntimeError, match="single memory location"):
        run(backend, ext.unflatten_into, flat, [0], [flat[8:48]])
    assert torch.equal(flat, torch.arange(64.0))
    run(backend, ext.flatten_into, [flat[8:48], flat[:8]], [8, 0], flat)  # exactly its own range: fine
    assert torch.equal(flat, torch.arange(64.0))
    for bad, msg in ((torch.zeros(1).expand(4), "single memory location"), (torch._efficientzerotensor(4), "ZeroTensor")):
        good = torch.zeros(4)
        with pytest.raises(RuntimeError, match=msg):
            run(backend, ext.unflatten_into, torch.arange(1.0, 9.0), [0, 4], [bad, good])
        if backend == "ext":
            with pytest.raises(RuntimeError, match=msg):
                ext.CopyPlan([bad, good], [0, 4]).unflatten_into(torch.arange(1.0, 9.0))
        assert good.tolist() == [0.0] * 4 and good._version == 0


@needs_ext
def test_tensor_without_version_counter_inside_inference_mode(four_threads):
    """A tensor given an inference tensor's place (.data of one) has no version counter
    but is_inference() is False: its bump ran on a worker thread, outside InferenceMode,
    and raised after the other member was written. The pure-torch path copies."""
    n = 1 << 18
    for how in ("one-shot", "plan"):
        with torch.inference_mode():
            x = torch.zeros(n)
        x.data = torch.zeros(n)
        a, src = torch.zeros(n), torch.arange(2.0 * n)
        with torch.inference_mode():
            if how == "one-shot":
                ext.unflatten_into(src, [0, n], [a, x])
            else:
                ext.CopyPlan([a, x], [0, n]).unflatten_into(src)
        assert torch.equal(a, src[:n]) and torch.equal(x, src[n:]), how


@pytest.mark.parametrize("backend", BACKENDS)
def test_unflatten_checks_every_shape_before_allocating(backend):
    """The extension allocated every output before any bounds check: a bad request
    allocated (here: would allocate 4 TB) before its ValueError."""
    flat = torch.zeros(4)
    with pytest.raises(ValueError, match=r"shapes\[1\].*out of bounds"):
        run(backend, ext.unflatten, flat, [0, 0], [(2,), (1 << 40,)])
    with pytest.raises(ValueError, match=r"shapes\[0\].*out of bounds"):
        run(backend, ext.unflatten, flat, [0], [(1 << 40, 1 << 40)])  # overflows int64


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_must_be_ints(backend):
    flat = torch.zeros(4)
    with pytest.raises(TypeError):
        run(backend, ext.flatten_into, [torch.ones(2)], [True], flat)
    with pytest.raises(ValueError, match="out of bounds"):
        run(backend, ext.flatten_into, [torch.ones(2)], [2**63], flat)
    with pytest.raises(TypeError):
        ext.CopyPlan([torch.ones(2)], [1.9])
    with pytest.raises(TypeError):
        ext.CopyPlan([torch.ones(2)], [True])
    assert not flat.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_first_bad_member_is_named_whatever_its_fault(backend):
    """The python path checked every member's dtype, device and storage before any
    member's range, so an out-of-bounds member 0 before a freed member 1 gave member 1's
    RuntimeError there and member 0's ValueError from the extension."""
    def error(call):  # caught here: pytest's report of a failure would print the freed tensor, and crash
        try:
            call()
        except (ValueError, RuntimeError) as e:
            return type(e).__name__, str(e)
        return None

    freed = torch.randn(2)
    freed.untyped_storage().resize_(0)
    flat = torch.zeros(10)
    got = error(lambda: run(backend, ext.flatten_into, [torch.randn(2), freed], [9, 2], flat))
    assert got == ("ValueError", "zeroshard: tensors[0] range [9, 11) is out of bounds for flat of numel 10"), got
    got = error(lambda: run(backend, ext.unflatten_into, flat, [9, 2], [torch.randn(2), freed]))
    assert got == ("ValueError", "zeroshard: outs[0] range [9, 11) is out of bounds for flat of numel 10"), got
    assert not flat.any()
    # A partial overlap with its own range of flat came from copy_, after every member's checks.
    overlapping = torch.zeros(10)
    for call in (lambda: run(backend, ext.flatten_into, [overlapping[1:4], torch.ones(2)], [0, 9], overlapping),
                 lambda: run(backend, ext.unflatten_into, overlapping, [0, 9], [overlapping[1:4], torch.ones(2)])):
        got = error(call)
        assert got is not None and got[0] == "RuntimeError" and "[0]: unsupported operation" in got[1], got
    # unflatten checked every shape's sign before any range, and the extension printed "[5, 5 + 8)".
    got = error(lambda: run(backend, ext.unflatten, flat, [0, 0], [(20,), (-1,)]))
    assert got == ("ValueError", "zeroshard: shapes[0] range [0, 20) is out of bounds for flat of numel 10"), got
    got = error(lambda: run(backend, ext.unflatten, flat, [5], [(8,)]))
    assert got == ("ValueError", "zeroshard: shapes[0] range [5, 13) is out of bounds for flat of numel 10"), got


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_range_past_int64_reads_the_same_in_both_backends(backend):
    """flatten_into/unflatten_into's extension printed off + n wrapped around (a negative end),
    the python path the true integer; unflatten's extension said "beyond int64"."""
    flat, big = torch.zeros(4), 2**63 - 2
    calls = [(lambda: run(backend, ext.flatten_into, [torch.ones(3)], [big], flat), f"tensors[0] range [{big}"),
             (lambda: run(backend, ext.unflatten_into, flat, [big], [torch.ones(3)]), f"outs[0] range [{big}"),
             (lambda: run(backend, ext.unflatten, flat, [big], [(3,)]), f"shapes[0] range [{big}"),
             (lambda: run(backend, ext.unflatten, flat, [1], [(2**62, 4)]), "shapes[0] range [1")]
    for call, start in calls:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"zeroshard: {start}, beyond int64) is out of bounds for flat of numel 4", str(e.value)


_IMPORT = """
import sys, warnings
sys.path[:0] = sys.argv[1:]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import zeroshard
print(zeroshard.__file__, zeroshard.ext_backend(), [str(w.message) for w in caught if "zeroshard" in str(w.message)])
"""


@pytest.mark.parametrize("so", ["missing", "corrupt"])
def test_an_extension_not_built_falls_back_silently_and_a_broken_one_says_so(tmp_path, so):
    """Not built (no compiler, ZEROSHARD_NO_BUILD_EXT=1): the pure-torch path, no warning. It
    used to warn on every import that _C 'failed to load (... circular import)': Python says
    a missing submodule of `from . import _C` as a plain ImportError. Built but unloadable: said."""
    import importlib.machinery
    import shutil
    import subprocess
    import sys

    pkg = tmp_path / "zeroshard"
    shutil.copytree(os.path.dirname(ext.__file__), pkg, ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    if so == "corrupt":
        (pkg / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"not an ELF file")
    site = os.path.dirname(os.path.dirname(torch.__file__))
    # -S: no site hooks, so no editable-install finder maps zeroshard to the checkout
    proc = subprocess.run([sys.executable, "-S", "-c", _IMPORT, str(tmp_path), site], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    path, backend, warned = proc.stdout.split(" ", 2)
    assert path == str(pkg / "__init__.py") and backend == "python", proc.stdout
    if so == "missing":
        assert warned.strip() == "[]", warned
    else:
        assert "zeroshard._C failed to load" in warned and "circular" not in warned, warned
