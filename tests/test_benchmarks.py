"""The CPU benchmark scripts run end to end on tiny settings (so they cannot rot between measurements),
and the figures they print obey the invariants the README quotes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    return p.stdout


@pytest.mark.slow
def test_transport_benchmark_runs_and_sharing_saves_bytes():
    out = run_script("transport.py", "--ranks", "2", "--tokens", "64", "--d", "64", "--experts", "4", "--iters", "2")
    assert re.search(r"ratio symmetric / all_to_all = \d+\.\d+", out), out
    ratio = float(re.search(r"ratio with / without = (\d+\.\d+)", out).group(1))
    assert 0 < ratio < 1, out  # lease sharing needs fewer symmetric bytes than per-block caches


@pytest.mark.slow
def test_mxfp8_benchmark_runs_and_halves_dispatch_bytes():
    out = run_script("mxfp8.py", "--steps", "3")
    ratios = [float(x) for x in re.findall(r"ratio (\d+\.\d+)", out)]
    assert len(ratios) == 2 and all(abs(r - 33 / 64) < 1e-4 for r in ratios), out  # (d + d/32) bytes / 2d
    assert re.search(r"final-loss difference [+-]\d+\.\d+%", out), out
