"""The README's layer example runs as written, on a small checkpoint in place of the model."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import GDNConfig
from gdn_jax.checkpoint import save_checkpoint
from gdn_jax.layer import GDNLayerConfig, GDNLayerParams
from serve_helpers import ROOT


def test_readme_layer_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The layer"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'path = "Qwen3-Next-80B-A3B-Instruct"' in code
    cfg = GDNLayerConfig(hidden_size=64, core=GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32))
    save_checkpoint(tmp_path, cfg, {0: GDNLayerParams.random(cfg, jax.random.key(0))}, num_hidden_layers=2)
    scope = {}
    exec(compile(code.replace('"Qwen3-Next-80B-A3B-Instruct"', repr(str(tmp_path))), "README.md", "exec"), scope)
    out, cache = scope["out"], scope["cache"]
    assert out.shape == (8, 64) and out.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.any(np.asarray(out[:1], np.float32))
    assert not np.any(np.asarray(out[1:], np.float32)), "bucket padding tokens are zero"
    assert np.any(np.asarray(cache.ssm_state[3])) and not np.any(np.asarray(cache.ssm_state[:3]))
