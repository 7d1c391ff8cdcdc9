"""benchmarks/layer_breakdown.py and linear_bench.py run (quick shapes) and report every part."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from serve_helpers import NATIVE_REASON, NATIVE_READY, ROOT


@pytest.mark.skipif(not NATIVE_READY, reason=NATIVE_REASON)
def test_layer_breakdown_quick():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_breakdown.py"), "--quick"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"f32 FMA peak \d+\.\d GFLOP/s, bf16 peak \d+\.\d GFLOP/s \(", p.stdout)
    rows = [line for line in p.stdout.splitlines() if "step" in line and "projections" in line]
    assert len(rows) == 6 and [line.split()[3] for line in rows] == ["plain", "packed"] * 3, p.stdout
    for line in rows:
        times = [float(v) for v in re.findall(r"(?:step|in_proj|core|norm|out_proj)\s+(\d+\.\d+)", line)]
        assert len(times) == 5 and all(v > 0 for v in times), line
        assert re.search(r"\d+\.\d GFLOP/s = \d+% of the bf16 peak", line), line


@pytest.mark.skipif(not NATIVE_READY, reason=NATIVE_REASON)
def test_linear_bench_quick():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "linear_bench.py"), "--quick"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split("|")[1:-1] for line in p.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(r[0]) for r in rows] == [1, 9], p.stdout
    for r in rows:
        assert all(float(v) > 0 for v in r[1:]), r
