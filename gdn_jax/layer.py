"""The whole Gated DeltaNet layer of Qwen3-Next and Qwen3.5, over hidden states.

    hidden [T, hidden_size] -> in_proj -> mixed_qkv [T, D], z [T, HV, V], b, a [T, HV]
      -> core (conv + gating + recurrence: gdn_jax.paths) -> o [T, HV, V]
      -> gated RMSNorm per value head -> out_proj -> [T, hidden_size]

computed as Hugging Face transformers computes it (``Qwen3NextGatedDeltaNet`` /
``Qwen3_5GatedDeltaNet``): projections with f32 accumulation and one rounding to the
activation dtype; the gated norm's variance in f32, the normalised value cast to the
activation dtype before the weight multiply (weight initialised to ones, no +1 offset), then
times ``silu(z)`` in f32 and cast back.

* :class:`GDNLayerConfig`: static facts of a layer (``hidden_size``, the core's
  :class:`~gdn_jax.config.GDNConfig`, ``rms_norm_eps``, the model family).
* :class:`GDNLayerParams`: its weights, in Hugging Face's ``[out, in]`` layout and the plain
  channel order ``[q | k | v]`` of the core (Qwen3-Next's interleaved rows are undone at load
  time, :mod:`gdn_jax.checkpoint`).
* :class:`GatedDeltaNetLayer`: the jitted serving steps (prefill, decode, spec_decode, the
  mixed step, commit_accepted) with the cache donated, as :class:`gdn_jax.GDNAttention` has
  them for the core; same batch metadata, buckets, validation and ``InvalidBatchError``.

The cache of a layer is the core's :class:`gdn_jax.GDNCache` (``GDNCache.create(config.core, N)``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks
from .batch import ROW_PAD
from .config import GDNCache, GDNConfig, GDNParams, _check_array
from .ops import PackedLinearWeight, linear, merged_linear, pack_linear_weight, packed_shape
from .ops import gated_rms_norm as ops_gated_rms_norm
from .paths import STEP_KINDS, GDNAttention, _step, _unwrap, check_status

__all__ = ["GDNLayerConfig", "GDNLayerParams", "GatedDeltaNetLayer", "LAYER_STEPS", "MODEL_FAMILIES",
           "PACKED_PROJECTIONS", "in_projection", "gated_rms_norm", "out_projection", "layer_step"]

# Hugging Face model_type -> the family whose checkpoint layout it uses.
MODEL_FAMILIES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
}

# The projections GDNLayerParams.packed packs: all but in_proj_b and in_proj_a (HV rows each,
# ~1% of the weights; under tensor parallelism fewer rows per shard than a block of 16).
PACKED_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "out_proj")
# From this many tokens the layer packs in_proj_b and in_proj_a inside the step, to run them in
# in_proj's one native call (below it, packing them each step costs more than it saves).
PACK_BA_MIN_TOKENS = 64

# Layer step name -> the core step kind it runs (gdn_jax.paths.STEP_KINDS).
LAYER_STEPS = {"prefill": "prefill", "decode": "decode", "spec_decode": "spec_decode",
               "mixed": "gdn_attention_core"}


@dataclasses.dataclass(frozen=True)
class GDNLayerConfig:
    """Static configuration of one GDN layer (hashable; a static pytree node like GDNConfig).

    Args:
      hidden_size: width of the hidden states.
      core: the attention core's :class:`GDNConfig` (heads, head dims, conv width,
        num_spec, dtypes, conv-state layout).
      rms_norm_eps: eps of the gated RMSNorm (config.json's ``rms_norm_eps``).
      model_type: the Hugging Face family, "qwen3_next" or "qwen3_5" (it decides the
        checkpoint layout only; the computation is the same).
    """

    hidden_size: int
    core: GDNConfig
    rms_norm_eps: float = 1e-6
    model_type: str = "qwen3_next"

    def __post_init__(self):
        if isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, (int, np.integer)) \
                or self.hidden_size <= 0:
            raise ValueError(f"GDNLayerConfig.hidden_size must be a positive int, got {self.hidden_size!r}")
        object.__setattr__(self, "hidden_size", int(self.hidden_size))
        if not isinstance(self.core, GDNConfig):
            raise TypeError(f"GDNLayerConfig.core must be a GDNConfig, got {type(self.core).__name__}")
        eps = float(self.rms_norm_eps)
        if not eps > 0:
            raise ValueError(f"GDNLayerConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        object.__setattr__(self, "rms_norm_eps", eps)
        if self.model_type not in MODEL_FAMILIES:
            raise ValueError(f"GDNLayerConfig.model_type must be one of {sorted(MODEL_FAMILIES)}, "
                             f"got {self.model_type!r}")
        object.__setattr__(self, "model_type", MODEL_FAMILIES[self.model_type])

    # --- short names (contract.md) ---
    H = property(lambda self: self.core.H)
    HV = property(lambda self: self.core.HV)
    K = property(lambda self: self.core.K)
    V = property(lambda self: self.core.V)
    G = property(lambda self: self.core.G)
    D = property(lambda self: self.core.D)

    @property
    def Z(self) -> int:
        """Width of the gate z (and of out_proj's input): HV * V."""
        return self.core.HV * self.core.V

    @property
    def act_dtype(self) -> np.dtype:
        return self.core.act_dtype

    def projection_shapes(self) -> dict:
        """``{name: (out, in)}`` of the five projections (Hugging Face's ``[out, in]``)."""
        hid = self.hidden_size
        return {"in_proj_qkv": (self.D, hid), "in_proj_z": (self.Z, hid), "in_proj_b": (self.HV, hid),
                "in_proj_a": (self.HV, hid), "out_proj": (hid, self.Z)}

    def with_key_heads(self, num_k_heads: int) -> "GDNLayerConfig":
        """This layer restricted to ``num_k_heads`` key-head groups (their G value heads each)."""
        core = dataclasses.replace(self.core, num_k_heads=num_k_heads, num_v_heads=num_k_heads * self.G)
        return dataclasses.replace(self, core=core)

    def local(self, tp: int) -> "GDNLayerConfig":
        """The config of one of ``tp`` tensor-parallel shards (H/tp key heads, HV/tp value heads).

        Shards hold whole key-head groups, so ``tp`` must divide H.
        """
        if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp <= 0:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        if self.H % tp:
            raise ValueError(f"tp={tp} does not divide the key heads H={self.H}: tensor parallelism shards "
                             f"whole key-head groups (choose tp among the divisors of {self.H})")
        return self.with_key_heads(self.H // int(tp))


jax.tree_util.register_static(GDNLayerConfig)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNLayerParams:
    """Weights of one GDN layer; projections in Hugging Face's ``[out, in]`` layout.

    Attributes:
      in_proj_qkv: [D, hidden] rows ``[q heads | k heads | v heads]`` (D = 2*H*K + HV*V).
      in_proj_z: [HV*V, hidden] the gate of the norm.
      in_proj_b: [HV, hidden] (beta = sigmoid(b)).
      in_proj_a: [HV, hidden] (g = -exp(A_log) softplus(a + dt_bias)).
      core: :class:`GDNParams` (A_log, dt_bias, conv_weight [D, W]; conv_bias [D] where the
        checkpoint has one, else None).
      norm_weight: [V] the gated RMSNorm weight (no +1 offset).
      out_proj: [hidden, HV*V].
    Projections and norm weight are in the activation dtype (the loader casts them once);
    the core's parameters keep their stored dtype (f32 or bf16, read as stored). A bf16
    model's in_proj_qkv, in_proj_z and out_proj may be packed (:meth:`packed`): the same
    weights in the layout the CPU kernels read fastest.
    """

    in_proj_qkv: Any
    in_proj_z: Any
    in_proj_b: Any
    in_proj_a: Any
    core: GDNParams
    norm_weight: Any
    out_proj: Any

    @classmethod
    def random(cls, config: GDNLayerConfig, key, *, dtype=None) -> "GDNLayerParams":
        """Random weights: projections N(0, 1/in_features) (unit-scale outputs), the core's
        parameters as :meth:`GDNParams.random`, norm weight 1 + N(0, 0.1²) (ones would not test
        the multiply). Projections and norm weight in the act dtype (:meth:`validate` requires
        it); the core's parameters in ``dtype`` (default: the act dtype; f32 or bf16, as a
        checkpoint may store them) but A_log (f32)."""
        act = config.act_dtype
        k = jax.random.split(key, 7)
        hid, D, Z, HV, V = config.hidden_size, config.D, config.Z, config.HV, config.V

        def proj(kk, out, inp):
            return (jax.random.normal(kk, (out, inp), jnp.float32) / np.sqrt(inp)).astype(act)

        return cls(in_proj_qkv=proj(k[0], D, hid), in_proj_z=proj(k[1], Z, hid), in_proj_b=proj(k[2], HV, hid),
                   in_proj_a=proj(k[3], HV, hid), core=GDNParams.random(config.core, k[4], dtype=dtype),
                   norm_weight=(1.0 + 0.1 * jax.random.normal(k[5], (V,), jnp.float32)).astype(act),
                   out_proj=proj(k[6], hid, Z))

    def packed(self) -> "GDNLayerParams":
        """These weights with :data:`PACKED_PROJECTIONS` packed
        (:func:`gdn_jax.ops.pack_linear_weight`): the layout the CPU kernels read fastest (a
        decode step reads each weight once; benchmarks/LAYER_NOTES.md, "Packed weights").
        bf16 models only (packing f32 weights would round them); packed ones stay as they are."""
        new = {}
        for name in PACKED_PROJECTIONS:
            w = getattr(self, name)
            if isinstance(w, PackedLinearWeight):
                continue
            if jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16):
                raise TypeError(f"GDNLayerParams.{name} must be bfloat16 to be packed (a bf16 model), "
                                f"got {jnp.dtype(w.dtype)}")
            new[name] = pack_linear_weight(w)
        return dataclasses.replace(self, **new)

    def unpacked(self) -> "GDNLayerParams":
        """These weights with every projection in Hugging Face's ``[out, in]`` layout."""
        return dataclasses.replace(self, **{name: getattr(self, name).unpack() for name in PACKED_PROJECTIONS
                                            if isinstance(getattr(self, name), PackedLinearWeight)})

    def validate(self, config: GDNLayerConfig) -> "GDNLayerParams":
        """Raise ValueError/TypeError naming the field if a shape or dtype does not fit ``config``."""
        if not isinstance(self.core, GDNParams):
            raise TypeError(f"GDNLayerParams.core must be a GDNParams, got {type(self.core).__name__}")
        act = (config.act_dtype,)
        for name, shape in dict(config.projection_shapes(), norm_weight=(config.V,)).items():
            w = getattr(self, name)
            if isinstance(w, PackedLinearWeight):
                if name not in PACKED_PROJECTIONS:
                    raise TypeError(f"GDNLayerParams.{name} must be an [out, in] array (only "
                                    f"{', '.join(PACKED_PROJECTIONS)} may be packed)")
                if w.shape != shape:
                    raise ValueError(f"GDNLayerParams.{name} must be packed from shape {shape}, got {w.shape}")
                _check_array(f"GDNLayerParams.{name}.data", w.data, packed_shape(*shape), act)
            else:
                _check_array(f"GDNLayerParams.{name}", w, shape, act)
        self.core.validate(config.core)
        return self


def _project(x, w, impl: str, out_dtype=None):
    """:func:`gdn_jax.ops.linear` on the native kernel for bf16 weights only (packed ones are
    bf16): XLA's CPU bf16 dot is up to ~10x slower than it (one token), while for f32 weights
    XLA's own dot measured equal or faster (0.7-0.9x the kernel's time;
    benchmarks/LAYER_NOTES.md). Same math either way."""
    native = impl != "reference" and jnp.dtype(w.dtype) == jnp.dtype(jnp.bfloat16)
    return linear(x, w, out_dtype=out_dtype, impl=impl if native else "reference")


def in_projection(config: GDNLayerConfig, params: GDNLayerParams, hidden, impl: str = "reference"):
    """hidden [T, hidden] -> mixed_qkv [T, D], z [T, HV, V], b [T, HV], a [T, HV] (act dtype).

    ``impl`` of the projections (:func:`gdn_jax.ops.linear`, bf16 weights); the layer passes its own."""
    T = hidden.shape[0]
    qkv_w, z_w, b_w, a_w = params.in_proj_qkv, params.in_proj_z, params.in_proj_b, params.in_proj_a
    if impl != "reference" and isinstance(qkv_w, PackedLinearWeight) and isinstance(z_w, PackedLinearWeight):
        # One native call, hidden read (on AMX copied into tile order) once. in_proj_b / _a are
        # never stored packed (PACKED_PROJECTIONS); from PACK_BA_MIN_TOKENS tokens they are
        # packed here (2 HV rows, <1% of the weights) and join the call, on AMX tiles there
        # (benchmarks/LAYER_NOTES.md, "One call for in_proj").
        pack_ba = T >= PACK_BA_MIN_TOKENS and all(jnp.dtype(w.dtype) == jnp.dtype(jnp.bfloat16) for w in (b_w, a_w))
        ws = [qkv_w, z_w] + ([pack_linear_weight(b_w), pack_linear_weight(a_w)] if pack_ba else [])
        ys = merged_linear(hidden, ws, impl=impl)
        mixed_qkv, z = ys[:2]
        b, a = ys[2:] if pack_ba else (_project(hidden, b_w, impl), _project(hidden, a_w, impl))
    else:
        mixed_qkv, z, b, a = (_project(hidden, w, impl) for w in (qkv_w, z_w, b_w, a_w))
    return mixed_qkv, z.reshape(T, config.HV, config.V), b, a


def gated_rms_norm(o, z, weight, eps: float, impl: str = "reference"):
    """Gated RMSNorm per value head, as transformers' ``Qwen3NextRMSNormGated``
    (:func:`gdn_jax.ops.gated_rms_norm`; the layer passes its own ``impl``).

    o, z: [..., V] (act dtype); weight: [V]. ``n = o * rsqrt(mean(o^2) + eps)`` in f32, cast to
    o's dtype, times ``weight``; then times ``silu(z)`` in f32 and cast back to o's dtype.
    """
    return ops_gated_rms_norm(o, z, weight=weight, eps=eps, impl=impl)


def out_projection(params: GDNLayerParams, y, impl: str = "reference", out_dtype=None):
    """y [T, HV*V] -> [T, hidden] (``out_dtype``, default y's). Under tensor parallelism each
    shard's result is a partial sum (f32, rounded once after the reduction)."""
    return _project(y, params.out_proj, impl, out_dtype)


def layer_step(config: GDNLayerConfig, impl: str, kind: str, hidden, params: GDNLayerParams, cache: GDNCache,
               batch):
    """Traceable layer step: (out [T, hidden], cache, status int32[4]).

    ``kind`` is a key of :data:`LAYER_STEPS` or of ``gdn_jax.paths.STEP_KINDS``. A refused
    batch writes nothing: its output is zero and the cache comes back unchanged.
    """
    if not isinstance(config, GDNLayerConfig):
        raise TypeError(f"config must be a GDNLayerConfig, got {type(config).__name__}")
    core_kind = LAYER_STEPS.get(kind, kind)
    if core_kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {tuple(LAYER_STEPS)}, got {kind!r}")
    if not isinstance(params, GDNLayerParams):
        raise TypeError(f"params must be a GDNLayerParams, got {type(params).__name__}")
    T = _checks.check_rank("hidden", hidden, 2, "[T, hidden_size]")[0]
    _checks.check_shape("hidden", hidden, (T, config.hidden_size), "[T, hidden_size]")
    _checks.check_dtype("hidden", hidden, (config.act_dtype,), f"{config.act_dtype.name} (config.core.act_dtype)")
    params.validate(config)
    mixed_qkv, z, b, a = in_projection(config, params, hidden, impl)
    batch = _unwrap(batch)
    o, cache, status = _step(config.core, impl, core_kind, mixed_qkv, b, a, params.core, cache, batch)
    y = gated_rms_norm(o, z, params.norm_weight, config.rms_norm_eps, impl)
    out = out_projection(params, y.reshape(T, config.Z), impl)
    return _zero_padding(out, batch, status), cache, status


def _zero_padding(out, batch, status):
    """out [T, hidden] with zero rows for the tokens no real row owns (past
    ``query_start_loc[S]``, or owned by a padding row) and for a refused batch: o is zero there,
    but 0 * silu(z) is NaN where those tokens' hidden values are not finite. On out (each row its
    own sums, [T, hidden]: the smallest array after the core), not on the norm's [T, HV, V],
    where it kept XLA from fusing the reference norm (benchmarks/LAYER_NOTES.md)."""
    qsl = batch.query_start_loc
    t = jnp.arange(out.shape[0], dtype=qsl.dtype)
    row = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), batch.row_kind.shape[0] - 1)
    real = (t < qsl[-1]) & (batch.row_kind[row] != ROW_PAD) & (status[0] == 0)
    return jnp.where(real[:, None], out, jnp.zeros((), out.dtype))


class GatedDeltaNetLayer:
    """The jitted serving steps of one GDN layer, over hidden states.

    ``GatedDeltaNetLayer(config, impl)`` compiles (lazily, once per (T, S) bucket)::

        layer.prefill(hidden, params, cache, batch)      -> (out, cache)
        layer.decode(...) / layer.spec_decode(...)       -> (out, cache)
        layer.mixed(...)   (also layer(...))             -> (out, cache)   any mix of rows
        layer.commit_accepted(cache, spec_state_indices, num_accepted_tokens) -> cache

    Shapes: hidden and out [T, hidden_size] (act dtype); params :class:`GDNLayerParams`;
    cache :class:`gdn_jax.GDNCache` of ``config.core`` (donated: continue with the returned
    one); batch a :class:`gdn_jax.HostBatch` or :class:`gdn_jax.BatchMetadata` (see
    :func:`gdn_jax.build_batch`). Row kinds per step, padding, validation and errors are those
    of :class:`gdn_jax.GDNAttention`: a refused batch raises :class:`gdn_jax.InvalidBatchError`
    whose ``caches`` is the returned, unchanged cache. ``*_with_status`` are the ``jax.jit``
    objects returning ``(out, cache, status)``; :meth:`apply` is the un-jitted traceable step.
    """

    def __init__(self, config: GDNLayerConfig, impl: str = "auto"):
        if not isinstance(config, GDNLayerConfig):
            raise TypeError(f"config must be a GDNLayerConfig, got {type(config).__name__}")
        self.config = config
        self.impl = impl
        self.core = GDNAttention(config.core, impl)   # validates impl; commit_accepted is the core's
        for name in LAYER_STEPS:
            setattr(self, f"{name}_with_status", self._make_jit(name))
        self.commit_accepted_with_status = self.core.commit_accepted_with_status

    def _make_jit(self, name: str):
        cfg, impl = self.config, self.impl

        def step(hidden, params, cache, batch):
            return layer_step(cfg, impl, name, hidden, params, cache, batch)

        step.__name__ = step.__qualname__ = f"gdn_layer_{name}"
        return jax.jit(step, donate_argnames="cache")

    def __repr__(self) -> str:
        return f"GatedDeltaNetLayer({self.config!r}, impl={self.impl!r})"

    def apply(self, kind: str, hidden, params, cache, batch):
        """Un-jitted traceable step ``kind`` (a key of LAYER_STEPS): (out, cache, status)."""
        return layer_step(self.config, self.impl, kind, hidden, params, cache, batch)

    def _host(self, name: str, hidden, params, cache, batch):
        out, cache, status = getattr(self, f"{name}_with_status")(hidden, params, cache, _unwrap(batch))
        check_status(name, status, caches=cache)
        return out, cache

    def prefill(self, hidden, params, cache, batch):
        """Varlen (chunked) prefill rows. -> (out [T, hidden], cache)"""
        return self._host("prefill", hidden, params, cache, batch)

    def decode(self, hidden, params, cache, batch):
        """One token per row. -> (out [T, hidden], cache)"""
        return self._host("decode", hidden, params, cache, batch)

    def spec_decode(self, hidden, params, cache, batch):
        """Speculative verify rows (decode rows = 0 drafts). -> (out [T, hidden], cache)"""
        return self._host("spec_decode", hidden, params, cache, batch)

    def mixed(self, hidden, params, cache, batch):
        """Any mix of prefill, decode and spec rows in one call. -> (out [T, hidden], cache)"""
        return self._host("mixed", hidden, params, cache, batch)

    __call__ = mixed

    def commit_accepted(self, cache, spec_state_indices, num_accepted_tokens):
        """Move each spec row's accepted state into its column-0 slot; see GDNAttention.commit_accepted."""
        return self.core.commit_accepted(cache, spec_state_indices, num_accepted_tokens)

    def compiled_count(self) -> dict:
        """Entries of each step's jit cache (``_cache_size``): one per call signature seen (shapes,
        dtypes, and whether an argument came as NumPy or a jax array), so at least the number of
        programs compiled; XLA may compile fewer (the same program serves NumPy and device
        metadata of one bucket). Feed one kind of metadata to count compilations."""
        out = {name: getattr(self, f"{name}_with_status")._cache_size() for name in LAYER_STEPS}
        out["commit_accepted"] = self.commit_accepted_with_status._cache_size()
        return out
