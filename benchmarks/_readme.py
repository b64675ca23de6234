"""Replace one marked section of benchmarks/README.md (each benchmark owns its section)."""

from __future__ import annotations

import os
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"


def write_section(name: str, body: str) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = README.read_text() if README.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    tmp = README.with_name(README.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, README)
