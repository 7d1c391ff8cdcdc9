"""Every example runs (in a small configuration) and reports success.

Each runs in a subprocess with PYTHONPATH set to the repository root, on the reference and
on the native kernels (the native runs follow serve_helpers' switch, see IMPLS there).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from serve_helpers import NATIVE_REASON, NATIVE_READY, ROOT

EXAMPLES = ROOT / "examples"


def _run(script, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


native = pytest.mark.skipif(not NATIVE_READY, reason=NATIVE_REASON)
# The small examples run on the native kernels once they are in (the reference is held to the
# same results by test_paths.py), else on the reference.
IMPL_ARGS = [pytest.param("native", id="native") if NATIVE_READY else pytest.param("reference", id="reference")]


def test_every_example_is_tested():
    # sharded_layer.py runs in tests/test_sharding.py (its slow set: three runs, two processes)
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == ["prefill_then_decode.py", "serving_loop.py",
                                                             "sharded_layer.py", "speculative_decode.py"]


@native
def test_serving_loop_native_vs_reference():
    out = _run("serving_loop.py", "--quick")
    assert "GDN layers [0, 1, 2] of" in out and "(qwen3_next," in out
    assert "agreement native vs reference" in out and ": OK" in out
    assert "tokens/s" in out and "one executable per impl: {'native': 1, 'reference': 1}" in out


def test_serving_loop_from_a_given_checkpoint(tmp_path):
    """--checkpoint DIR: a Qwen3.5 (multimodal layout) checkpoint on disk, one impl, spec off."""
    import jax
    import jax.numpy as jnp

    from gdn_jax import GDNConfig
    from gdn_jax.checkpoint import save_checkpoint
    from gdn_jax.layer import GDNLayerConfig, GDNLayerParams

    cfg = GDNLayerConfig(hidden_size=64, model_type="qwen3_5",
                         core=GDNConfig(num_k_heads=1, num_v_heads=3, head_k_dim=32, head_v_dim=16,
                                        act_dtype=jnp.bfloat16))
    save_checkpoint(tmp_path, cfg, {1: GDNLayerParams.random(cfg, jax.random.key(0))}, num_hidden_layers=2)
    impl = "native" if NATIVE_READY else "reference"
    out = _run("serving_loop.py", "--quick", "--checkpoint", str(tmp_path), "--impls", impl, "--num-spec", "0")
    assert f"GDN layers [1] of {tmp_path} (qwen3_5," in out and f"one executable per impl: {{'{impl}': 1}}" in out
    assert "num_spec=0" in out and "'spec': 0}" in out   # no spec rows without spec columns (it crashed)


@pytest.mark.parametrize("impl", IMPL_ARGS)
def test_prefill_then_decode(impl):
    out = _run("prefill_then_decode.py", "--impl", impl, "--decode-steps", "3")
    assert out.strip().endswith("OK")


@pytest.mark.parametrize("impl", IMPL_ARGS)
def test_speculative_decode(impl):
    """Its last verify step accepts a draft, so commit_accepted moves a state before the decodes."""
    out = _run("speculative_decode.py", "--impl", impl)   # its default 6 steps
    assert "commit_accepted (accepted 1)" not in out and "-> slot 6" in out and out.strip().endswith("OK")


@pytest.mark.parametrize("script,args,msg", [
    ("serving_loop.py", ["--slots", "2"], "--slots must be >= num_spec + 1 = 3"),
    ("serving_loop.py", ["--layers", "0"], "--layers must be >= 1"),
    ("serving_loop.py", ["--tokens", "2"], "--tokens must be >= 3"),
    ("prefill_then_decode.py", ["--decode-steps", "-1"], "--decode-steps must be >= 0"),
    ("speculative_decode.py", ["--steps", "0"], "--steps must be >= 1"),
])
def test_examples_refuse_bad_arguments_by_name(script, args, msg):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and msg in p.stderr, p.stderr
