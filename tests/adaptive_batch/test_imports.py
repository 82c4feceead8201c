"""The core imports without torchtune; the layers import downwards only."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "adaptive_batch"


def test_core_imports_without_torchtune_torchao_or_datasets():
    code = (
        "import sys, adaptive_batch, adaptive_batch.probe, adaptive_batch.search, adaptive_batch.controller, "
        "adaptive_batch.growth, adaptive_batch.batching, adaptive_batch.api, adaptive_batch.planner; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torchtune', 'torchao', 'datasets', 'omegaconf'}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def _imports(path: Path) -> set:
    """The adaptive_batch modules ``path`` imports at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("adaptive_batch"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("adaptive_batch"))
    return names


def test_no_cycles_and_validation_is_a_leaf():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        module = "adaptive_batch." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        graph[module] = {m for m in _imports(path) if m != "adaptive_batch"}
    assert graph["adaptive_batch.validation"] == set()
    core = {m for m in graph if not m.startswith("adaptive_batch.torchtune")}
    assert not any(dep.startswith("adaptive_batch.torchtune") for m in core for dep in graph[m])

    def visit(module, stack):
        assert module not in stack, f"import cycle: {' -> '.join(stack + [module])}"
        for dep in graph.get(module, ()):
            visit(dep, stack + [module])

    for module in graph:
        visit(module, [])
