"""Static configuration, parameters and state cache of one GDN attention layer.

* :class:`GDNConfig`: the static facts of a layer (head counts and dims, conv width,
  dtypes, conv-state layout, number of speculative tokens). Frozen and hashable; it is
  registered as a *static* pytree node (no leaves), so it may be passed straight through
  ``jax.jit`` and is part of the compilation key.
* :class:`GDNParams`: the layer's weights that the attention core uses (``A_log``,
  ``dt_bias``, the depthwise conv weight and optional bias). A pytree of arrays.
* :class:`GDNCache`: the two state pools of a layer, indexed by cache slot. A pytree of
  arrays, meant to be donated to the jitted serving steps (``gdn_jax.paths``) so that
  they are updated in place.

Shapes (names of spec/contract.md): H key heads, HV value heads, K / V head dims,
D = 2*H*K + HV*V conv channels, W conv width, L = W - 1 + num_spec conv state length,
N cache slots.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _native
from ._ffi import native_available

__all__ = ["GDNConfig", "GDNParams", "GDNCache", "zeros_pool"]

_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
_LAYOUTS = ("SD", "DS")
_ACTIVATIONS = ("silu", None, "identity")


def _as_dtype(name: str, value) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(value))
    except TypeError:
        raise TypeError(f"GDNConfig.{name} must be a dtype (float32 or bfloat16), got {value!r}") from None
    if dt not in _DTYPES:
        raise TypeError(f"GDNConfig.{name} must be float32 or bfloat16, got {dt.name}")
    return dt


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise ValueError(f"GDNConfig.{name} must be a positive int, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Static configuration of one Gated DeltaNet attention layer.

    Args:
      num_k_heads: H, key (and query) heads.
      num_v_heads: HV, value heads; a positive multiple of H (value head h uses key head
        h // (HV // H)).
      head_k_dim, head_v_dim: K and V; multiples of 16, at most 256 (what the native
        kernels support).
      conv_width: W, 2..4 (Qwen3-Next: 4). Tap W-1 multiplies the current token.
      activation: conv activation, "silu" (default) or None / "identity".
      num_spec: draft tokens per speculative step (0 = speculative decoding off). The conv
        state then holds L = W - 1 + num_spec rows and a spec row names num_spec + 1 slots.
      state_dtype: SSM state pool dtype, float32 (default) or bfloat16.
      act_dtype: activation dtype of mixed_qkv / a / b / outputs and of the conv state pool,
        bfloat16 (default, the serving case) or float32.
      conv_state_layout: "SD" ([N, L, D], default) or "DS" ([N, D, L]).
      l2norm_eps: eps of the q/k l2 normalisation (1e-6; vLLM's CPU kernels use 1e-5).
      scale: query scale; None means K ** -0.5.
      use_qk_l2norm: normalise q and k before the recurrence (Qwen3-Next: True).

    Derived: ``D = 2*H*K + HV*V`` (conv channels), ``L = W - 1 + num_spec``.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int = 4
    activation: Optional[str] = "silu"
    num_spec: int = 0
    state_dtype: Any = jnp.float32
    act_dtype: Any = jnp.bfloat16
    conv_state_layout: str = "SD"
    l2norm_eps: float = 1e-6
    scale: Optional[float] = None
    use_qk_l2norm: bool = True

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        H = _positive_int("num_k_heads", self.num_k_heads)
        HV = _positive_int("num_v_heads", self.num_v_heads)
        set_("num_k_heads", H)
        set_("num_v_heads", HV)
        if HV % H:
            raise ValueError(f"GDNConfig: num_v_heads={HV} must be a multiple of num_k_heads={H} (GQA)")
        for name in ("head_k_dim", "head_v_dim"):
            v = _positive_int(name, getattr(self, name))
            if v % 16 or v > 256:
                raise ValueError(f"GDNConfig.{name} must be a multiple of 16 in [16, 256], got {v}")
            set_(name, v)
        W = _positive_int("conv_width", self.conv_width)
        if not 2 <= W <= 4:
            raise ValueError(f"GDNConfig.conv_width must be 2, 3 or 4, got {W}")
        set_("conv_width", W)
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"GDNConfig.activation must be 'silu' or None, got {self.activation!r}")
        if self.activation == "identity":
            set_("activation", None)
        if isinstance(self.num_spec, bool) or not isinstance(self.num_spec, (int, np.integer)) or self.num_spec < 0:
            raise ValueError(f"GDNConfig.num_spec must be an int >= 0, got {self.num_spec!r}")
        set_("num_spec", int(self.num_spec))
        set_("state_dtype", _as_dtype("state_dtype", self.state_dtype))
        set_("act_dtype", _as_dtype("act_dtype", self.act_dtype))
        if self.conv_state_layout not in _LAYOUTS:
            raise ValueError(f"GDNConfig.conv_state_layout must be 'SD' ([N, L, D]) or 'DS' ([N, D, L]), "
                             f"got {self.conv_state_layout!r}")
        eps = float(self.l2norm_eps)
        if not eps > 0:
            raise ValueError(f"GDNConfig.l2norm_eps must be > 0, got {self.l2norm_eps!r}")
        set_("l2norm_eps", eps)
        if self.scale is not None:
            s = float(self.scale)
            if not s > 0:
                raise ValueError(f"GDNConfig.scale must be > 0 or None, got {self.scale!r}")
            set_("scale", s)
        set_("use_qk_l2norm", bool(self.use_qk_l2norm))

    # --- short names (contract.md) ---
    @property
    def H(self) -> int:
        return self.num_k_heads

    @property
    def HV(self) -> int:
        return self.num_v_heads

    @property
    def K(self) -> int:
        return self.head_k_dim

    @property
    def V(self) -> int:
        return self.head_v_dim

    @property
    def W(self) -> int:
        return self.conv_width

    @property
    def G(self) -> int:
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    @property
    def D(self) -> int:
        """Conv channels = width of mixed_qkv: 2*H*K + HV*V."""
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def L(self) -> int:
        """Conv state length W - 1 + num_spec."""
        return self.W - 1 + self.num_spec

    @property
    def spec_cols(self) -> int:
        """Columns of a state_indices row: num_spec + 1."""
        return self.num_spec + 1

    @property
    def resolved_scale(self) -> float:
        return float(self.K) ** -0.5 if self.scale is None else self.scale

    def conv_state_shape(self, num_slots: int) -> tuple[int, int, int]:
        N = int(num_slots)
        return (N, self.L, self.D) if self.conv_state_layout == "SD" else (N, self.D, self.L)

    def ssm_state_shape(self, num_slots: int) -> tuple[int, int, int, int]:
        return (int(num_slots), self.HV, self.K, self.V)

    def split_qkv(self, y):
        """Split conv outputs ``y [T, D]`` into q, k ``[T, H, K]`` and v ``[T, HV, V]``."""
        T = y.shape[0]
        hk = self.H * self.K
        q = y[:, :hk].reshape(T, self.H, self.K)
        k = y[:, hk:2 * hk].reshape(T, self.H, self.K)
        v = y[:, 2 * hk:].reshape(T, self.HV, self.V)
        return q, k, v


jax.tree_util.register_static(GDNConfig)


def _check_array(name: str, x, shape: tuple, dtypes: tuple) -> None:
    if tuple(getattr(x, "shape", ())) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(getattr(x, 'shape', ()))}")
    dt = np.dtype(x.dtype)
    if dt not in tuple(np.dtype(d) for d in dtypes):
        raise TypeError(f"{name} must have dtype {' or '.join(np.dtype(d).name for d in dtypes)}, got {dt.name}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNParams:
    """Weights of one GDN layer used by the attention core.

    Attributes:
      A_log: [HV] (decay rate: g = -exp(A_log) * softplus(a + dt_bias)).
      dt_bias: [HV].
      conv_weight: [D, W]; tap W-1 multiplies the current token.
      conv_bias: [D] or None (Qwen3-Next has none).
    Each is float32 or bfloat16, each its own, as stored (a bf16 checkpoint's A_log stays bf16):
    the kernels widen them to f32 exactly (README.md, Contract, "parameters").
    """

    A_log: Any
    dt_bias: Any
    conv_weight: Any
    conv_bias: Any = None

    @classmethod
    def random(cls, config: GDNConfig, key, *, conv_bias: bool = False, dtype=None) -> "GDNParams":
        """Random weights at the scales of a trained Qwen3-Next layer's initialisation.

        ``A = exp(A_log)`` uniform in [1, 16]; ``dt = softplus(dt_bias)`` log-uniform in
        [1e-3, 1e-1] (Mamba's dt init); conv weight and bias uniform in ``±1/sqrt(W)``
        (PyTorch's depthwise Conv1d init). Conv weight/bias and dt_bias are stored in
        ``dtype`` (default: the config's act_dtype); A_log in float32.
        """
        dtype = config.act_dtype if dtype is None else np.dtype(jnp.dtype(dtype))
        k1, k2, k3, k4 = jax.random.split(key, 4)
        HV, D, W = config.HV, config.D, config.W
        A = jax.random.uniform(k1, (HV,), jnp.float32, 1.0, 16.0)
        dt = jnp.exp(jax.random.uniform(k2, (HV,), jnp.float32, np.log(1e-3), np.log(1e-1)))
        dt_bias = dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus
        bound = 1.0 / np.sqrt(W)
        w = jax.random.uniform(k3, (D, W), jnp.float32, -bound, bound)
        b = jax.random.uniform(k4, (D,), jnp.float32, -bound, bound) if conv_bias else None
        return cls(A_log=jnp.log(A), dt_bias=dt_bias.astype(dtype), conv_weight=w.astype(dtype),
                   conv_bias=None if b is None else b.astype(dtype))

    def validate(self, config: GDNConfig) -> "GDNParams":
        """Raise ValueError/TypeError naming the field if a shape or dtype does not fit ``config``."""
        acts = (jnp.float32, jnp.bfloat16)
        _check_array("GDNParams.A_log", self.A_log, (config.HV,), acts)
        _check_array("GDNParams.dt_bias", self.dt_bias, (config.HV,), acts)
        _check_array("GDNParams.conv_weight", self.conv_weight, (config.D, config.W), acts)
        if self.conv_bias is not None:
            _check_array("GDNParams.conv_bias", self.conv_bias, (config.D,), acts)
        return self


def zeros_pool(shape, dtype, *, huge_pages: bool = True):
    """A zero-filled state pool, e.g. ``ssm_state [N, HV, K, V]`` or ``conv_state`` for the ops.

    With ``huge_pages`` on the native CPU path (JAX's default backend is the CPU and the native
    module is loaded) a kernel makes it: it advises the new buffer's whole 2 MiB pages as
    transparent huge pages, then fills it (ffi/src/handlers/pool.cc). The decode and spec
    kernels read a state head in column blocks whose rows lie on 16 different 4 KiB pages, and
    run faster on huge pages (ffi/README.md, "Huge-page pools"). Where Linux has THP off the
    hint changes nothing; off the native path, or with ``huge_pages=False``, the pool is
    ``jnp.zeros``. The values are zeros either way.
    Donated to the jitted steps, the pool stays the same buffer, so the pages stay huge.
    """
    dims = tuple(shape) if isinstance(shape, (tuple, list)) else None
    if dims is None or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    shape, dtype = tuple(int(d) for d in dims), np.dtype(dtype)
    _checks.check_byte_dtype("zeros_pool", dtype)
    # As jnp.zeros: float64 / int64 become 32-bit unless jax_enable_x64 (the native call would
    # otherwise make a 64-bit array that the rest of the program does not expect).
    dtype = jax.dtypes.canonicalize_dtype(dtype)
    if huge_pages and jax.default_backend() == "cpu" and native_available():
        return _native.zero_pool(shape, dtype)
    return jnp.zeros(shape, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNCache:
    """The state pools of one GDN layer, indexed by cache slot (N slots).

    Attributes:
      conv_state: [N, L, D] ("SD") or [N, D, L] ("DS"), activation dtype: the raw pre-conv
        inputs of the most recent tokens, oldest first (a rolling buffer of L = W-1+num_spec
        rows in spec mode).
      ssm_state: [N, HV, K, V] (k-major per head), state dtype.

    Donate it to the jitted steps (they do) and use only the cache they return.
    """

    conv_state: Any
    ssm_state: Any

    @classmethod
    def create(cls, config: GDNConfig, num_slots: int, *, huge_pages: bool = True) -> "GDNCache":
        """Zero-filled pools with ``num_slots`` slots (zero = "no history").

        ``huge_pages``: see :func:`zeros_pool` (which makes both pools).
        """
        if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        return cls(conv_state=zeros_pool(config.conv_state_shape(num_slots), config.act_dtype, huge_pages=huge_pages),
                   ssm_state=zeros_pool(config.ssm_state_shape(num_slots), config.state_dtype, huge_pages=huge_pages))

    @property
    def num_slots(self) -> int:
        return int(self.ssm_state.shape[0])

    def validate(self, config: GDNConfig) -> "GDNCache":
        """Raise ValueError/TypeError naming the pool if a shape or dtype does not fit ``config``."""
        N = tuple(getattr(self.ssm_state, "shape", (0,)))[0]
        _check_array("GDNCache.ssm_state", self.ssm_state, config.ssm_state_shape(N), (config.state_dtype,))
        _check_array("GDNCache.conv_state", self.conv_state, config.conv_state_shape(N), (config.act_dtype,))
        return self
