"""Generated protobuf/gRPC modules for ``trajectory.proto``, regenerated when stale.

The generated files are build artefacts (``setup.py`` makes them at install time) and are
never committed. On import this module loads ``trajectory_pb2`` / ``trajectory_pb2_grpc``
and, if they are missing or older than the ``.proto``, regenerates them with
``grpc_tools.protoc`` into the package directory, or into a per-user cache directory when
the package directory is read-only.

Exports ``pb2`` and ``pb2_grpc`` (the two modules).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO = PACKAGE_DIR / "trajectory.proto"
# The proto is compiled relative to the directory holding the ``satjax`` package so that
# the generated gRPC module imports ``from satjax.queue import trajectory_pb2``.
PROTO_ROOT = PACKAGE_DIR.parent.parent
PROTO_REL = "satjax/queue/trajectory.proto"
GENERATED = ("trajectory_pb2.py", "trajectory_pb2_grpc.py")
_MODNAMES = ("satjax.queue.trajectory_pb2", "satjax.queue.trajectory_pb2_grpc")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "satjax" / "proto"


def is_stale(out_dir: Path) -> bool:
    """True when a generated file in ``out_dir`` is missing or older than the .proto."""
    proto_mtime = PROTO.stat().st_mtime
    for name in GENERATED:
        path = out_dir / name
        if not path.exists() or path.stat().st_mtime < proto_mtime:
            return True
    return False


def generate(out_dir: Path) -> None:
    """Runs protoc into ``out_dir``; files appear atomically (concurrent importers are safe)."""
    from grpc_tools import protoc  # build-time dependency; imported only when needed

    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).resolve().parent / "_proto")
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".protoc-") as tmp:
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_REL),
        ])
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed (exit {rc}) on {PROTO}")
        for name in GENERATED:
            src = Path(tmp) / "satjax" / "queue" / name
            dst = out_dir / name
            shutil.copyfile(src, src.with_suffix(".tmp"))
            os.replace(src.with_suffix(".tmp"), dst)


def _load_from(out_dir: Path) -> tuple[ModuleType, ModuleType]:
    mods = []
    for name, modname in zip(GENERATED, _MODNAMES, strict=True):
        spec = importlib.util.spec_from_file_location(modname, out_dir / name)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod  # the grpc module imports the pb2 one by this name
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods[0], mods[1]


def load() -> tuple[ModuleType, ModuleType]:
    """Returns (trajectory_pb2, trajectory_pb2_grpc), generating them first if stale."""
    if not is_stale(PACKAGE_DIR):
        return (importlib.import_module(_MODNAMES[0]), importlib.import_module(_MODNAMES[1]))
    if os.access(PACKAGE_DIR, os.W_OK):
        try:
            generate(PACKAGE_DIR)
            importlib.invalidate_caches()
            return (importlib.import_module(_MODNAMES[0]),
                    importlib.import_module(_MODNAMES[1]))
        except OSError:
            pass  # e.g. a read-only file system that still reports W_OK
    cache = _cache_dir()
    if is_stale(cache):
        generate(cache)
    return _load_from(cache)


pb2, pb2_grpc = load()
