"""The package layout follows the data path: no module imports against it.

Every ``import`` in ``satjax/`` (module level and inside functions) is read with ``ast``
and checked against the table below, so a new upward import fails here, not in review.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SATJAX = Path(__file__).resolve().parents[1] / "satjax"

# package (or module) -> satjax packages it must never import
FORBIDDEN = {
    "satjax.losses": {"data", "model", "rollout", "queue", "train", "app"},
    "satjax.objectives": {"data", "model", "rollout", "queue", "train", "app"},
    "satjax.data": {"model", "rollout", "queue", "train", "app", "losses", "objectives"},
    "satjax.model": {"rollout", "queue", "train", "app", "losses", "objectives"},
    "satjax.queue": {"data", "model", "rollout", "train", "app", "losses", "objectives"},
    "satjax.rollout": {"train", "app", "losses", "objectives"},
    "satjax.rollout.vllm_engine": {"model"},
    "satjax.rollout.vllm_ext": {"model"},
    "satjax.train": {"rollout", "app"},
    "satjax.trajectory": {"data", "model", "rollout", "queue", "train", "app", "losses"},
    "satjax.weight_sync": {"data", "model", "rollout", "queue", "train", "app", "losses"},
    "satjax.utils": {"data", "model", "rollout", "queue", "train", "app", "losses", "config"},
    "satjax.run_dir": {"data", "model", "rollout", "queue", "train", "app", "losses"},
    "satjax.config": {"data", "model", "rollout", "queue", "train", "app"},
    "satjax.app": set(),  # the application may use every stage
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SATJAX.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m == "satjax" or m.startswith("satjax.")}


def _rules_for(module: str) -> set[str]:
    banned: set[str] = set()
    for owner, packages in FORBIDDEN.items():
        if module == owner or module.startswith(owner + "."):
            banned |= packages
    return banned


SOURCES = sorted(p for p in SATJAX.rglob("*.py") if "_pb2" not in p.name)


def test_every_package_has_a_rule():
    packages = {p.parent.name for p in SOURCES if p.name == "__init__.py" and p.parent != SATJAX}
    assert {f"satjax.{p}" for p in packages} <= set(FORBIDDEN)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SATJAX.parent)))
def test_no_import_against_the_data_path(path):
    module = _module_name(path)
    banned = _rules_for(module)
    bad = sorted(m for m in _imports(path)
                 if any(m == f"satjax.{b}" or m.startswith(f"satjax.{b}.") for b in banned))
    assert not bad, f"{module} imports {bad} (forbidden for it: {sorted(banned)})"


def test_the_checker_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from satjax.app.run import run_train\n")
    assert "satjax.app.run" in _imports(f)


def test_the_train_library_does_not_load_the_app_even_transitively():
    code = ("import sys, satjax.train.trainer, satjax.train.metrics, satjax.train.checkpoint; "
            "sys.exit(sorted(m for m in sys.modules if m.startswith('satjax.app')) or 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(SATJAX.parent), "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_rollout_worker_loads_the_queue_client_only():
    """A producer shares :mod:`satjax.queue.protocol` with the server, never its code: the
    worker process loads neither the server, its queue logic nor its storage (a worker
    host needs none of them, and a change there cannot break a worker)."""
    server_side = ("satjax.queue.server", "satjax.queue.core", "satjax.queue.store")
    code = ("import sys, satjax.rollout.worker, satjax.app.worker_process, satjax.queue.client; "
            f"sys.exit(sorted(m for m in sys.modules if m in {server_side!r}) or 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(SATJAX.parent), "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
