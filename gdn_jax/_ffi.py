"""Loads the native extension, registers its XLA FFI targets and exposes the ISA controls.

Target names are prefixed ``gdn_jax_`` so that they cannot collide with another library's.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import jax

TARGET_PREFIX = "gdn_jax_"

try:
    from . import _gdn_ffi  # type: ignore[attr-defined]
except ImportError as e:  # not built: only the reference implementation is usable
    _gdn_ffi = None
    _import_error: ImportError | None = e
else:
    _import_error = None
    for _name, _capsule in _gdn_ffi.registrations().items():
        jax.ffi.register_ffi_target(TARGET_PREFIX + _name, _capsule, platform="cpu")
    _forced = os.environ.get("GDN_JAX_ISA", "").strip()
    if _forced:
        try:
            _gdn_ffi.select_isa(_forced)
        except ValueError as e:
            raise ValueError(
                f"GDN_JAX_ISA={_forced!r} cannot be honoured: {e}. "
                f"Available here: {', '.join(_gdn_ffi.available_isas())}"
            ) from None


def native_available() -> bool:
    """True when the native extension is built and its FFI targets are registered."""
    return _gdn_ffi is not None


def require_native() -> None:
    if _gdn_ffi is None:
        raise RuntimeError(
            "gdn_jax native kernels are not built (the _gdn_ffi extension failed to import: "
            f"{_import_error}). Build with `make build` or `pip install .`, or pass impl='reference'."
        )


def available_isas() -> list[str]:
    """ISAs compiled in and supported by this CPU, best first (e.g. ['avx512bf16', 'avx512', 'generic']).

    On x86 builds the list ends with the test ISA ``'amx_model'``: the AMX kernels run on a
    software model of the tile instructions (any x86 CPU; slow). It is never chosen
    automatically, only by ``set_isa`` / ``use_isa`` / ``GDN_JAX_ISA``. ``'amx'`` (real tiles) is
    listed only when the CPU has AMX and Linux granted tile permission; otherwise
    ``cpu_features()`` names the refusal (``amx_permission_denied``) and ``set_isa('amx')`` says why.
    """
    require_native()
    return list(_gdn_ffi.available_isas())


def selected_isa() -> str:
    """The ISA whose kernels the native ops run now."""
    require_native()
    return _gdn_ffi.selected_isa()


def set_isa(name: str) -> None:
    """Force the kernels of one available ISA for every later native call (tests, benchmarks).

    Raises ValueError naming the ISA and why when it is unknown or this CPU lacks a feature.
    Takes effect at execution time, also for functions compiled earlier. JAX dispatches
    asynchronously, so it first waits for every computation already dispatched (those whose
    results are still alive, ``jax.live_arrays()``): each runs on the ISA selected when it was
    dispatched. Process-wide: do not switch while another Python thread dispatches native ops.
    """
    require_native()
    if name not in _gdn_ffi.available_isas():
        _gdn_ffi.select_isa(name)  # raises, naming the reason
    jax.block_until_ready(jax.live_arrays())
    _gdn_ffi.select_isa(name)


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Context manager: native ops dispatched inside the block run on ``name``; then restore.

    Leaving the block waits for the computations dispatched inside it (see :func:`set_isa`).
    """
    previous = selected_isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)


def cpu_features() -> str:
    require_native()
    return _gdn_ffi.cpu_features()
