import os
import re
import subprocess
import sys
import textwrap
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
    output_dir,
    *overrides,
    headroom_bytes=None,
    timeout=600,
    recipe=RECIPE,
    config=CONFIG,
    extra_path=None,
    env=None,
    nproc=None,
) -> subprocess.CompletedProcess:
    """`tune run` of a recipe on a tiny config, optionally under a real address-space limit.

    ``extra_path`` goes on PYTHONPATH (a user's own modules); ``env`` adds variables; ``nproc``
    launches that many processes through torchrun (`tune run --nproc_per_node`).
    """
    launch = [] if nproc is None else ["--nproc_per_node", str(nproc)]
    args = ["run", *launch, recipe, "--config", config, f"output_dir={output_dir}", *overrides]
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


@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    """The user's own module, outside the repository."""
    where = tmp_path_factory.mktemp("user_code")
    (where / "my_growth.py").write_text(
        textwrap.dedent(
            """
            import os

            def table(epoch, current_batch_size):
                return {1: 2, 2: 4}.get(epoch, 0)

            def add_three_first(epoch, current_batch_size):
                return 3 if epoch == 0 else 0

            def double_or_stop(epoch, current_batch_size):
                if str(epoch) == os.environ.get("STOP_AT_EPOCH"):
                    raise RuntimeError("preempted")
                return current_batch_size if epoch > 0 else 0
            """
        )
    )
    return where
