"""Puts a benchmark's table into the README between its markers."""

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def write_readme_table(name: str, table: str) -> bool:
    """Replaces what lies between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``.

    Returns:
        Whether the README had both markers (nothing is written otherwise).
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = README.read_text()
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    README.write_text(f"{head}{start}\n{table}\n{end}{tail}")
    return True
