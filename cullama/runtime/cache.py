"""Where cullama writes on disk: one directory, $CULLAMA_CACHE or ~/.cache/cullama, and nothing outside it.

    kernels/   the registry's cubins (registry.py)
    emu/       the CUDA emulator's kernel libraries (emu/build.py)
    cupy/      CuPy's own kernel cache (CUPY_CACHE_DIR), unless the user set CUPY_CACHE_DIR

CuPy creates its cache directory (~/.cupy/kernel_cache by default) the moment it is imported, so cullama
imports CuPy through import_cupy(), which points CUPY_CACHE_DIR here first. A cache that cannot be made
(CULLAMA_CACHE naming a file, an unwritable HOME) is a one-line CacheError (a DeviceError) that says which and
what to set; on a machine with a CUDA driver it is never taken for the want of a GPU (device.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..common.errors import DeviceError


class CacheError(DeviceError):
    """cullama's cache directory cannot be made or written."""


def root() -> Path:
    """$CULLAMA_CACHE, or ~/.cache/cullama (not created here)."""
    configured = os.environ.get("CULLAMA_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "cullama"


def _where() -> str:
    configured = os.environ.get("CULLAMA_CACHE")
    return f"CULLAMA_CACHE={configured}" if configured else f"cullama's cache directory (HOME={Path.home()})"


def directory(name: str) -> Path:
    """root()/name, created if need be, checked to be a writable directory."""
    base = root()
    if base.exists() and not base.is_dir():
        raise CacheError(f"{_where()}: {base} is not a directory; set CULLAMA_CACHE to a writable directory")
    path = base / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(f"{_where()}: cannot create {path} ({exc.strerror or exc}); "
                          "set CULLAMA_CACHE to a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(f"{_where()}: {path} is not writable; set CULLAMA_CACHE to a writable directory")
    return path


def import_cupy():
    """The cupy module, its kernel cache under root()/cupy unless CUPY_CACHE_DIR was set (before CuPy's first
    import: CuPy reads it then). A CacheError where that directory cannot be made; ImportError where CuPy is
    not installed."""
    if "cupy" not in sys.modules and not os.environ.get("CUPY_CACHE_DIR"):
        os.environ["CUPY_CACHE_DIR"] = str(directory("cupy"))
    import cupy

    return cupy
