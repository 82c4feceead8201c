"""The slim core: what `pip install adaptive-batch` brings, and the command without torchtune."""

import json
from pathlib import Path
import subprocess
import sys
import textwrap
import tomllib

import pytest

from adaptive_batch.command import TORCHTUNE_EXTRA, main

REPO = Path(__file__).resolve().parents[2]


def test_the_core_needs_torch_and_torchdata_and_torchtune_is_an_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in project["dependencies"]}
    assert names == {"torch", "torchdata"}
    extra = {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in project["optional-dependencies"]["torchtune"]}
    assert extra == set(TORCHTUNE_EXTRA)
    assert "torchtune==0.6.1" in project["optional-dependencies"]["torchtune"]
    assert project["scripts"]["adaptive-batch"] == "adaptive_batch.command:main"


def test_with_torchtune_installed_the_command_is_the_torchtune_cli():
    # the CLI's own one-line error, through the console script's entry point
    assert main(["plan", "--config", str(REPO / "nosuch.yaml")]) == 1


def test_without_the_torchtune_extra_the_library_trains_and_the_command_says_what_to_install(tmp_path):
    """The core and the [hf] extra import, and the library probes; the command answers in one line."""
    # A process where torchtune, torchao, omegaconf and datasets cannot be imported, as after
    # `pip install adaptive-batch` alone.
    script = textwrap.dedent("""
        import json, sys
        for name in ("torchtune", "torchao", "omegaconf", "datasets"):
            sys.modules[name] = None
        import torch
        from adaptive_batch import find_max_batch_size
        from adaptive_batch.command import main
        from adaptive_batch.hf import AdaptiveBatchTrainer  # the [hf] extra needs no torchtune either

        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(batch):
            model(batch).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        found = find_max_batch_size(step, make_batch=lambda b: torch.randn(b, 64), model=model, optimizer=optimizer,
                                    max_memory="8MiB", max_batch_size=4096)
        print(json.dumps({"found": found, "command": main(["plan", "--config", "x.yaml"])}))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert 1 < result["found"] < 4096 and result["command"] == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: the adaptive-batch command plans and probes torchtune configs and needs omegaconf, which is not "
        "installed: pip install 'adaptive-batch[torchtune]' (the library itself, `import adaptive_batch`, does not "
        "need it)."
    ]
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_pip_resolves_the_core_and_the_hf_extra_without_torchtune(tmp_path):
    """What `pip install 'adaptive-batch[hf]'` would install into an empty environment, as pip
    resolves it (a dry run from the package index)."""
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
         f"{REPO}[hf]"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"adaptive-batch", "torch", "torchdata", "transformers", "accelerate"} <= names
    assert not names & {"torchtune", "torchao", "omegaconf", "datasets", "kagglehub", "pandas", "pyarrow"}
