"""`make gpu-check`'s script: it must say "no CUDA device" and exit 0 here, and its code path
must keep working (run on the CPU, where it cannot hold a card to a memory fraction)."""

import json
from pathlib import Path
import subprocess
import sys


REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks/gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
from gpu_check import COLUMNS  # noqa: E402


def test_without_cuda_it_says_so_and_exits_cleanly():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "no CUDA device" in run.stdout


def test_the_same_checks_run_on_the_cpu(tmp_path, capsys):
    # In this process (its torch and torchtune are imported already); the script as a process
    # is the test above.
    import gpu_check

    argv = ["--device", "cpu", "--small-only", "--steps", "2", "--small-memory", "128MiB", "--rows", "tiny", "--curve",
            "--out", str(tmp_path)]
    assert gpu_check.main(argv) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    cells = dict(zip(COLUMNS, (c.strip() for c in line.strip("|").split("|"))))
    assert cells["vocab"] == "259" and int(cells["found"]) >= 2 and cells["trains (steps)"] == "yes (2)"
    assert cells["found+1 fresh"] == "n/a (no CUDA)"
    # The row's JSON holds the trials and the curve, and the table can be made again from it.
    row = json.loads((tmp_path / "tiny_128MiB.json").read_text())
    assert row["found"] == int(cells["found"]) and len(row["search"]["trials"]) == int(cells["trial steps"])
    assert [p["batch_size"] for p in row["curve"]][:2] == [1, 2] and row["curve"][-1]["batch_size"] == row["found"]
    assert gpu_check.main(["--table-from", str(tmp_path)]) == 0
    assert line in capsys.readouterr().out


def test_make_gpu_check_uses_a_cuda_torch_as_it_is_and_says_so_without_one():
    python = sys.executable  # this torch is the CPU wheel: nothing to check, and nothing installed
    run = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={python}"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0 and "sees no CUDA device" in run.stdout, run.stdout + run.stderr
    # Where the torch sees a card, the same python runs the script, with only what it lacks added
    # beside it (from the carried wheels, or the index), never .venv's CPU torch.
    dry = subprocess.run(["make", "-n", "gpu-check", "CUDA_TORCH=1", "PYTHON=python3", "GPU_SITE=/tmp/site"],
                         cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "--no-deps --target /tmp/site" in dry.stdout and "torchtune==0.6.1" in dry.stdout
    assert "PYTHONPATH=/tmp/site:" in dry.stdout and "python3 benchmarks/gpu_check.py" in dry.stdout
    assert ".venv" not in dry.stdout


def test_the_zoo_on_a_card_runs_its_code_path_on_the_cpu(tmp_path, capsys):
    # benchmarks/gpu_zoo.py: a model the recipes do not have, probed and trained by the same code
    # the card runs (no fraction to hold, no fresh processes here).
    import gpu_zoo

    argv = ["--device", "cpu", "--models", "convnet", "--max-memory", "96MiB", "--steps", "2", "--out", str(tmp_path)]
    assert gpu_zoo.main(argv) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| convnet")]
    cells = dict(zip(gpu_zoo.COLUMNS, (c.strip() for c in line.strip("|").split("|"))))
    row = json.loads((tmp_path / "convnet_96MiB.json").read_text())
    assert int(cells["found"]) == row["found"] >= 2 and cells["trains (steps)"] == "yes (2)"
    assert row["trial_steps"] == int(cells["trial steps"]) >= 2 and cells["found+1 fresh"] == "n/a (no CUDA)"


def test_without_cuda_the_zoo_says_so_and_exits_cleanly():
    run = subprocess.run([sys.executable, str(SCRIPT.parent / "gpu_zoo.py")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "no CUDA device" in run.stdout, run.stderr[-2000:]
