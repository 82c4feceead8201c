import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/full_finetune_single_device.py"
CONFIG = "configs/tiny/full_single_device.yaml"
TUNE = str(Path(sys.executable).with_name("tune"))
# The tiny config grows the batch each epoch; tests of a fixed batch turn that off.
FIXED = "batch_increase_function=null"


def tune_env(extra_path=None, env=None) -> Dict[str, str]:
    merged = dict(os.environ, **(env or {}))
    # The repo root first, so this `recipes` package wins over the one torchtune installs.
    paths = [str(REPO)] + ([str(extra_path)] if extra_path else [])
    merged["PYTHONPATH"] = os.pathsep.join(paths + ([merged["PYTHONPATH"]] if merged.get("PYTHONPATH") else []))
    return merged


def run_tune(
    output_dir, *overrides, headroom_bytes=None, timeout=600, recipe=RECIPE, config=CONFIG, extra_path=None, env=None
) -> subprocess.CompletedProcess:
    """`tune run` of a recipe on a tiny config, optionally under a real address-space limit.

    ``extra_path`` goes on PYTHONPATH (a user's own modules); ``env`` adds variables.
    """
    args = ["run", recipe, "--config", config, f"output_dir={output_dir}", *overrides]
    if headroom_bytes is None:
        cmd = [TUNE, *args]
    else:
        cmd = [sys.executable, str(REPO / "tests/recipes/limited_run.py"), str(headroom_bytes), *args]
    return subprocess.run(
        cmd, cwd=REPO, env=tune_env(extra_path, env), capture_output=True, text=True, timeout=timeout
    )


def read_metric_log(output_dir, logs="logs") -> List[Dict[str, float]]:
    """The `Step N | key:value ...` lines torchtune's DiskLogger writes, one dict a step."""
    (log_file,) = list(Path(output_dir, logs).glob("log_*.txt"))
    rows = []
    for line in log_file.read_text().splitlines():
        m = re.match(r"Step (\d+) \| (.*)", line)
        if m:
            row = {"step": int(m.group(1))}
            row.update({k: float(v) for k, v in (kv.split(":") for kv in m.group(2).split())})
            rows.append(row)
    return rows


@pytest.fixture
def tune():
    return run_tune
