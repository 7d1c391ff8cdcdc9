"""Loads the native extension, registers its XLA FFI targets and exposes the ISA controls.

Target names are prefixed ``gdn_jax_`` so that they cannot collide with another library's.
"""
from __future__ import annotations

import contextlib
import os
import re
import warnings
from pathlib import Path
from typing import Iterator

import jax

TARGET_PREFIX = "gdn_jax_"


def runtime_ffi_api_version() -> tuple[int, int] | None:
    """(major, minor) XLA FFI API version of the installed jaxlib, read from the C header it ships
    (``jax.ffi.include_dir()``); None when the header cannot be read."""
    try:
        text = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    except (AttributeError, OSError):
        return None
    found = [re.search(rf"^#define XLA_FFI_API_{part} (\d+)", text, re.M) for part in ("MAJOR", "MINOR")]
    return (int(found[0].group(1)), int(found[1].group(1))) if all(found) else None


def _jaxlib_version() -> str:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return "?"


def ffi_api_mismatch(module_version: tuple[int, int], runtime_version: tuple[int, int] | None) -> str | None:
    """Why a module compiled against XLA FFI API ``module_version`` cannot register with a jaxlib
    of ``runtime_version``, or None when it can (or the runtime's version is unknown). A jaxlib
    takes handlers of its own API version and of older ones of the same major version, never of
    newer ones (jaxlib 0.5.3-0.8.0 are 0.1, 0.8.3 0.2, 0.10.2 0.3, 0.11.2 0.4; each of them ran
    handlers compiled against 0.1)."""
    if runtime_version is None:
        return None
    if module_version[0] == runtime_version[0] and module_version[1] <= runtime_version[1]:
        return None
    return (
        f"the gdn_jax extension was compiled against the XLA FFI API {module_version[0]}.{module_version[1]} "
        f"but the installed jaxlib {_jaxlib_version()} has {runtime_version[0]}."
        f"{runtime_version[1]}, so it cannot register the native kernels; they are off and impl='auto' "
        "runs the reference. Rebuild the extension against this jaxlib: `make build` in a checkout, or "
        "`pip install --no-build-isolation --force-reinstall .` with this jaxlib installed"
    )


try:
    from . import _gdn_ffi  # type: ignore[attr-defined]
except ImportError as e:  # not built: only the reference implementation is usable
    _gdn_ffi = None
    _import_error: ImportError | None = e
    _mismatch: str | None = None
else:
    _import_error = None
    # Checked before registering: a handler newer than the jaxlib makes XLA refuse it when the
    # CPU backend starts, and then no CPU computation at all runs in the process.
    _mismatch = ffi_api_mismatch(tuple(_gdn_ffi.ffi_api_version()), runtime_ffi_api_version())
    if _mismatch:
        _gdn_ffi = None
        warnings.warn(_mismatch, RuntimeWarning, stacklevel=2)
if _gdn_ffi is not None:
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
        if _mismatch:
            raise RuntimeError(f"gdn_jax native kernels are off: {_mismatch}; or pass impl='reference'.")
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
