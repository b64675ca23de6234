"""A few runs of tests/kill9_pack.py: re-packs killed with SIGKILL (at random times and right at the
renames) never lose the previous pack, and the next load leaves no temp folders behind."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_killed_packs_never_lose_the_previous_pages():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # seed 2: 4 runs include a kill between the two renames of a re-pack (the window that lost pages)
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "kill9_pack.py"), "--runs", "4", "--seed", "2"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.endswith(": OK") and " 0 between the two renames" not in line, line


def test_killed_moves_always_load_and_finish():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "kill9_pack.py"), "--move", "--runs", "4", "--seed", "1"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.endswith(": OK") and " 0 killed with experts moved" not in line, line
