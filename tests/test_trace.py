"""The opt-in timeline tracer (zeroshard.trace): what one training step
records per unit, its Chrome-trace JSON, the PNG, and the demo's --trace."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

import zeroshard as zs
from zeroshard import trace
from models import MLP, Block

N_BLOCKS = 3


def _model():
    torch.manual_seed(0)
    return zs.FSDP(MLP(n_blocks=N_BLOCKS), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                   sharding_strategy=zs.ShardingStrategy.FULL_SHARD, backward_prefetch=zs.BackwardPrefetch.BACKWARD_PRE)


def _step(model, opt, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(4, 5, generator=g)).sum().backward()
    opt.step()
    opt.zero_grad()


def _traced_step(rank, world_size, out_dir=None):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, rank, 0)  # the first iteration records the execution order
    gc.collect()
    # The counter is per process: other tests' models still alive in this
    # worker may hold gathered units; this step must return to that level.
    baseline = zs.unsharded_tracker.live_bytes
    with trace.record() as tl:
        _step(model, opt, rank, 1)
    tl.baseline_live_bytes = baseline
    assert not trace._active
    order = [u._handle.unit_name for u in model.modules() if isinstance(u, zs.FSDP)]
    path = None
    if out_dir is not None:
        path = tl.to_chrome_trace(os.path.join(out_dir, f"step.rank{rank}.json"))
    return tl, order, path


@pytest.fixture(scope="module")
def traced(ranks, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trace"))
    return ranks.run(2, _traced_step, out), out


def test_collectives_per_unit(traced):
    results, _ = traced
    for tl, order, _ in results:
        root, inner = order[0], order[1:]
        assert len(inner) == N_BLOCKS and tl.rank in (0, 1)
        assert len(tl.select("all_gather", root)) == 1, "the root gathers once: it keeps its parameters for backward"
        for u in inner:
            assert len(tl.select("all_gather", u)) == 2, (u, tl.select("all_gather", u))  # forward + backward
        for u in order:
            assert len(tl.select("reduce_scatter", u)) == 1, u
            assert len(tl.select("forward", u)) == 1 and len(tl.select("backward", u)) == 1, u
            assert not [s for s in tl.spans if s.args.get("unfinished")]
            assert all(s.end_ns >= s.start_ns for s in tl.spans)


def test_forward_runs_between_gather_and_reshard(traced):
    results, _ = traced
    for tl, order, _ in results:
        for u in order:
            fwd = tl.select("forward", u)[0]
            gathered = tl.select("all_gather", u)[0].end_ns
            reshard = min(t for kind, unit, t, _ in tl.instants if kind == "reshard" and unit == u and t >= fwd.start_ns)
            assert gathered <= fwd.start_ns <= fwd.end_ns <= reshard, u
            # every wait on a gather ends with it
            for w in tl.select("wait", u):
                assert any(g.start_ns <= w.start_ns and g.end_ns == w.end_ns for g in tl.select("all_gather", u))
        # a unit's reshards after backward free its padded buffer; a reshard that
        # frees nothing (the root keeping its parameters after forward) draws no mark
        inner_frees = [a["freed_bytes"] for k, unit, _, a in tl.instants if k == "reshard" and unit == order[1]]
        assert inner_frees and all(b > 0 for b in inner_frees)
        assert all(a["freed_bytes"] > 0 for k, _, _, a in tl.instants if k == "reshard")
        assert len([1 for k, unit, _, _ in tl.instants if k == "reshard" and unit == order[0]]) == 1


def test_backward_prefetch_overlaps(traced):
    results, _ = traced
    for tl, order, _ in results:
        # backward runs in reverse forward order: root, blocks.2, blocks.1, blocks.0
        backward_order = [order[0], *reversed(order[1:])]
        for cur, nxt in zip(backward_order, backward_order[1:]):
            issued = tl.select("all_gather", nxt)[-1].start_ns  # its backward all-gather
            cur_bwd = tl.select("backward", cur)[0]
            assert issued < cur_bwd.end_ns, f"{nxt}'s backward all-gather was not prefetched during {cur}'s backward"
        # a reduce-scatter is issued after its unit's backward and completes by the end of the step
        for u in order:
            rs, bwd = tl.select("reduce_scatter", u)[0], tl.select("backward", u)[0]
            assert rs.start_ns >= bwd.end_ns


def test_counter_returns_to_zero(traced):
    results, _ = traced
    for tl, order, _ in results:
        live = [b for _, b in tl.counters]
        assert live and max(live) > tl.baseline_live_bytes
        assert live[-1] == tl.baseline_live_bytes, live
        times = [t for t, _ in tl.counters]
        assert times == sorted(times)


def test_chrome_json_and_merge(traced, tmp_path):
    results, _ = traced
    paths = [p for _, _, p in results]
    for rank, p in enumerate(paths):
        with open(p) as f:
            doc = json.load(f)
        events = doc["traceEvents"]
        phases = {e["ph"] for e in events}
        assert {"X", "i", "C", "M"} <= phases
        cats = {e["cat"] for e in events if e["ph"] == "X"}
        assert cats == {"forward", "backward", "wait", "all_gather", "reduce_scatter"}
        assert {e["pid"] for e in events} == {rank}
        tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        assert {"compute", "all_gather", "reduce_scatter"} <= tracks
        for e in events:
            if e["ph"] == "X":
                assert e["dur"] >= 0 and e["ts"] >= 0 and "unit" in e["args"]
    out = trace.merge(paths, tmp_path / "merged.json")
    with open(out) as f:
        merged = json.load(f)["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    assert len(merged) == sum(len(json.load(open(p))["traceEvents"]) for p in paths)


def test_overlapping_spans_get_their_own_lane():
    tl = trace.Timeline(spans=[trace.Span("all_gather", "a", 0, 10), trace.Span("all_gather", "b", 5, 15),
                               trace.Span("forward", "r", 0, 20), trace.Span("forward", "c", 2, 8)])
    xs = {e["name"]: e["tid"] for e in tl.to_chrome_events() if e["ph"] == "X"}
    assert xs["all_gather a"] != xs["all_gather b"], "two gathers in flight overlap without nesting"
    assert xs["forward r"] == xs["forward c"], "nested spans share their track"


def test_a_model_with_hundreds_of_reductions_in_flight_exports_each_on_its_own_track():
    """All reduce-scatters finish at the end of backward, so each one in flight takes a lane of
    its own: from the 101st, tid 100·track + lane ran past the last track (IndexError in
    to_chrome_trace, plot and demo --trace), and the 100th compute lane was drawn as all_gather."""
    spans = [trace.Span("reduce_scatter", f"u{i}", i, 1000 + i) for i in range(150)]
    spans += [trace.Span("forward", f"f{i}", i, 2000 + i) for i in range(120)]
    events = trace.Timeline(spans=spans).to_chrome_events()
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    tids = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    assert len(set(tids.values())) == 270
    assert all(names[tids[f"reduce_scatter u{i}"]].startswith("reduce_scatter") for i in range(150))
    assert all(names[tids[f"forward f{i}"]].startswith("compute") for i in range(120))
    assert names[tids["forward f119"]] == "compute #120"


def _untraced_step(rank, world_size):
    def boom(*a, **k):
        raise AssertionError("a trace function ran with no recorder active")

    names = ["span_begin", "span_end", "span", "instant", "counter", "unsharded", "gather_waited", "resharded", "now"]
    saved = {n: getattr(trace, n) for n in names}
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        for n in names:
            setattr(trace, n, boom)
        for step in range(2):
            _step(model, opt, rank, step)
    finally:
        for n, f in saved.items():
            setattr(trace, n, f)
    with trace.record() as tl:
        pass
    return tl.spans, tl.instants, tl.counters


def test_nothing_recorded_without_a_recorder(ranks):
    for spans, instants, counters in ranks.run(2, _untraced_step):
        assert spans == instants == counters == []


def test_png(traced, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (optional: pip install matplotlib)", exc_type=ImportError)
    results, _ = traced
    tl = results[0][0]
    out = tl.plot(tmp_path / "step.png")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    merged = trace.merge([p for _, _, p in results], tmp_path / "merged.json")
    assert os.path.getsize(trace.plot_trace(merged, tmp_path / "merged.png")) > 10_000


def test_plot_without_matplotlib_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        trace.Timeline(spans=[trace.Span("forward", "u", 0, 1)]).plot(tmp_path / "x.png")


def test_demo_writes_the_trace(tmp_path):
    out = tmp_path / "t.json"
    res = subprocess.run(
        [sys.executable, "-m", "zeroshard", "demo", "--steps", "2", "--chars", "20000", "--no-compare", "--trace", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    with open(out) as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert {"forward", "backward", "all_gather", "reduce_scatter"} <= {e.get("cat") for e in events}
    assert str(out) in res.stdout
    for r in (0, 1):
        assert (tmp_path / f"t.rank{r}.json").exists()


def _hybrid_spans(rank, world_size):
    torch.manual_seed(0)
    model = zs.FSDP(MLP(n_blocks=N_BLOCKS), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                    sharding_strategy=zs.ShardingStrategy.HYBRID_SHARD, fsdp_group_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, rank, 0)
    with trace.record() as tl, zs.comm_stats() as stats:
        _step(model, opt, rank, 1)
    kinds = {}
    for s in tl.spans:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return kinds, dict(stats.calls)


def test_hybrid_replica_all_reduce_is_on_the_timeline(ranks):
    """The replica all-reduce after each reduce-scatter had no span: its time was nowhere."""
    for kinds, calls in ranks.run(4, _hybrid_spans):
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert kinds.get(kind) == calls[kind], (kind, kinds, calls)


class _Student(torch.nn.Module):
    """A wrapped teacher of the same class runs inside the student's forward."""

    def __init__(self, teacher):
        super().__init__()
        self.net, self.teacher = _model(), teacher

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        return ((self.net(x) - target) ** 2).mean()


def _two_models(rank, world_size):
    student = _Student(_model())
    opt = torch.optim.SGD(student.net.parameters(), lr=0.1)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    student(x).backward()  # the first iteration records each model's execution order
    opt.step()
    with trace.record() as tl:
        student(x).backward()
    names = [u._handle.unit_name for m in (student.net, student.teacher) for u in m.modules() if isinstance(u, zs.FSDP)]
    return {(s.kind, s.unit): s.args.get("unfinished", False) for s in tl.spans}, names


def test_two_models_with_the_same_unit_names_keep_their_own_spans(ranks):
    """Spans were keyed by unit name, and two models of one class share every name:
    the teacher's root forward, run inside the student's, ended the student's open
    root span, so the student's was lost (and its name was ambiguous anyway)."""
    for spans, names in ranks.run(2, _two_models):
        assert names[: N_BLOCKS + 1] == names[N_BLOCKS + 1 :]  # the same names in both models
        root = names[0]
        assert ("forward", root) in spans and ("forward", root + " #2") in spans, sorted(spans)
        for name in names[1 : N_BLOCKS + 1]:
            assert {("forward", name), ("forward", name + " #2")} <= set(spans), sorted(spans)
            # Names follow first appearance: the teacher's forward runs first, so the
            # student is "#2"; only the student has a backward.
            assert ("backward", name + " #2") in spans and ("backward", name) not in spans, sorted(spans)
        assert not any(spans.values()), spans  # every span ended where it should, none at the recording's end
    # The PNG's bar labels drop the class but keep the number ("blocks.0" and "blocks.0" before).
    assert trace._short("blocks.0 (Block) #2") == "blocks.0 #2" and trace._short("blocks.0 (Block)") == "blocks.0"
