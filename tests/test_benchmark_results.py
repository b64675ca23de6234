"""benchmarks/_readme.py, run as the benchmarks run it: a results file carries its date, machine, MLX version and
command, and README.md's result tables are what the committed results files say."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_PY = ROOT / "benchmarks" / "_readme.py"
RESULTS = ROOT / "benchmarks" / "results"


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


def test_results_files_the_readmes_name_exist():
    """A table block or a `benchmarks/results/NAME.json` path in README.md or benchmarks/README.md names a file that
    is there: a results file that goes missing fails here."""
    text = (ROOT / "README.md").read_text() + (ROOT / "benchmarks" / "README.md").read_text()
    named = set(re.findall(r"<!-- results:([a-z0-9_-]+) -->", text))  # lower case: not the how-to's NAME
    named |= set(re.findall(r"(?<![\w/])(?:benchmarks/)?results/([a-z0-9_-]+)\.json", text))
    assert named, "the READMEs name no results files"
    missing = sorted(n for n in named if not (RESULTS / f"{n}.json").is_file())
    assert not missing, f"named in the READMEs, missing from benchmarks/results/: {missing}"


def test_every_results_file_is_written_by_its_benchmark():
    """Each benchmarks/results/NAME.json names the command that wrote it: a script in benchmarks/ that still writes
    NAME (saves under that name). A file its script no longer writes is stale."""
    stale = []
    for p in sorted(RESULTS.glob("*.json")):
        cmd = shlex.split(json.loads(p.read_text()).get("command", ""))  # no command: not written by save()
        script = ROOT / cmd[1] if len(cmd) > 1 else RESULTS
        if not (script.is_file() and script.parent.name == "benchmarks"
                and re.search(rf"""["']{re.escape(p.stem)}["']""", script.read_text())):
            stale.append(p.name)
    assert not stale, f"no benchmark writes these: {stale}"
