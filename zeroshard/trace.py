"""An opt-in timeline of the ZeRO-3 lifecycle, per rank.

    with zeroshard.trace.record() as tl:
        loss = model(x).sum(); loss.backward(); opt.step()
    tl.to_chrome_trace(f"step.rank{rank}.json")   # open in ui.perfetto.dev
    tl.plot("step.png")                            # needs matplotlib

Recorded, with ``time.perf_counter_ns`` timestamps relative to the start of
the block, and named by each unit's ``unit_name`` (units of a second model
with the same names get " #2", and so on):

* ``all_gather`` spans (track "all_gather"): from issuing a unit's
  all-gather (``FlatParamHandle.unshard``) to its completion (the end of the
  wait in ``wait_unshard``); a prefetched gather starts well before the unit
  needs it, which is what makes the overlap with compute visible.
* ``wait`` spans (track "compute"): the time Python actually blocked on it.
* ``forward`` / ``backward`` spans (track "compute"): a unit's compute with
  its parameters gathered, from the end of its pre-forward (pre-backward)
  unshard to its post-forward (post-backward) hook; a parent unit's span
  contains its children's.
* ``reduce_scatter`` spans (track "reduce_scatter"; ``all_reduce`` for
  NO_SHARD): from issue in ``reduce.start_reduction`` to completion in
  ``PendingReduction.settle`` (once the next reduction is issued, or at the
  end of backward); hybrid sharding adds an ``all_reduce`` span on the same
  track for the replica all-reduce that follows, open until the end of
  backward. With ``bucket_cap_mb`` each unit in a bucket has a span from the
  bucket's launch. Spans that overlap get a lane (a tid) each.
* ``reshard`` instants (track "compute") with the bytes freed, and a counter
  of live unsharded bytes sampled at every unshard and reshard.

The engine calls in here only behind ``if trace._active:``, an empty-list
test, so without a recorder the cost is one attribute load per hook point.
This module is a leaf: it imports only the standard library (and matplotlib,
lazily, for :meth:`Timeline.plot`).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field

__all__ = ["record", "Timeline", "Span", "merge", "plot_trace"]

TRACKS = ("compute", "all_gather", "reduce_scatter")
_TRACK_OF = {"forward": "compute", "backward": "compute", "wait": "compute", "reshard": "compute",
             "all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "reduce_scatter"}
COUNTER = "live unsharded bytes"
LANES = 1_000_000  # tids per track: tid = LANES·track + lane (one lane per reduction in flight: units can be many)


@dataclass
class Span:
    kind: str
    unit: str
    start_ns: int  # relative to the start of the recording
    end_ns: int
    args: dict = field(default_factory=dict)

    @property
    def track(self) -> str:
        return _TRACK_OF.get(self.kind, "compute")


@dataclass
class Timeline:
    """What one rank recorded; picklable (plain data)."""

    rank: int = 0
    start_ns: int = 0  # perf_counter_ns at the start
    start_unix_ns: int = 0  # the same instant on the wall clock (aligns ranks in merge)
    spans: list = field(default_factory=list)
    instants: list = field(default_factory=list)  # (kind, unit, t_ns, args)
    counters: list = field(default_factory=list)  # (t_ns, live_bytes)
    _open: dict = field(default_factory=dict, repr=False)  # (kind, unit key) -> (start_ns, args, name)
    _names: dict = field(default_factory=dict, repr=False)  # id(handle) -> (its unit_name, the name shown)
    _seen: dict = field(default_factory=dict, repr=False)  # unit_name -> handles recorded under it

    # ----------------------------------------------------------- querying
    def select(self, kind: str | None = None, unit: str | None = None) -> list[Span]:
        return [s for s in self.spans if (kind is None or s.kind == kind) and (unit is None or s.unit == unit)]

    def units(self) -> list[str]:
        return list(dict.fromkeys(s.unit for s in self.spans))

    # ----------------------------------------------------------- export
    def to_chrome_events(self) -> list[dict]:
        """Chrome-trace events: pid = rank, one tid per track (more if spans
        on a track overlap without nesting, e.g. two gathers in flight)."""
        pid = self.rank
        events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {self.rank}"}},
                  {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": self.rank}}]
        named = set()
        for span, tid, _depth in _layout(self.spans):
            if tid not in named:
                named.add(tid)
                track, lane = TRACKS[tid // LANES], tid % LANES
                label = track if lane == 0 else f"{track} #{lane + 1}"
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
            events.append({"ph": "X", "name": f"{span.kind} {span.unit}", "cat": span.kind, "pid": pid, "tid": tid,
                           "ts": span.start_ns / 1e3, "dur": (span.end_ns - span.start_ns) / 1e3,
                           "args": {"unit": span.unit, **span.args}})
        for kind, unit, t, args in self.instants:
            events.append({"ph": "i", "s": "t", "name": f"{kind} {unit}", "cat": kind, "pid": pid,
                           "tid": TRACKS.index(_TRACK_OF.get(kind, "compute")) * LANES, "ts": t / 1e3,
                           "args": {"unit": unit, **args}})
        for t, live in self.counters:
            events.append({"ph": "C", "name": COUNTER, "cat": "memory", "pid": pid, "tid": 0, "ts": t / 1e3,
                           "args": {"bytes": live}})
        return events

    def to_chrome_trace(self, path) -> str:
        """Write Chrome-trace / Perfetto JSON (open in ui.perfetto.dev or chrome://tracing)."""
        doc = {"traceEvents": self.to_chrome_events(), "displayTimeUnit": "ms",
               "otherData": {"zeroshard_rank": self.rank, "start_unix_ns": self.start_unix_ns}}
        _write_json(doc, path)
        return str(path)

    def plot(self, path) -> str:
        """A PNG: Gantt-style rows per track (spans colored by kind, labeled by
        unit) above the live-unsharded-bytes curve. Needs matplotlib."""
        return _plot(self.to_chrome_events(), path, title=f"zeroshard timeline, rank {self.rank}")


# ------------------------------------------------------------------ recording
_active: list[Timeline] = []


@contextlib.contextmanager
def record(rank: int | None = None):
    """Record the lifecycle events of this process (one rank) inside the block."""
    if rank is None:
        rank = _current_rank()
    tl = Timeline(rank=rank, start_unix_ns=time.time_ns(), start_ns=time.perf_counter_ns())
    _active.append(tl)
    try:
        yield tl
    finally:
        _active.remove(tl)
        end = time.perf_counter_ns() - tl.start_ns
        for (kind, _key), (start, args, name) in tl._open.items():  # e.g. an exception mid-step
            tl.spans.append(Span(kind, name, start, end, {**args, "unfinished": True}))
        tl._open.clear()
        tl.spans.sort(key=lambda s: (s.start_ns, -s.end_ns))


def _current_rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001 (the rank is only a label)
        return 0


def now() -> int:
    return time.perf_counter_ns()


def _label(tl: Timeline, unit) -> tuple:
    """(key, shown name) of ``unit`` in this recording: a plain name, or a unit's handle
    (anything with a ``unit_name``). Handles that share a name, as two models of one
    class do, get their own open spans and names ("blocks.0 (Block) #2"): one model
    run inside another's forward (a teacher in a student's) no longer ends, or loses,
    the other's span of the same name."""
    if isinstance(unit, str):
        return unit, unit
    base = unit.unit_name
    known = tl._names.get(id(unit))
    if known is None or known[0] != base:  # new, or renamed (a root's lazy init names units by path)
        n = tl._seen[base] = tl._seen.get(base, 0) + 1
        known = tl._names[id(unit)] = (base, base if n == 1 else f"{base} #{n}")
    return id(unit), known[1]


def span_begin(kind: str, unit, t: int | None = None, **args):
    t = time.perf_counter_ns() if t is None else t
    for tl in _active:
        key, name = _label(tl, unit)
        tl._open[(kind, key)] = (t - tl.start_ns, args, name)


def span_end(kind: str, unit, t: int | None = None):
    """End the open span of (kind, unit); a no-op when none is open."""
    t = time.perf_counter_ns() if t is None else t
    for tl in _active:
        opened = tl._open.pop((kind, _label(tl, unit)[0]), None)
        if opened is not None:
            tl.spans.append(Span(kind, opened[2], opened[0], t - tl.start_ns, opened[1]))


def span(kind: str, unit, start: int, end: int | None = None, **args):
    """A span whose start was taken earlier (``now()``)."""
    end = time.perf_counter_ns() if end is None else end
    for tl in _active:
        tl.spans.append(Span(kind, _label(tl, unit)[1], start - tl.start_ns, end - tl.start_ns, args))


def instant(kind: str, unit, **args):
    t = time.perf_counter_ns()
    for tl in _active:
        tl.instants.append((kind, _label(tl, unit)[1], t - tl.start_ns, args))


def counter(live_bytes: int):
    t = time.perf_counter_ns()
    for tl in _active:
        tl.counters.append((t - tl.start_ns, live_bytes))


# Composite calls, so each engine hook point stays one line.
def unsharded(unit, live_bytes: int, gathered: bool):
    if gathered:  # an all-gather was issued (not NO_SHARD's local cast)
        span_begin("all_gather", unit)
    counter(live_bytes)


def gather_waited(unit, wait_start: int):
    t = time.perf_counter_ns()
    if wait_start:  # 0 when the recording began during the wait
        span("wait", unit, wait_start, t)
    span_end("all_gather", unit, t)


def resharded(unit, freed_bytes: int, live_bytes: int):
    """A unit pointed back at its shard: a "reshard" mark only where it freed its
    full parameters (ZeRO-2 after forward and the root keep them: no mark)."""
    span_end("all_gather", unit)  # a prefetch nobody consumed completes here
    if freed_bytes:
        instant("reshard", unit, freed_bytes=freed_bytes)
    counter(live_bytes)


# ------------------------------------------------------------------ layout
def _layout(spans):
    """Yield (span, tid, depth): spans of one track share a tid while they
    nest properly (Chrome-trace requires it); a span that overlaps another
    without nesting goes to the next lane of its track (tid = LANES·track + lane)."""
    out = []
    for ti, track in enumerate(TRACKS):
        lanes: list[list[int]] = []  # per lane, the stack of open end times
        for s in sorted((s for s in spans if s.track == track), key=lambda s: (s.start_ns, -s.end_ns)):
            for li, stack in enumerate(lanes):
                while stack and stack[-1] <= s.start_ns:
                    stack.pop()
                if not stack or stack[-1] >= s.end_ns:
                    break
            else:
                lanes.append([])
                li, stack = len(lanes) - 1, lanes[-1]
            out.append((s, LANES * ti + li, len(stack)))
            stack.append(s.end_ns)
    return out


# ------------------------------------------------------------------ files
def _write_json(doc, path):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def merge(paths, out) -> str:
    """Merge per-rank trace files into one (one process per rank). Ranks are
    aligned by the wall-clock instant each recording started (same host, or
    synchronized clocks)."""
    docs = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            docs.append(json.load(f))
    starts = [d.get("otherData", {}).get("start_unix_ns", 0) for d in docs]
    t0 = min(starts) if starts else 0
    events = []
    for doc, start in zip(docs, starts):
        shift = (start - t0) / 1e3
        for e in doc["traceEvents"]:
            if "ts" in e:
                e = {**e, "ts": e["ts"] + shift}
            events.append(e)
    _write_json({"traceEvents": events, "displayTimeUnit": "ms",
                 "otherData": {"start_unix_ns": t0, "merged_from": [str(p) for p in paths]}}, out)
    return str(out)


def plot_trace(json_path, png_path) -> str:
    """Plot a (possibly merged) Chrome-trace file written by this module."""
    with open(json_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    return _plot(events, png_path, title=f"zeroshard timeline ({os.path.basename(str(json_path))})")


# ------------------------------------------------------------------ plotting
_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "wait": "#C44E52", "all_gather": "#55A868",
           "reduce_scatter": "#8172B3", "all_reduce": "#937860"}


def _short(unit: str) -> str:
    """A bar's label: the unit's path without its class, keeping a second model's " #2"."""
    path, _, rest = unit.partition(" (")
    number = rest.rpartition(") #")[2] if ") #" in rest else ""
    return f"{path} #{number}" if number else path


def _plot(events, path, title="zeroshard timeline") -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise RuntimeError("zeroshard.trace: plotting needs matplotlib; run `pip install matplotlib` "
                           "(the JSON trace works without it).") from e
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    # Rows: (rank, tid, nesting depth), so a parent's span and its children's don't overdraw.
    by_thread: dict = {}
    for e in spans:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    rows, placed = [], []
    for key in sorted(by_thread):
        stack, depth_of = [], []
        for e in sorted(by_thread[key], key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            depth_of.append((e, len(stack)))
            stack.append(e["ts"] + e["dur"])
        for depth in range(max(d for _, d in depth_of) + 1):
            label = f"rank {key[0]} {names.get(key, key[1])}" + (f" / {depth}" if depth else "")
            rows.append(label)
            placed += [(len(rows) - 1, e) for e, d in depth_of if d == depth]
    counters: dict = {}
    for e in events:
        if e.get("ph") == "C":
            counters.setdefault(e["pid"], []).append((e["ts"], e["args"]["bytes"]))
    reshards = [e for e in events if e.get("ph") == "i" and e.get("cat") == "reshard"]

    fig, (ax, axm) = plt.subplots(2, 1, figsize=(14, 2.2 + 0.45 * len(rows) + 2.5), sharex=True,
                                  gridspec_kw={"height_ratios": [max(len(rows), 1) * 0.45 + 0.8, 2.2]})
    to_ms = 1e-3
    t_end = max([e["ts"] + e["dur"] for e in spans] + [t for c in counters.values() for t, _ in c] + [1.0])
    for row, e in placed:
        x0, w = e["ts"] * to_ms, max(e["dur"] * to_ms, t_end * to_ms * 1e-4)
        ax.barh(row, w, left=x0, height=0.7, color=_COLORS.get(e.get("cat"), "#999999"), edgecolor="white", linewidth=0.3)
        if w > t_end * to_ms * 0.035:  # label when the bar is wide enough
            ax.text(x0 + w / 2, row, _short(e["args"].get("unit", "")), ha="center", va="center", fontsize=6.5, color="white",
                    clip_on=True)
    for e in reshards:
        row = next((i for i, r in enumerate(rows) if r == f"rank {e['pid']} {names.get((e['pid'], e['tid']), 'compute')}"), None)
        if row is not None:
            ax.plot([e["ts"] * to_ms], [row - 0.45], marker="v", color="black", markersize=3)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title)
    present = {e.get("cat") for e in spans}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items() if k in present]
              + [plt.Line2D([], [], marker="v", color="black", linestyle="", label="reshard")],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=7, fontsize=7, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    for pid, samples in sorted(counters.items()):
        samples.sort()
        xs = [t * to_ms for t, _ in samples] + [t_end * to_ms]
        ys = [b / 1e6 for _, b in samples]
        axm.step(xs, ys + ys[-1:], where="post", label=f"rank {pid}")
    axm.set_ylabel("live unsharded MB")
    axm.set_xlabel("time since the start of the recording (ms)")
    axm.grid(alpha=0.3)
    if counters:
        axm.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return str(path)
