"""The configuration keys table of docs/configuration.md, made from the option dataclasses.

    python docs/keys_table.py           # prints the table
    python docs/keys_table.py --write   # puts it into docs/configuration.md

Each key's default is the field's, its meaning the section docstring's ``Attributes:`` entry,
so the table cannot drift from the code (``tests/test_docs.py`` compares them).
"""

import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Dict

from adaptive_batch import AdaptiveBatchOptions

PAGE = Path(__file__).resolve().parent / "configuration.md"
START, END = "<!-- keys:start -->", "<!-- keys:end -->"


def attribute_docs(cls) -> Dict[str, str]:
    """``name: text`` entries of a Google-style ``Attributes:`` section, continuations joined."""
    doc = inspect.getdoc(cls) or ""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    section = re.split(r"\n\S", section, maxsplit=1)[0]  # up to the next section
    entries: Dict[str, str] = {}
    name = None
    for line in section.split("\n"):
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            name = m.group(1)
            entries[name] = m.group(2).strip()
        elif name and line.startswith("        "):
            entries[name] += " " + line.strip()
    return entries


def _markdown(text: str) -> str:
    """reST literals and roles as Markdown; ``None`` as the config's ``null``."""
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", text)
    text = text.replace("``None``", "``null``").replace("``", "`")
    return text.replace("|", "\\|")


def _default(field: dataclasses.Field) -> str:
    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    return "`null`" if value is None else f"`{value}`"


def keys_table() -> str:
    """One row per key of every section of :class:`AdaptiveBatchOptions`."""
    rows = ["| key | section | default | meaning |", "|---|---|---|---|"]
    for section in dataclasses.fields(AdaptiveBatchOptions):
        cls = section.default_factory
        docs = attribute_docs(cls)
        for field in dataclasses.fields(cls):
            meaning = _markdown(docs.get(field.name, ""))
            rows.append(f"| `{field.name}` | {section.name} | {_default(field)} | {meaning} |")
    return "\n".join(rows)


def main() -> int:
    table = keys_table()
    if "--write" not in sys.argv:
        print(table)
        return 0
    text = PAGE.read_text()
    head, rest = text.split(START, 1)
    PAGE.write_text(f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
