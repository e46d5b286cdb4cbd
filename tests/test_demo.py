"""The main job runs end to end: `python -m zeroshard demo` trains on 2 CPU
ranks, its loss falls, and it matches torch FSDP1 bit for bit. Its per-step
report is a tqdm bar on a terminal and plain lines otherwise (or without
tqdm), and shows what ZeRO-3 vs ZeRO-2 keep gathered after forward."""
from __future__ import annotations

import io
import re
import subprocess
import sys

from zeroshard.demo import Progress

LINE = re.compile(r"unsharded after forward +([\d.]+) MB, peak +([\d.]+) MB +sent +([\d.]+) MB")


def test_demo_trains_and_matches_torch_fsdp():
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "demo", "--steps", "4", "--chars", "20000"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("loss") >= 4
    assert "losses bit-identical" in out.stdout, out.stdout
    # Not a terminal: plain lines, one per step. FULL_SHARD (ZeRO-3) frees every
    # non-root unit after forward, so less is gathered then than at the peak.
    steps = [tuple(map(float, m.groups())) for m in LINE.finditer(out.stdout)]
    assert len(steps) == 4, out.stdout
    assert all(0 < after < peak and sent > 0 for after, peak, sent in steps), steps


def test_demo_progress_bar_on_three_ranks_zero2():
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "demo", "--steps", "2", "--chars", "20000", "--world-size", "3",
         "--strategy", "SHARD_GRAD_OP", "--prefetch", "BACKWARD_POST", "--no-compare", "--progress", "bar"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sharded over 3 ranks, SHARD_GRAD_OP" in out.stdout
    assert not LINE.search(out.stdout), "a bar was asked for, not lines"
    bar = out.stderr.replace("\r", "\n")
    assert "zeroshard SHARD_GRAD_OP: 100%" in bar and "2/2" in bar, bar
    final = [ln for ln in bar.splitlines() if "2/2" in ln][-1]
    fields = dict(re.findall(r"(\w+)=([\d./]+)", final))
    assert set(fields) >= {"loss", "tok_s", "unsharded_MB", "sent_MB"}, final
    after, peak = map(float, fields["unsharded_MB"].split("/"))
    assert after == peak > 0, final  # SHARD_GRAD_OP (ZeRO-2) keeps every unit gathered until backward
    assert float(fields["sent_MB"]) > 0


def test_progress_falls_back_to_lines(monkeypatch, capsys):
    # Not a terminal: lines even though tqdm is installed.
    p = Progress(2, "x", "auto", stream=io.StringIO())
    assert p.bar is None
    p.update("step 0  loss 1.0", loss="1.0")
    # A bar asked for but tqdm missing: lines too.
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `from tqdm import tqdm` raise ImportError
    q = Progress(2, "x", "bar", stream=io.StringIO())
    assert q.bar is None
    q.update("step 1  loss 0.5", loss="0.5")
    q.close()
    assert capsys.readouterr().out.splitlines() == ["step 0  loss 1.0", "step 1  loss 0.5"]


def test_progress_bar_when_asked():
    stream = io.StringIO()
    p = Progress(2, "zeroshard FULL_SHARD", "bar", stream=stream)
    assert p.bar is not None
    p.update("unused", loss="1.0000", sent_MB="2.00")
    p.update("unused", loss="0.5000", sent_MB="2.00")
    p.close()
    assert "2/2" in stream.getvalue() and "loss=0.5000" in stream.getvalue()


def test_cli_names_its_commands():
    out = subprocess.run([sys.executable, "-m", "zeroshard"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "demo" in out.stderr and not out.stdout
    # --help is no error (it exited 2, like a wrong command)
    out = subprocess.run([sys.executable, "-m", "zeroshard", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout


def test_demo_counts_the_models_parameters_once():
    """NO_SHARD printed the count times the world size (702k for a 351k model on 2 ranks)."""
    from zeroshard.demo import CharGPT

    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "demo", "--steps", "3", "--chars", "20000", "--strategy", "NO_SHARD",
         "--no-compare"], capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    said = re.search(r"(\d+)k parameters \(sharded over 2 ranks, NO_SHARD\).* vocab (\d+)", out.stdout)
    assert said, out.stdout
    n = sum(p.numel() for p in CharGPT(int(said.group(2))).parameters())
    assert said.group(1) == f"{n / 1e3:.0f}", (said.group(0), n)
