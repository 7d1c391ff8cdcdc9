"""benchmarks/layer_breakdown.py and linear_bench.py run (quick shapes) and report every part."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from serve_helpers import NATIVE_REASON, NATIVE_READY, ROOT


# The header names the allocator: tuned as a server runs it (the default), glibc's own where untunable.
MALLOC_LINE = re.compile(r"malloc tuned \(gdn_jax\.tune_host_malloc\)|malloc: glibc's defaults \(tuning not")


def _quick_run(script: str) -> str:
    """stdout of ``benchmarks/<script> --quick``, which must succeed."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.skipif(not NATIVE_READY, reason=NATIVE_REASON)
def test_layer_breakdown_quick():
    out = _quick_run("layer_breakdown.py")
    assert re.search(r"f32 FMA peak \d+\.\d GFLOP/s, bf16 peak \d+\.\d GFLOP/s \(", out)
    assert MALLOC_LINE.search(out), out
    rows = [line for line in out.splitlines() if "step" in line and "projections" in line]
    assert len(rows) == 6 and [line.split()[3] for line in rows] == ["plain", "packed"] * 3, out
    for line in rows:
        times = [float(v) for v in re.findall(r"(?:step|in_proj|core|norm|out_proj)\s+(\d+\.\d+)", line)]
        assert len(times) == 5 and all(v > 0 for v in times), line
        assert re.search(r"\d+\.\d GFLOP/s = \d+% of the bf16 peak", line), line


@pytest.mark.skipif(not NATIVE_READY, reason=NATIVE_REASON)
def test_linear_bench_quick():
    out = _quick_run("linear_bench.py")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(r[0]) for r in rows] == [1, 9], out
    for r in rows:  # times, ratio, rates, fractions (a fraction above its probe says so instead)
        assert len(r) == 9 and all(float(v) > 0 for v in r[1:6] + [r[7]]), r
        assert all("probe wrong" in v or 0 < float(v) <= 100 for v in (r[6], r[8])), r
    assert re.search(r"bf16 peak \d+\.\d GFLOP/s \(.+\); read bandwidth \d+\.\d GB/s", out), out
    assert re.search(r"read bandwidth after the table \d+\.\d GB/s", out), out
    assert MALLOC_LINE.search(out), out


def test_linear_bench_refuses_a_share_above_its_probe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import linear_bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert linear_bench._share(88.5, 100.0) == "88.5"
    assert linear_bench._share(100.0, 100.0) == "100"
    cell = linear_bench._share(1060.0, 1031.0)
    assert "probe wrong" in cell and "103%" in cell and not cell[0].isdigit()
