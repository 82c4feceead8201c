"""The core imports without torchtune; the layers import downwards only."""

import ast
from pathlib import Path
import subprocess
import sys

PACKAGE = Path(__file__).resolve().parents[2] / "adaptive_batch"


def test_core_imports_without_torchtune_torchao_or_datasets():
    code = (
        "import sys, adaptive_batch, adaptive_batch.probe.trials, adaptive_batch.probe.search, adaptive_batch.run.controller, "
        "adaptive_batch.schedule.growth, adaptive_batch.run.batching, adaptive_batch.probe.api, adaptive_batch.probe.plan; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torchtune', 'torchao', 'datasets', 'omegaconf'}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_the_library_starts_without_torchs_compiler():
    """The planner's trackers bring torch's compiler and DTensor (a second of start-up in every
    process, each torchrun rank included): imported where a plan is made, not with the package."""
    code = (
        "import sys, adaptive_batch, adaptive_batch.probe.plan, adaptive_batch.run.controller; "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'torch.distributed._tools') if m in sys.modules))"
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


# The layers, each importing only itself and those before it (the package docstring's order).
LAYERS = ["logs", "memory.device", "errors", "faults", "files", "validation", "rng", "identity", "batch_tensors", "memory", "distributed", "schedule", "probe", "data", "run", "torchtune", "hf", "lightning", "command"]


def _layer(module: str) -> int:
    name = module[len("adaptive_batch."):]
    matches = [layer for layer in LAYERS if name == layer or name.startswith(layer + ".")]
    return LAYERS.index(max(matches, key=len))  # memory.device before the rest of memory


def test_layers_import_downwards_only_and_without_cycles():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        module = "adaptive_batch." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        graph[module] = {m for m in _imports(path) if m != "adaptive_batch"}
    assert graph["adaptive_batch.memory.device"] <= {"adaptive_batch.logs"}  # the one layer before it
    assert graph["adaptive_batch.errors"] == {"adaptive_batch.memory.device"}
    upward = [(m, dep) for m in graph for dep in graph[m] if _layer(dep) > _layer(m)]
    assert not upward, f"imports against the layer order {LAYERS}: {upward}"

    def visit(module, stack):
        assert module not in stack, f"import cycle: {' -> '.join(stack + [module])}"
        for dep in graph.get(module, ()):
            visit(dep, stack + [module])

    for module in graph:
        visit(module, [])


def test_the_public_face_is_small_and_every_name_resolves():
    import adaptive_batch

    assert len(adaptive_batch.__all__) <= 30
    assert len(set(adaptive_batch.__all__)) == len(adaptive_batch.__all__)
    for name in adaptive_batch.__all__:
        assert getattr(adaptive_batch, name) is not None
    # the dotted paths configs name
    for name in ["double_every_epoch", "multiply_every", "linear_ramp", "step_increments", "linear_rampup",
                 "seesaw", "noise_scale_growth"]:
        assert callable(getattr(adaptive_batch, name))


def test_no_two_modules_share_a_name():
    names = [p.stem for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_recipes_import_the_library_through_its_two_faces_only():
    # adaptive_batch and adaptive_batch.torchtune: the rest may move without touching a recipe.
    # Every import statement counts, those inside functions too.
    recipes = [p for p in (PACKAGE.parent / "recipes").glob("*.py") if p.name != "__init__.py"]
    reached = {}
    for path in recipes:
        nodes = list(ast.walk(ast.parse(path.read_text())))
        reached[path.name] = {n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module} | {
            a.name for n in nodes if isinstance(n, ast.Import) for a in n.names
        }
    assert len(reached) == 3 and all("adaptive_batch" in m for m in reached.values()), reached
    beyond = {
        name: sorted(m for m in modules if m.startswith("adaptive_batch") and m not in ("adaptive_batch", "adaptive_batch.torchtune"))
        for name, modules in reached.items()
    }
    assert not any(beyond.values()), beyond


# The 4 public entry points whose arguments need the room; every other function fits a screen.
LONG_ENTRY_POINTS = {"search_max_batch_size", "find_max_batch_size", "plan_memory", "probe_batch_size"}


def test_functions_fit_a_screen():
    # About 60 lines a function, docstring included; the entry points above up to 100.
    over = {}
    for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "recipes").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                lines = node.end_lineno - first + 1
                if lines > (100 if node.name in LONG_ENTRY_POINTS else 60):
                    over[f"{path.name}:{node.name}"] = lines
    assert not over, over
