"""benchmarks/_readme.py, run as the benchmarks run it: a results file carries its date, machine, MLX version and
command, and README.md's result tables are what the committed results files say."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_PY = ROOT / "benchmarks" / "_readme.py"


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, **kw)


def test_save_records_where_and_how(tmp_path):
    out = tmp_path / "x.json"
    code = (f"import runpy; runpy.run_path({str(README_PY)!r})['save']"
            f"('x', {{'rows': [1, 2], 'machine': 'kept'}}, '| a |\\n', {str(out)!r})")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["rows"] == [1, 2] and d["table"] == "| a |"
    assert d["machine"] == "kept"  # a run's own fields win over this process's
    assert d["date"].endswith("UTC") and d["command"].startswith("python3 ") and "mlx" in d


def test_readme_tables_match_the_results_files():
    names = re.findall(r"<!-- results:([\w-]+) -->", (ROOT / "README.md").read_text())
    assert names, "README.md has no results tables"
    for name in names:
        assert (ROOT / "benchmarks" / "results" / f"{name}.json").is_file(), name
    r = _run(str(README_PY), "--check")
    assert r.returncode == 0, "README.md's tables are stale: run python3 benchmarks/_readme.py"
