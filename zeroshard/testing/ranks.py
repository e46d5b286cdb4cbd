"""Rank launchers for multi-process tests: N gloo ranks on this machine, each
run under a deadline.

This is the plumbing of FSDP testing: a sharding engine is only exercised by
several ranks exchanging collectives, and a bug in one often shows up as a
hang (a collective one rank never joins). ``spawn`` starts fresh ranks for one
function; ``RankPool`` keeps ranks alive across many small tests (importing
torch costs seconds per process). Every call has a deadline: a hung collective
fails the call, naming the ranks still running, instead of blocking CI.
Used by zeroshard's own tests, the demo, the examples and the benchmarks.
"""
from __future__ import annotations

import gc
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(value) -> tuple[str, object]:
    """("ok", the value pickled), or ("error", why) if it cannot cross to the
    parent: a queue pickles in a background thread, where a failure is lost
    and the parent would wait for a result that never comes."""
    try:
        return "ok", pickle.dumps(value)
    except Exception as e:  # noqa: BLE001
        return "error", (f"the function returned a value that cannot be sent back to the parent ({e!r}). "
                         "Fix: return plain data (numbers, strings, tensors, lists, dicts).", None)


def _failure() -> tuple[str, object]:
    """("error", (traceback text, the exception pickled if it can be, for the parent to re-raise))."""
    exc = sys.exc_info()[1]
    try:
        blob = pickle.dumps(exc) if isinstance(exc, AssertionError) else None
    except Exception:  # noqa: BLE001
        blob = None
    return "error", (traceback.format_exc(), blob)


def _raise_failures(name: str, errors: dict, world_size: int):
    """Every failing rank's traceback in one error. If every one of them failed
    an assertion (a ParityError included), the lowest rank's assertion is
    re-raised as itself, the tracebacks added as notes, so that pytest and
    hypothesis see the real failure instead of a RuntimeError."""
    msg = "\n".join(f"--- rank {r} ---\n{errors[r][0]}" for r in sorted(errors))
    where = f"{name} failed on rank(s) {sorted(errors)} of {world_size}"
    if all(blob is not None for _, blob in errors.values()):
        try:
            exc = pickle.loads(errors[min(errors)][1])
        except Exception:  # noqa: BLE001 - an assertion class whose __init__ takes other arguments
            exc = None
        if exc is not None:
            exc.add_note(f"{where}:\n{msg}")
            raise exc
    raise RuntimeError(f"{where}:\n{msg}")


def _check_sendable(fn, args, who: str) -> bytes:
    """Refuse, in the parent, what the ranks could not receive; else the pickled ``(fn, args)``."""
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"zeroshard.testing.{who}: {getattr(fn, '__name__', fn)} is defined in an interactive "
                         "__main__ (python -c, stdin, a notebook), which the ranks cannot import. Fix: define it "
                         "in a file and import it from there.")
    try:
        return pickle.dumps((fn, args))
    except Exception as e:
        raise ValueError(f"zeroshard.testing.{who}: {getattr(fn, '__name__', fn)} or its arguments cannot be "
                         f"sent to the ranks ({e}). Fix: use module-level functions, not lambdas or closures.") from e


def _worker(rank, world_size, port, payload, results, pg_timeout, threads):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        # Unpickled here, not by multiprocessing before the process runs: an object that cannot be
        # rebuilt on a rank (a __setstate__ that raises, a module missing there) is then reported
        # with its traceback instead of as an exit code.
        fn, args = pickle.loads(payload)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        results.put((rank, *_result(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        results.put((rank, *_failure()))
        raise SystemExit(1)
    finally:
        _teardown(dist)


def _teardown(dist) -> None:
    """Destroy the group once nothing holds it: models freed only by the cyclic collector (torch
    FSDP1's are) kept it alive into interpreter shutdown, where gloo's threads could abort a rank
    that had reported ("terminate called without an active exception"). No barrier first: a
    test's ranks may have diverged on purpose (a rank with one step more must see its peer gone)."""
    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()


def _check_world_size(world_size, what: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"zeroshard.testing.{what}: world_size must be an int >= 1, got {world_size!r} "
                         "(with 0 nothing would run and the result would be empty).")


def spawn(fn, world_size: int, *args, timeout: float = 180.0, pg_timeout: float = 60.0, threads: int = 1):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    ``fn`` must be importable (module level); it and ``args`` reach each rank
    pickled (tensors are copies, not shared memory). Returns the list of its return
    values by rank. Raises RuntimeError with each failing rank's traceback, or
    TimeoutError after ``timeout`` seconds naming the ranks still running.
    (If every failing rank failed an assertion, a ``ParityError`` say, that
    assertion is raised instead, with every rank's traceback as a note.)
    """
    _check_world_size(world_size, "spawn")
    payload = _check_sendable(fn, args, "spawn")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, payload, results, pg_timeout, threads), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs, errors, gone = {}, {}, set()
    deadline = time.monotonic() + timeout
    while len(outputs) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            # Exited without a result (a failure, or os._exit(0)): code 0 only when already seen exited
            # at the last empty wait, so that a result it put just before exiting is read first.
            ended = {r for r, p in enumerate(procs) if p.exitcode is not None and r not in errors and r not in outputs}
            for r in sorted(ended):
                if procs[r].exitcode != 0 or r in gone:
                    errors[r] = (f"rank {r} exited with code {procs[r].exitcode} without a report", None)
            gone = ended
            continue
        if status == "ok":
            outputs[rank] = pickle.loads(value)
        else:
            errors[rank] = value
    for p in procs:
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    for p in procs:  # a rank that reported but exits slowly is stopped, not failed
        if p.is_alive():
            p.kill()
    if errors:
        _raise_failures(f"spawn({getattr(fn, '__name__', fn)}, world_size={world_size})", errors, world_size)
    if len(outputs) < world_size:
        missing = sorted(set(range(world_size)) - set(outputs))
        raise TimeoutError(
            f"spawn({getattr(fn, '__name__', fn)}, world_size={world_size}) timed out after {timeout:.0f}s; "
            f"ranks without a result: {missing} (a hung collective?)"
        )
    return [outputs[r] for r in range(world_size)]


def _pool_worker(rank, world_size, port, tasks, results, pg_timeout, threads):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
    while True:
        try:
            task = tasks.get()
        except Exception:  # noqa: BLE001 - the function or its arguments cannot be unpickled here
            results.put((None, rank, *_failure()))  # (None: the task that is running)
            continue
        if task is None:
            break
        task_id, fn, args = task
        try:
            results.put((task_id, rank, *_result(fn(rank, world_size, *args))))
        except BaseException:  # noqa: BLE001
            results.put((task_id, rank, *_failure()))
    _teardown(dist)


class RankPool:
    """``world_size`` long-lived gloo ranks that run one function at a time.

    Starting a rank costs seconds (importing torch); a pool pays it once and
    runs many small tests in it. A task after which some rank does not report
    (a hang or a crash) leaves collectives unmatched, so the pool is then shut
    down and ``broken``; the next ``run`` starts fresh ranks (a hypothesis
    search keeps going after a hung example). So does any failed task: a rank
    that raised may have left a collective unmatched, or gloo's group unusable.
    """

    def __init__(self, world_size: int, pg_timeout: float = 60.0, threads: int = 1):
        _check_world_size(world_size, "RankPool")
        self.world_size, self._settings = world_size, (pg_timeout, threads)
        self._start()

    def _start(self):
        pg_timeout, threads = self._settings
        world_size = self.world_size
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_pool_worker, args=(r, world_size, port, self.tasks[r], self.results, pg_timeout, threads), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False
        self._next_id = 0

    def run(self, fn, *args, timeout: float = 120.0):
        """Run ``fn(rank, world_size, *args)`` on every rank; results by rank.
        Failures are raised as ``spawn`` raises them."""
        _check_sendable(fn, args, "RankPool")  # a queue pickles in a background thread: it would never arrive
        if self.broken:
            self._start()
        self._next_id += 1
        task_id = self._next_id
        for q in self.tasks:
            q.put((task_id, fn, args))
        outputs, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(outputs) + len(errors) < self.world_size:
            if deadline - time.monotonic() <= 0 or (errors and not any(p.is_alive() for p in self.procs)):
                break
            try:
                tid, rank, status, value = self.results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if any(p.exitcode is not None for p in self.procs):
                    break
                continue
            if tid == task_id and status == "ok":
                outputs[rank] = pickle.loads(value)
            elif tid in (task_id, None):
                errors[rank] = value
            if errors and len(outputs) + len(errors) < self.world_size:
                # The other ranks may be blocked in a collective the failed
                # rank never joined; give them a moment, then stop waiting.
                deadline = min(deadline, time.monotonic() + 5.0)
        name = getattr(fn, "__name__", str(fn))
        for r, p in enumerate(self.procs):  # a rank that died (a signal, os._exit) reports nothing: say how it ended
            if p.exitcode is not None and r not in outputs and r not in errors:
                errors[r] = (f"rank {r} exited with code {p.exitcode} without a report", None)
        if errors or len(outputs) < self.world_size or any(p.exitcode is not None for p in self.procs):
            # Some rank is stuck (its collectives unmatched), gone, or failed (maybe inside a collective,
            # which leaves gloo's group unusable): the next run starts afresh instead of failing on it.
            self.close(force=True)
        if errors:
            _raise_failures(name, errors, self.world_size)
        if len(outputs) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(outputs))
            raise TimeoutError(f"{name} on {self.world_size} ranks timed out after {timeout:.0f}s; ranks without a result: {missing}")
        return [outputs[r] for r in range(self.world_size)]

    def close(self, force: bool = False):
        self.broken = True
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
