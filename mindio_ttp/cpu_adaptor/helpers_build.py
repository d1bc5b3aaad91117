"""Build Megatron's dataset index helpers (``megatron/data/helpers.cpp``) outside the tree.

Megatron builds them with ``make`` inside the checkout (``data/dataset_utils.py:83-92``,
called by rank 0 at ``initialize.py:98-100``), which writes into a tree that may be read-only
or shared. Here the extension goes to ``$TTP_CPU_BUILD_DIR`` (default
``<tempdir>/ttp_cpu_adaptor_build``) under a key made of the source's hash and the Python ABI,
so every tree at the same commit shares one build. The build writes a private temporary file
and renames it into place, so ranks that build at the same time do not corrupt each other.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

BUILD_DIR_ENV = "TTP_CPU_BUILD_DIR"
BUILD_TIMEOUT_S = 300


def build_root() -> Path:
    """Where built helpers live (``$TTP_CPU_BUILD_DIR`` or a folder in the temp dir)."""
    configured = os.environ.get(BUILD_DIR_ENV)
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "ttp_cpu_adaptor_build"


def helpers_path(source: Path) -> Path:
    """The extension file built from ``source`` (which need not exist yet)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    digest = hashlib.sha256(source.read_bytes() + suffix.encode()).hexdigest()[:16]
    return build_root() / digest / ("helpers" + suffix)


def build_helpers(source: Path, *, verbose: bool = True) -> Path:
    """Compile ``source`` with g++ and pybind11 unless already built; return the extension."""
    out = helpers_path(source)
    if out.exists():
        return out
    try:
        import pybind11
    except ImportError as exc:
        raise RuntimeError(
            "building Megatron's dataset helpers needs pybind11: pip install pybind11"
        ) from exc
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("building Megatron's dataset helpers needs a C++ compiler (g++): "
                           "install one or set CXX")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [compiler, "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC",
           f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
           str(source), "-o", str(tmp)]
    if verbose:
        print(f"> [cpu_adaptor] building dataset helpers out of tree: {out}", flush=True)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"building {source} failed ({' '.join(cmd)}):\n{done.stderr}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
