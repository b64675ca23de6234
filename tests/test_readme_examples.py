"""Every `rq` example of README.md's bash blocks runs: in README order, in one temporary folder (a later example uses
what an earlier one wrote: the float copy, the quantized checkpoint, its pages), offline, against the bundled model,
each exiting 0. The examples that cannot run here are listed below with the reason; each must still be in the README."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# (text in the example, why it does not run here)
SKIP = (
    ("Qwen/Qwen3-30B-A3B", "downloads Qwen3-30B-A3B from the Hugging Face hub"),
    ("qwen3-rq", "a checkpoint quantized from the hub model"),
    ("rq eval gates", "minutes on a CPU and exits 1 by design when a gate fails (tests/test_eval.py runs the gates)"),
)
# (text in the example, what its output must show)
EXPECT = (
    ("rq run shakespeare-rq", "pager lru:"),  # the quantized copy ran with its experts paged from disk
    ("rq run --pages", "pager lru:"),
    ('rq run --prompt "ROMEO:"   #', "KV auto: "),
)


def examples() -> list[str]:
    """The `rq ...` lines of the README's ```bash blocks, in order."""
    out, in_bash = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
            continue
        if in_bash and line.startswith("rq "):
            out.append(line)
    return out


def _skip_reason(cmd: str) -> str | None:
    return next((why for text, why in SKIP if text in cmd), None)


RUN = [c for c in examples() if _skip_reason(c) is None]


def test_the_examples_are_found_and_every_skip_is_in_the_readme():
    cmds = examples()
    assert len(RUN) >= 12, cmds
    for text, why in SKIP:
        assert any(text in c for c in cmds), f"SKIP entry {text!r} ({why}) matches no README example"
    for text, _ in EXPECT:
        assert any(text in c for c in RUN), f"EXPECT entry {text!r} matches no README example that runs"
    # the offline chain: a float copy, quantized, packed, run within a budget
    chain = [next(i for i, c in enumerate(RUN) if c.startswith(p)) for p in
             ("rq dequantize", "rq quantize shakespeare-f16", "rq pack shakespeare-rq", "rq run shakespeare-rq")]
    assert chain == sorted(chain)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> dict:
    """A folder to run in (also HOME, for ~/...), with an `rq` on PATH that runs this checkout."""
    d = tmp_path_factory.mktemp("readme")
    bindir = d / ".bin"
    bindir.mkdir()
    shim = bindir / "rq"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rq_cli.main "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "HOME": str(d), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    return {"dir": d, "env": env}


@pytest.mark.xdist_group("readme")  # one worker runs them all, in order (a later example reads what an earlier wrote)
@pytest.mark.parametrize("cmd", RUN, ids=[re.sub(r"\s+", " ", c.split("#")[0]).strip()[:60] for c in RUN])
def test_readme_example_runs(cmd: str, workdir: dict):
    r = subprocess.run(["bash", "-c", cmd], cwd=workdir["dir"], env=workdir["env"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}\nexit {r.returncode}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr
    for text, want in EXPECT:
        if text in cmd:
            assert want in r.stdout + r.stderr, f"{cmd}: no {want!r} in its output\n{r.stderr[-2000:]}"
