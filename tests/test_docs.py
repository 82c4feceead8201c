"""Every code block of the README and docs/ is run or checked, so the docs cannot drift.

- Python blocks run in this process (a block marked ``<!-- docs-test: fragment -->`` on the line
  before its fence is only compiled: it shows a shape, not a program).
- Shell commands run cheaply where they are short: a tiny-config `tune run` in this process (its
  metric log read back), `adaptive-batch` through its ``main()``. Long ones (``make``, launches
  of several processes, benchmarks, and any block marked ``<!-- docs-test: long -->``) are
  checked for their syntax and names: the make target, the files and configs they name, and
  every ``key=value`` a recipe reads.
- YAML blocks parse, and every ``_component_`` they name imports.
"""

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest
import yaml

from tests.recipes.conftest import read_metric_log, REPO, run_in_process, run_tune_in_process

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- docs-test: (\w+) -->")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    mark: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def _blocks() -> List[Block]:
    found = []
    for page in PAGES:
        lines = page.read_text().split("\n")
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)\s*$", lines[i])
            if not m or not m.group(1):
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = MARK.search(lines[i - 1]) if i else None
            found.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                               mark.group(1) if mark else ""))
            i = end + 1
    return found


BLOCKS = _blocks()


def _commands(code: str) -> List[str]:
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.split("\n"):
        line = line.strip()
        if line and not line.startswith("#"):
            commands.append(line.split("  #")[0].strip() if "  #" in line else line)
    return commands


def _of(lang: str) -> List[Block]:
    return [b for b in BLOCKS if b.lang == lang]


def test_every_block_has_a_known_language_and_mark():
    assert {b.lang for b in BLOCKS} <= {"python", "bash", "yaml"}, {b.lang for b in BLOCKS}
    assert {b.mark for b in BLOCKS} <= {"", "long", "fragment"}


@pytest.mark.parametrize("block", _of("python"), ids=str)
def test_python_blocks_run(block, tmp_path, monkeypatch):
    code = compile(block.code, str(block), "exec")
    if block.mark == "fragment":
        return
    monkeypatch.chdir(tmp_path)
    exec(code, {"__name__": "__docs__"})


@pytest.mark.parametrize("block", _of("yaml"), ids=str)
def test_yaml_blocks_parse_and_their_components_import(block):
    from torchtune.config._utils import _get_component_from_path

    node = yaml.safe_load(block.code)
    components = re.findall(r"_component_:\s*([\w.]+)", block.code)
    for path in components:
        _get_component_from_path(path)
    assert isinstance(node, dict)


def _check_names(command: str) -> None:
    """A command's syntax, the files it names, its make target, the keys it sets."""
    syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    words = shlex.split(command)
    for word in words:
        if re.fullmatch(r"(recipes|configs|benchmarks|tests|docs)/[\w./-]+\.(py|yaml|md)", word):
            assert (REPO / word).exists(), f"{command!r} names {word}, which does not exist"
    if words[0] == "make":
        target = next(w for w in words[1:] if "=" not in w)
        assert f"\n{target}:" in (REPO / "Makefile").read_text(), f"no make target {target!r}"
    if "tune" in words and "run" in words:
        recipe = next(w for w in words if w.startswith("recipes/"))
        _check_keys(recipe, [w for w in words if re.fullmatch(r"[a-z_.]+=.*", w) and not w.startswith("PYTHONPATH")])


def _check_keys(recipe: str, overrides: List[str]) -> None:
    import adaptive_batch.torchtune as abt

    extra = {"lora_finetune_single_device": {"save_adapter_weights_only"},
             "full_finetune_distributed": {"fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers"}}
    known = abt.recipe_keys(extra.get(Path(recipe).stem, set()))
    for override in overrides:
        key = override.split("=", 1)[0].split(".")[0]
        assert key in known, f"{override!r}: {recipe} does not read {key!r}"


def _is_long(block: Block, command: str) -> bool:
    words = shlex.split(command)
    launcher = words[0] if not words[0].startswith("PYTHONPATH=") else words[1]
    return block.mark == "long" or launcher in {"make", "torchrun", "python", "python3"} or "--nproc_per_node" in words


@pytest.mark.parametrize(
    "block,command",
    [(b, c) for b in _of("bash") for c in _commands(b.code)],
    ids=lambda x: str(x) if isinstance(x, Block) else shlex.split(x)[0][:20],
)
def test_shell_commands_run_or_are_checked(block, command, tmp_path):
    _check_names(command)
    if _is_long(block, command):
        return
    words = shlex.split(command)
    if words[0].startswith("PYTHONPATH="):
        words = words[1:]
    if words[:2] == ["tune", "run"]:
        run = run_tune_in_process([*words[1:], f"output_dir={tmp_path}"])
        assert run.returncode == 0, run.stderr[-3000:]
        assert read_metric_log(tmp_path), "the run logged no step"
    elif words[0] == "adaptive-batch":
        from adaptive_batch.torchtune.cli import main

        run = run_in_process(lambda: main(words[1:]), ["adaptive-batch", *words[1:]])
        assert run.returncode == 0, run.stderr[-3000:]
    else:
        pytest.fail(f"{block}: {command!r} is neither run nor marked long (<!-- docs-test: long -->)")


def test_the_keys_table_is_made_from_the_option_classes():
    import sys

    sys.path.insert(0, str(REPO / "docs"))
    try:
        from keys_table import END, keys_table, START
    finally:
        sys.path.remove(str(REPO / "docs"))
    text = (REPO / "docs/configuration.md").read_text()
    assert text.split(START, 1)[1].split(END, 1)[0].strip() == keys_table(), (
        "docs/configuration.md is out of date: run `python docs/keys_table.py --write`"
    )


def test_every_key_a_recipe_reads_beyond_torchtunes_is_documented():
    from adaptive_batch.torchtune.config import recipe_keys, TORCHTUNE_KEYS

    text = (REPO / "docs/configuration.md").read_text()
    missing = [key for key in sorted(recipe_keys() - TORCHTUNE_KEYS) if f"| `{key}` |" not in text]
    assert not missing, f"keys missing from docs/configuration.md: {missing}"


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_reach_a_page_and_a_heading():
    anchors = {
        page: {_anchor(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)} for page in PAGES
    }
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors.get(dest, ())):
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_the_readme_is_the_front_door():
    lines = (REPO / "README.md").read_text().split("\n")
    assert len(lines) <= 300
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in "\n".join(lines), f"the README does not link docs/{page.name}"
