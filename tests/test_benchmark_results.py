"""benchmarks/_readme.py: a results file carries its date, machine, MLX version and command, and README.md's result
tables are what the committed results files say."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _readme  # noqa: E402


def test_save_records_where_and_how(tmp_path):
    path = _readme.save("x", {"rows": [1, 2], "machine": "kept"}, "| a |\n", tmp_path / "x.json")
    d = json.loads(path.read_text())
    assert d["rows"] == [1, 2] and d["table"] == "| a |"
    assert d["machine"] == "kept"  # a run's own fields win over this process's
    assert d["date"].endswith("UTC") and d["command"].startswith("python3 ") and "mlx" in d


def test_readme_tables_match_the_results_files():
    blocks = _readme.BLOCK.findall((ROOT / "README.md").read_text())
    assert blocks, "README.md has no results tables"
    for _, name, _, _ in blocks:
        assert (_readme.RESULTS / f"{name}.json").is_file(), name
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "_readme.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "README.md's tables are stale: run python3 benchmarks/_readme.py"
