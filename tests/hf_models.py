"""Tiny random Qwen3-Next / Qwen3.5 models built and saved by transformers itself, and their
GDN layers run through transformers' own code: the reference for the layer tests.

Needs torch (CPU build) and transformers (installed by ``make test``). No network:
HF_HUB_OFFLINE is set before transformers is imported.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """What to build: the GDN dims of a tiny model of ``model_type``."""

    model_type: str            # qwen3_next | qwen3_5 (multimodal wrapper) | qwen3_5_text
    hidden: int = 64
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 32
    W: int = 4
    num_layers: int = 4        # layer 3 is full attention (layer_types)
    shard_size: str | None = None   # save_pretrained(max_shard_size=...) for sharded files

    def text_kwargs(self) -> dict:
        return dict(vocab_size=32, hidden_size=self.hidden, intermediate_size=32, num_hidden_layers=self.num_layers,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=self.H,
                    linear_num_value_heads=self.HV, linear_key_head_dim=self.K, linear_value_head_dim=self.V,
                    linear_conv_kernel_dim=self.W, rms_norm_eps=1e-6,
                    layer_types=["linear_attention"] * (self.num_layers - 1) + ["full_attention"])


def build_model(spec: TinyModel, seed: int = 0):
    """A transformers model of ``spec`` with GDN weights at realistic scales (eval mode, f32).

    transformers initialises the projections at std 0.02 and the norm weight to ones; the
    GDN weights are redrawn so that every term of the layer matters in a comparison.
    """
    import transformers as tf

    torch.manual_seed(seed)
    if spec.model_type == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**spec.text_kwargs(), num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16, decoder_sparse_step=1)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif spec.model_type == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration
        cfg = Qwen3_5Config(text_config=spec.text_kwargs(),
                            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                               out_hidden_size=spec.hidden))
        model = Qwen3_5ForConditionalGeneration(cfg)
    elif spec.model_type == "qwen3_5_text":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**spec.text_kwargs()))
    else:
        raise ValueError(spec.model_type)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".linear_attn." not in name:
                continue
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-4.0, -1.0, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g)))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=g))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model.eval()


def save(model, path, spec: TinyModel) -> str:
    kw = {"max_shard_size": spec.shard_size} if spec.shard_size else {}
    model.save_pretrained(path, **kw)
    return str(path)


def layer_prefix(model, layer: int) -> str:
    names = [f"model.language_model.layers.{layer}.linear_attn", f"model.layers.{layer}.linear_attn"]
    mods = dict(model.named_modules())
    return next(n for n in names if n in mods)


class HFLayerRunner:
    """Runs one GDN layer of a transformers model for one sequence, threading its own cache."""

    def __init__(self, model, layer: int):
        from transformers import DynamicCache

        self.module = model.get_submodule(layer_prefix(model, layer))
        self.cache = DynamicCache(config=model.config.get_text_config())
        self.layer = layer
        self.dtype = next(self.module.parameters()).dtype

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n, hidden_size] (f32 values) -> output [n, hidden_size] as float64."""
        x = torch.from_numpy(np.asarray(hidden, np.float32)).to(self.dtype)[None]
        with torch.no_grad():
            y = self.module(x, self.cache)
        return y[0].double().numpy()

    def conv_state(self) -> np.ndarray:
        """The last W-1 raw inputs, oldest first: [W-1, D] float64."""
        c = self.cache.get_conv_state(self.layer, state_idx=0)[0]     # [D, W]
        W = c.shape[-1]
        return c[:, W - (W - 1):].T.double().numpy()

    def ssm_state(self) -> np.ndarray:
        """[HV, K, V] float64."""
        return self.cache.get_recurrent_state(self.layer, state_idx=0)[0].double().numpy()
