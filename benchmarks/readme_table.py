"""Puts a benchmark's table into the README or the docs page that holds its markers."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def write_readme_table(name: str, table: str) -> bool:
    """Replaces what lies between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in the page
    that has both.

    Returns:
        Whether a page had both markers (nothing is written otherwise).
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    for page in PAGES:
        text = page.read_text()
        if start in text and end in text:
            head, rest = text.split(start, 1)
            page.write_text(f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}")
            return True
    return False
