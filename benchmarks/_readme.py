"""The benchmarks' results: one JSON file a script, and the README tables made from them.

    python3 benchmarks/_readme.py          # rewrite README.md's result tables from benchmarks/results/*.json
    python3 benchmarks/_readme.py --check  # exit 1 if a table is not what its results file says

A benchmark calls save(name, data, table): benchmarks/results/<name>.json gets `data`, the run's date, machine, MLX
version and command line, and `table` (markdown). A rerun overwrites the file; git keeps the history. README.md holds
a table between `<!-- results:NAME -->` and `<!-- /results:NAME -->`; main() rewrites each such block from NAME.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def machine() -> str:
    """CPU architecture and OS, and the accelerator MLX runs on."""
    desc = f"{platform.machine()} {platform.system()}"
    try:
        import mlx.core as mx

        dev = mx.default_device()
        if dev.type == mx.DeviceType.gpu:
            desc += ", " + str(mx.device_info().get("device_name", "GPU"))
        else:
            desc += ", CPU"
    except Exception:
        pass
    return desc


def meta() -> dict:
    try:
        import mlx.core as mx

        mlx = mx.__version__
    except Exception:
        mlx = None
    cmd = ["python3", os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]
    return {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "mlx": mlx, "command": shlex.join(cmd)}


def save(name: str, data: dict, table: str, path: Path | None = None) -> Path:
    """Write benchmarks/results/<name>.json (or `path`): the run's metadata (a key of `data` wins), `data` and the
    markdown `table`."""
    out = {**meta(), **data, "table": table.rstrip()}
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)
    return path


def block(name: str) -> str:
    """README block of one results file: its table, then where and how it was measured."""
    d = json.loads((RESULTS / f"{name}.json").read_text())
    mlx = f", MLX {d['mlx']}" if d.get("mlx") else ""
    return f"{d['table']}\n\n{d['date']}, {d['machine']}{mlx}; `{d['command']}` (`benchmarks/results/{name}.json`)\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 if a table is stale")
    a = ap.parse_args()
    text = README.read_text()
    new = BLOCK.sub(lambda m: m.group(1) + block(m.group(2)) + m.group(4), text)
    if a.check:
        sys.exit(0 if new == text else 1)
    if new != text:
        README.write_text(new)
    print(f"{len(BLOCK.findall(text))} tables in {README.name}", file=sys.stderr)


if __name__ == "__main__":
    main()
