"""The ``adaptive-batch`` console script: the torchtune extra's command, or one line saying how
to install it.

The command plans and probes torchtune configs, so it needs ``adaptive-batch[torchtune]``; the
core installs without torchtune, and the script must still answer in one line there.
"""

import sys
from typing import List, Optional

# What the torchtune extra brings (pyproject.toml's `torchtune` extra).
TORCHTUNE_EXTRA = ("torchtune", "torchao", "omegaconf")


def main(argv: Optional[List[str]] = None) -> int:
    """Runs :func:`adaptive_batch.torchtune.cli.main`, or says which extra is missing.

    Returns:
        The command's exit code; 1 when the torchtune extra is not installed.
    """
    try:
        from adaptive_batch.torchtune.cli import main as torchtune_main
    except ModuleNotFoundError as e:
        if e.name not in TORCHTUNE_EXTRA:
            raise
        print(
            f"error: the adaptive-batch command plans and probes torchtune configs and needs {e.name}, which is not "
            "installed: pip install 'adaptive-batch[torchtune]' (the library itself, `import adaptive_batch`, does "
            "not need it).",
            file=sys.stderr,
        )
        return 1
    return torchtune_main(argv)


if __name__ == "__main__":
    sys.exit(main())
