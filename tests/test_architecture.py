"""The tree reads in one direction: no import cycles, and packages import only lower layers.

Every `from inference_engine... import` counts, wherever it is written (module level, inside
a function, under TYPE_CHECKING): a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "inference_engine"

# Lower layers first. A module may import its own package and any package of a lower rank.
RANKS = {
    "errors": 0, "v1": 0, "process_exit": 0, "readiness": 0, "short_id": 0, "metrics": 0, "log_setup": 0, "gc_freeze": 0, "malloc_trim": 0,
    "launch": 0, "version": 0, "flag_ranges": 0,
    "status_codes": 0.5,  # the one error table, over errors
    "model": 1, "security": 1, "text": 1, "address": 1,
    "config": 2,
    "blas": 3,
    "execution": 4, "quant_kernel": 4,
    "verifier": 4.5,  # the sink-window verifier, over the execution layer
    "session": 5, "shard.protocol": 5, "served_model": 5, "serving_path": 5,
    "decoding": 6,
    "runtime": 7, "shard": 7, "shard.client": 7,
    "server": 8, "client": 8, "shard.worker": 8,  # a worker drives the runtime's engine core, as the server does
    "__main__": 9,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _layer(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "<package>"
    return ".".join(parts[:2]) if parts[0] == "shard" and len(parts) >= 2 else parts[0]


def import_graph() -> dict[str, set[str]]:
    """Module -> the inference_engine modules it imports (generated stubs left out)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "v1" in path.relative_to(PACKAGE).parts:
            continue
        name = _module_name(path)
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("inference_engine"):
                for cand in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                    if _is_module(cand) and cand not in (name, "inference_engine"):
                        targets.add(cand)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("inference_engine") and _is_module(a.name)}
        graph[name] = {t for t in targets if "inference_engine.v1" not in t}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_packages_import_only_lower_layers():
    wrong = []
    for module, targets in import_graph().items():
        here = _layer(module)
        assert here in RANKS or here == "<package>", f"{module}: package {here!r} has no rank in this test"
        for target in targets:
            there = _layer(target)
            if there != here and RANKS.get(there, 99) >= RANKS.get(here, -1):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_runtime_knows_nothing_of_shards():
    graph = import_graph()
    assert [f"{m} -> {t}" for m, ts in graph.items() if _layer(m) == "runtime" for t in ts if ".shard" in t] == []


def test_no_file_over_about_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if "v1" not in p.parts
            and (n := len(p.read_text().splitlines())) > 430}
    assert long == {}


REPO = PACKAGE.parent
# Modules outside tests/ that still import a test helper, each with why it is not fixed here. The test
# fails once one no longer does, so the list cannot go stale.
PENDING_TEST_IMPORTS: dict[str, str] = {}


def imported_test_helpers(source: str) -> list[str]:
    """The `tests` modules `source` imports (any import statement, lazy ones included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_no_module_outside_tests_imports_a_test_helper():
    """Test-only code lives in tests/ (tiny models, whole-operation helpers): the package and the scripts
    never import it, so nothing a server runs depends on a test helper."""
    outside = sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "scripts").rglob("*.py"))
    found = {str(p.relative_to(REPO)): imported_test_helpers(p.read_text()) for p in outside if "v1" not in p.parts}
    found = {path: names for path, names in found.items() if names}
    assert sorted(found) == sorted(PENDING_TEST_IMPORTS), found


def test_the_test_helper_rule_sees_lazy_imports():
    source = "import os\ndef f():\n    from tests.tiny_models import random_model\nimport tests.certs as c\n"
    assert sorted(imported_test_helpers(source)) == ["tests.certs", "tests.tiny_models"]
    assert imported_test_helpers("from .tests import x\nimport testsuite\n") == []

def _definitions(root: Path) -> list[tuple[str, ast.AST]]:
    return [(str(p.relative_to(PACKAGE)), node) for p in sorted(root.rglob("*.py")) if "v1" not in p.parts
            for node in ast.walk(ast.parse(p.read_text()))]


def test_shard_defines_no_scheduler_engine_thread_or_batcher_of_its_own():
    """A worker runs the runtime's execution core: the Scheduler's engine thread, its BatchQueue and the
    executors' batched forward (`execution/executor.py`). shard/ may not grow a second one."""
    own = []
    for where, node in _definitions(PACKAGE / "shard"):
        if isinstance(node, ast.ClassDef) and any(w in node.name for w in ("Scheduler", "Batcher", "Thread", "Queue")):
            own.append(f"{where}: class {node.name}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("_forward_together", "abandon",
                                                                                       "_abandon", "step_many_loop"):
            own.append(f"{where}: def {node.name}")
        if isinstance(node, ast.ImportFrom) and node.module in ("concurrent.futures", "inference_engine.model.forward"):
            own += [f"{where}: imports {node.module}.{a.name}" for a in node.names if a.name != "Span"]
        if isinstance(node, ast.Attribute) and node.attr in ("ThreadPoolExecutor", "call_later") and "worker" in where:
            own.append(f"{where}: uses {node.attr}")
        if isinstance(node, ast.Attribute) and node.attr == "Thread" and "worker" in where:
            own.append(f"{where}: starts a thread")
    assert own == []


def test_engine_logic_is_defined_once():
    """One batched forward, one undo of a failed block, one mapping decorator in the package."""
    names = ("_forward_together", "abandon", "mapped", "_mapped")
    found = [(n.name, where) for where, n in _definitions(PACKAGE)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in names]
    assert sorted(name for name, _ in found) == sorted(set(name for name, _ in found)), found
