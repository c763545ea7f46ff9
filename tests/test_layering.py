"""The package layout follows the data path: no module reaches against it.

Every ``import`` in ``satjax/`` (module level and inside functions) is read with ``ast``
into a graph of satjax modules, and each module's transitive closure in it is checked
against the table below: a module may not import a forbidden package, nor import anything
that (directly or further down) does. So a new upward import fails here, not in review,
also when it goes through a module that is allowed on its own.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

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


def _module_name(path: Path, root: Path = SATJAX.parent) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return set()


def _satjax(names: set[str]) -> set[str]:
    return {m for m in names if m == "satjax" or m.startswith("satjax.")}


def _imports(path: Path) -> set[str]:
    """Every satjax name ``path`` imports, at module level and inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return _satjax(set().union(*map(_names, ast.walk(tree))))


def _eager_imports(path: Path) -> set[str]:
    """The satjax names importing ``path`` imports: every import outside a function body
    (class bodies and ``if``/``try`` blocks run at import time too)."""
    out: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"))]
    while todo:
        node = todo.pop()
        out |= _names(node)
        todo.extend(c for c in ast.iter_child_nodes(node)
                    if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    return _satjax(out)


def _rules_for(module: str) -> set[str]:
    banned: set[str] = set()
    for owner, packages in FORBIDDEN.items():
        if module == owner or module.startswith(owner + "."):
            banned |= packages
    return banned


def _sources(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "_pb2" not in p.name)


SOURCES = _sources(SATJAX)


class Graph(NamedTuple):
    """module -> the satjax modules it imports: ``eager`` when the module is imported (its
    module-level imports), ``lazy`` when one of its functions runs (imports inside them)."""

    eager: dict[str, set[str]]
    lazy: dict[str, set[str]]


def _graph(package: Path) -> Graph:
    """The import graph of ``package`` (a ``satjax`` directory). A name is resolved to its
    longest prefix that is a module (``from satjax.model import DTYPES`` imports
    ``satjax.model``), and a module's parent packages count as imported too: Python runs
    their ``__init__`` first, so what they import is loaded as well."""
    root = package.parent
    modules = {_module_name(p, root): p for p in _sources(package)}

    def resolve(names: set[str], importer: str) -> set[str]:
        out: set[str] = set()
        for name in names:
            parts = name.split(".")
            found = next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                          if ".".join(parts[:i]) in modules), None)
            if found is not None:
                parts = found.split(".")
                out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        return (out & modules.keys()) - {importer}

    return Graph({m: resolve(_eager_imports(p), m) for m, p in modules.items()},
                 {m: resolve(_imports(p) - _eager_imports(p), m) for m, p in modules.items()})


def _reach(graph: Graph, start: str) -> dict[str, str]:
    """Every module ``start`` can load, each -> the module that imports it on a shortest
    path from ``start`` (breadth first): what importing ``start`` loads, what its own
    functions import, and what importing those loads in turn.

    Another module's function-level imports are not followed: they run only when that
    function is called (``satjax.config`` imports ``satjax.objectives`` to check a config
    being loaded, not when the model imports its ``Remat`` type)."""
    via: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            deps = graph.eager.get(m, set()) | (graph.lazy.get(m, set()) if m == start else set())
            for d in sorted(deps):
                if d != start and d not in via:
                    via[d] = m
                    nxt.append(d)
        frontier = nxt
    return via


def _violations(graph: Graph, module: str) -> list[str]:
    """The import chains from ``module`` into a package :data:`FORBIDDEN` for it, as
    ``"a -> b -> c"``; empty when all it can load is allowed."""
    banned = _rules_for(module)

    def forbidden(m: str) -> bool:
        return any(m == f"satjax.{b}" or m.startswith(f"satjax.{b}.") for b in banned)

    via = _reach(graph, module)
    out = []
    for target in sorted(via):
        # each way in once: where the chain first enters a forbidden package
        if forbidden(target) and not forbidden(via[target]):
            chain = [target]
            while chain[-1] != module:
                chain.append(via[chain[-1]])
            out.append(" -> ".join(reversed(chain)))
    return out


GRAPH = _graph(SATJAX)


def test_every_package_has_a_rule():
    packages = {p.parent.name for p in SOURCES if p.name == "__init__.py" and p.parent != SATJAX}
    assert {f"satjax.{p}" for p in packages} <= set(FORBIDDEN)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SATJAX.parent)))
def test_no_import_against_the_data_path(path):
    module = _module_name(path)
    bad = _violations(GRAPH, module)
    assert not bad, (f"{module} reaches a package forbidden for it "
                     f"({sorted(_rules_for(module))}):\n" + "\n".join(bad))


def test_the_checker_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from satjax.app.run import run_train\n")
    assert "satjax.app.run" in _imports(f)


def test_the_checker_follows_indirect_imports(tmp_path):
    """The layout before satjax.app.factory: train/memory.py imported satjax/factory.py
    (allowed to train on its own), which imported the rollout worker. Each file passes a
    direct check; the closure does not."""
    files = {
        "__init__.py": "",
        "factory.py": "from satjax.rollout.worker import WorkerConfig\n",
        "rollout/__init__.py": "",
        "rollout/worker.py": "def f():\n    import satjax.queue.client\n",
        "queue/__init__.py": "",
        "queue/client.py": "",
        "train/__init__.py": "",
        "train/memory.py": "from satjax.factory import model_options\n",
        "train/lazy.py": "def f():\n    from satjax.train import memory\n",
    }
    for name, text in files.items():
        (tmp_path / "satjax" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "satjax" / name).write_text(text)
    graph = _graph(tmp_path / "satjax")
    assert graph.eager["satjax.train.memory"] == {"satjax", "satjax.factory"}
    assert graph.lazy["satjax.rollout.worker"] == {"satjax", "satjax.queue", "satjax.queue.client"}
    assert _violations(graph, "satjax.train.memory") == [
        "satjax.train.memory -> satjax.factory -> satjax.rollout",
        "satjax.train.memory -> satjax.factory -> satjax.rollout.worker",
    ]  # (the queue client beyond them is not allowed to train either: found, not repeated)
    assert _violations(graph, "satjax.rollout.worker") == []  # queue: allowed to rollout
    # a function-level import of a module that reaches rollout reaches it too
    assert _violations(graph, "satjax.train.lazy") == [
        "satjax.train.lazy -> satjax.train.memory -> satjax.factory -> satjax.rollout",
        "satjax.train.lazy -> satjax.train.memory -> satjax.factory -> satjax.rollout.worker",
    ]


def test_the_real_graph_resolves_modules_and_their_packages():
    """The graph of satjax itself resolves names to modules and their packages: what the
    closure check walks is what Python loads."""
    assert {"satjax.app.factory", "satjax.app"} <= GRAPH.eager["satjax.app.memory"]
    assert "satjax.rollout.worker" in GRAPH.eager["satjax.app.factory"]
    assert "satjax.objectives" in GRAPH.lazy["satjax.config"]
    assert "satjax.queue.client" in _reach(GRAPH, "satjax.app.memory")


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
