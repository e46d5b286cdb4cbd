"""The main job runs end to end: `python -m zeroshard demo` trains on 2 CPU
ranks, its loss falls, and it matches torch FSDP1 bit for bit."""
from __future__ import annotations

import subprocess
import sys


def test_demo_trains_and_matches_torch_fsdp():
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "demo", "--steps", "4", "--chars", "20000"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("loss") >= 4
    assert "losses bit-identical" in out.stdout, out.stdout


def test_cli_names_its_commands():
    out = subprocess.run([sys.executable, "-m", "zeroshard"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "demo" in out.stdout
