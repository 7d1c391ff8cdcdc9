"""The GDN layer against transformers' own Qwen3-Next / Qwen3.5 layers, from checkpoints that
transformers wrote (save_pretrained, single and sharded files).

Several sequences in one mixed batch: a prefill of each, then a step that holds a
continuation chunk, a decode row and a short chunk, then decode steps. transformers runs
each sequence alone with its own cache; outputs and final caches must agree.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_models as hf  # noqa: E402
from gdn_jax import GDNCache, Request, build_batch  # noqa: E402
from gdn_jax.checkpoint import load_layer_config, load_layer_params  # noqa: E402
from gdn_jax.layer import GatedDeltaNetLayer  # noqa: E402

from serve_helpers import NATIVE_READY  # noqa: E402

# The core is checked on every ISA by the op and path tests; here the layer runs on the
# reference and on the kernels a user gets (the selected ISA).
IMPLS = ["reference"] + (["native"] if NATIVE_READY else [])


def rrmse(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref ** 2)))


SPECS = {
    # GQA 2, K < V, sharded files (each tensor alone in a file or two)
    "next": hf.TinyModel("qwen3_next", H=2, HV=4, K=16, V=32, shard_size="40KB"),
    # GQA 3, K > V, the multimodal wrapper (model.language_model.* keys, text_config)
    "3.5": hf.TinyModel("qwen3_5", H=2, HV=6, K=32, V=16),
}
LAYER = 1
# Per sequence: the token counts of each step (0 = not in that step).
PLAN = {"A": [13, 7, 1, 1, 1], "B": [5, 1, 1, 1, 1], "C": [1, 3, 1, 1, 1]}
SLOTS = {"A": 5, "B": 0, "C": 2}
NUM_SLOTS = 6


def _chunks(s, x):
    """Sequence s's inputs split by PLAN's steps."""
    bounds = np.cumsum([0] + PLAN[s])
    return [x[bounds[i]:bounds[i + 1]] for i in range(len(PLAN[s]))]


def _hf_run(model, inputs):
    """transformers, one sequence at a time: ({s: [outputs per step]}, {s: (conv, ssm)})."""
    outs, states = {}, {}
    for s in PLAN:
        r = hf.HFLayerRunner(model, LAYER)
        outs[s] = [r(x) for x in _chunks(s, inputs[s])]
        states[s] = (r.conv_state(), r.ssm_state())
    return outs, states


@pytest.fixture(scope="module", params=sorted(SPECS))
def case(request, tmp_path_factory):
    """Checkpoints written by transformers (f32 and bf16) and transformers' results on them.

    f32: the model's own run. bf16: the bf16 model's run, and the truth: the same bf16
    weight values run in f32.
    """
    import torch

    spec = SPECS[request.param]
    rng = np.random.default_rng(7)
    model = hf.build_model(spec, seed=len(request.param))
    f32 = dict(path=hf.save(model, tmp_path_factory.mktemp("hf_f32"), spec),
               inputs={s: rng.standard_normal((sum(c), spec.hidden)).astype(np.float32) for s, c in PLAN.items()})
    f32["outs"], f32["states"] = _hf_run(model, f32["inputs"])
    bf = hf.build_model(spec, seed=11).to(torch.bfloat16)
    # inputs that are exact bf16 values, so every side starts from the same numbers
    bf16 = dict(path=hf.save(bf, tmp_path_factory.mktemp("hf_bf16"), spec),
                inputs={s: np.asarray(jnp.asarray(rng.standard_normal((sum(c), spec.hidden)), jnp.bfloat16),
                                      np.float32) for s, c in PLAN.items()})
    bf16["outs"], bf16["states"] = _hf_run(bf, bf16["inputs"])
    bf16["truth"], bf16["truth_states"] = _hf_run(bf.float(), bf16["inputs"])
    return spec, f32, bf16


def _run_ours(layer, params, cfg, inputs):
    """PLAN through our layer, the sequences together in mixed batches: ({s: [outputs]}, cache)."""
    cache = GDNCache.create(cfg.core, NUM_SLOTS)
    ours = {s: [] for s in PLAN}
    chunks = {s: _chunks(s, inputs[s]) for s in PLAN}
    for step in range(len(PLAN["A"])):
        reqs, xs = [], []
        for s in PLAN:
            n = PLAN[s][step]
            if step == 0:
                reqs.append(Request.prefill(SLOTS[s], n, id=s))
            elif n == 1:
                reqs.append(Request.decode(SLOTS[s], id=s))
            else:
                reqs.append(Request.prefill(SLOTS[s], n, has_initial_state=True, id=s))
            xs.append(chunks[s][step])
        batch = build_batch(reqs, num_slots=NUM_SLOTS, token_bucket=32, row_bucket=4)
        h = jnp.asarray(batch.pack(xs, dtype=np.float32), cfg.act_dtype)
        run = layer.decode if all(r.kind == "decode" for r in reqs) else layer.mixed
        out, cache = run(h, params, cache, batch)
        assert not np.any(np.asarray(out, np.float32)[batch.num_tokens:]), "bucket padding tokens must be zero"
        for s, o in zip(PLAN, batch.unpack(np.asarray(out, np.float32))):
            ours[s].append(o)
    return ours, cache


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_matches_transformers_f32(case, impl):
    spec, f32, _ = case
    cfg = load_layer_config(f32["path"])
    assert cfg.act_dtype == np.dtype(np.float32)
    assert cfg.model_type == ("qwen3_next" if spec.model_type == "qwen3_next" else "qwen3_5")
    params = load_layer_params(f32["path"], LAYER, cfg)
    ours, cache = _run_ours(GatedDeltaNetLayer(cfg, impl=impl), params, cfg, f32["inputs"])
    for s in PLAN:
        for step, (o, t) in enumerate(zip(ours[s], f32["outs"][s])):
            assert rrmse(o, t) <= 1e-5, (s, step, rrmse(o, t))
        conv, ssm = f32["states"][s]
        assert rrmse(np.asarray(cache.ssm_state[SLOTS[s]]), ssm) <= 1e-5, s
        # raw in_proj outputs: equal up to the two libraries' f32 matmul summation orders
        assert rrmse(np.asarray(cache.conv_state[SLOTS[s]]), conv) <= 1e-6, s


# The reference's bf16 numbers are held to float64 by the core tests; here it runs in the slow set.
BF16_IMPLS = [pytest.param(i, marks=[pytest.mark.slow] if i == "reference" and len(IMPLS) > 1 else [])
              for i in IMPLS]


@pytest.mark.parametrize("impl", BF16_IMPLS)
def test_layer_matches_transformers_bf16(case, impl):
    """bf16 weights and activations, against transformers run in f32 on the same bf16 weights
    and inputs (the truth), over every token of the plan.

    The core's own budget (contract.md: 2e-3 - 3e-3 with exact bf16 inputs) is tested by the
    op tests; the layer adds bf16 roundings of its own (in_proj outputs, the conv output,
    the norm's two casts, out_proj), placed where transformers places them, and its RMSNorm
    magnifies the error of a head whose output is small. So the layer is held to
    transformers' own bf16 error on the same inputs: at most 1.5x it, and below 1.2e-2
    (measured here: ours 0.0055-0.0088, transformers' 0.0060-0.0104, over three seeds).
    Per-token errors are not compared: a token whose q and k are nearly orthogonal turns
    one-ulp differences of the conv output into large relative changes, either way.
    """
    _, _, bf16 = case
    cfg = load_layer_config(bf16["path"])
    assert cfg.act_dtype == np.dtype(jnp.bfloat16)
    params = load_layer_params(bf16["path"], LAYER, cfg)
    assert params.in_proj_qkv.dtype == jnp.bfloat16, "bf16 weights stay bf16"
    ours, cache = _run_ours(GatedDeltaNetLayer(cfg, impl=impl), params, cfg, bf16["inputs"])
    cat = lambda d: np.concatenate([x for s in PLAN for x in d[s]])  # noqa: E731
    ours_err, their_err = rrmse(cat(ours), cat(bf16["truth"])), rrmse(cat(bf16["outs"]), cat(bf16["truth"]))
    assert ours_err <= min(1.5 * their_err, 1.2e-2), (ours_err, their_err)
    for s in PLAN:
        t = bf16["truth_states"][s][1]
        ours_s, their_s = rrmse(np.asarray(cache.ssm_state[SLOTS[s]]), t), rrmse(bf16["states"][s][1], t)
        assert ours_s <= min(1.5 * their_s, 1e-2), (s, ours_s, their_s)
