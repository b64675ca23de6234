"""A few rounds of tests/kill9_quantize.py: SIGKILL `rq quantize` at random points; an earlier output still
loads, nothing half-written is published, and the next run leaves no temp folders."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("kill9_quantize.py")


def test_kill9_quantize_few_runs():
    p = subprocess.run([sys.executable, str(SCRIPT), "--runs", "4", "--seed", "3"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and ": OK" in p.stdout, p.stdout + p.stderr
    assert "4 runs" in p.stdout and "after the next run 0" in p.stdout, p.stdout
