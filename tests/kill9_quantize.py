"""SIGKILL `rq quantize` at random points; afterwards an earlier output must still load, the killed run's
output must be absent or complete, and the next run must leave no temp folders behind.

    python3 tests/kill9_quantize.py --runs 20 [--seed 0] [--keep DIR]

Prints one result line and exits 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECIPE = HERE / "data" / "tiny-rtn.toml"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}


def _quantize_cmd(src: Path, out: Path) -> list[str]:
    # small shards: many files, so a kill often lands between or inside shard writes
    return [sys.executable, "-m", "rq_cli.main", "quantize", str(src), "--recipe", str(RECIPE), "-o", str(out),
            "--shard-size", "16KB", "--json"]


def _temps(root: Path, out: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(f".{out.name}.tmp-"))


def _loads(path: Path) -> str:
    """'' when the checkpoint loads and runs a forward pass, else why not."""
    import mlx.core as mx

    from rq_core.checkpoint import load

    try:
        ck = load(path, tokenizer=False)
        mx.eval(ck.model(mx.array([[1, 2, 3]])))
    except Exception as e:  # any failure to load is what this script reports
        return f"{type(e).__name__}: {e}"
    return ""


def _timed_run(src: Path, out: Path, root: Path) -> tuple[float, float]:
    """One whole run into `out`: (its duration, the time from its temp folder's mkdir to the output's rename)."""
    t0 = time.monotonic()
    p = subprocess.Popen(_quantize_cmd(src, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t_tmp = t_out = None
    mine = root / f".{out.name}.tmp-{p.pid}"
    while p.poll() is None:
        if t_tmp is None and mine.exists():
            t_tmp = time.monotonic()
        if t_out is None and out.exists():
            t_out = time.monotonic()
        time.sleep(0.0005)
    end = time.monotonic()
    if p.returncode != 0:
        raise SystemExit(f"kill9_quantize: the first run failed: {p.stderr.read().decode(errors='replace')[-500:]}")
    return end - t0, (t_out or end) - (t_tmp or t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, default=None, help="Work in this folder and keep it (default: a temp one).")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    sys.path[:0] = [str(ROOT), str(HERE)]
    from _tiny_models import make_tiny

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="rq-kill9-")) if args.keep is None else args.keep
    root.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    killed = finished = 0
    where = {"before writing": 0, "writing": 0, "published": 0}
    stale: set[str] = set()  # temp folders that kills left behind (each counted once)
    left: list[Path] = []
    try:
        src = make_tiny("qwen3_moe", root / "src", dtype="bfloat16")
        prev, cur = root / "prev", root / "cur"
        full, writing = _timed_run(src, prev, root)  # kills land anywhere in a run, or while it writes
        if _loads(prev):
            problems.append(f"the first output does not load: {_loads(prev)}")
        for i in range(args.runs):
            if cur.exists():  # a run that finished before its kill: remove this script's own output
                shutil.rmtree(cur)
            p = subprocess.Popen(_quantize_cmd(src, cur), env=_env(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)
            if i % 2:  # anywhere: start-up, reading, writing, publishing
                time.sleep(rng.uniform(0.0, full * 1.1))
            else:  # once the temp folder exists: inside the writes and the rename
                while p.poll() is None and not (root / f".{cur.name}.tmp-{p.pid}").exists():
                    time.sleep(0.0005)
                time.sleep(rng.uniform(0.0, writing * 1.1))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                killed += 1
            else:
                finished += 1
            _, err = p.communicate()
            if p.returncode not in (0, -signal.SIGKILL):
                problems.append(f"run {i}: exit {p.returncode}: {err.decode(errors='replace').strip()[-300:]}")
            why = _loads(prev)
            if why:
                problems.append(f"run {i}: the earlier output no longer loads: {why}")
            if cur.exists() and _loads(cur):
                problems.append(f"run {i}: a half-written output was published: {_loads(cur)}")
            temps = _temps(root, cur)
            stale.update(t.name for t in temps)
            if p.returncode == -signal.SIGKILL:  # where the kill landed, judged by what it left
                own = (root / f".{cur.name}.tmp-{p.pid}").exists()
                where["published" if cur.exists() else "writing" if own else "before writing"] += 1
        # the next run (to completion) removes what the killed ones left
        if cur.exists():
            shutil.rmtree(cur)
        r = subprocess.run(_quantize_cmd(src, cur), env=_env(), capture_output=True)
        if r.returncode != 0:
            problems.append(f"the run after the kills failed: {r.stderr.decode(errors='replace').strip()[-300:]}")
        left = _temps(root, cur) + _temps(root, prev)
        if left:
            problems.append(f"temp folders left after the next run: {', '.join(p.name for p in left)}")
        if _loads(cur):
            problems.append(f"the run after the kills wrote an output that does not load: {_loads(cur)}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    status = "OK" if not problems else "FAILED"
    landed = ", ".join(f"{n} {k}" for k, n in where.items())
    print(f"kill9_quantize: {args.runs} runs ({killed} killed: {landed}; {finished} finished first), earlier output "
          f"loaded after every run: {not any('earlier output' in p for p in problems)}, temp folders left by "
          f"kills {len(stale)}, after the next run {len(left)}: {status}")
    for p in problems:
        print(f"  {p}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
