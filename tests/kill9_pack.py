"""kill -9 `rq pack` and re-packs at random points; afterwards the previous pack (if any) must still load
and give the same greedy tokens, and the next load must leave no temp folders behind.

    python3 tests/kill9_pack.py --runs 20 [--seed 0]
    python3 tests/kill9_pack.py --move --runs 10 [--seed 0]

--move: `rq pack --move` (pages, then the shards rewritten without the routed experts) killed the same ways on
a fresh copy each run; afterwards the checkpoint must still load all-resident with the same greedy tokens,
and `rq pack --move` run again must finish the move (same tokens, all-resident and paged, no temp files).

Works on a copy of the bundled model. Half the kills come at a random time after the start, the other
half at a random write/rename point (a driver wraps os.fsync, os.replace and shutil.rmtree and kills
itself before or after the chosen call), so the short window between the two renames is hit too.
Prints one result line; exit status 1 on the first failure.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IDS = list(range(3, 43))  # 40 tokens: the prefill routes to every expert
SLOTS = 2  # of 8 experts per layer: most reads come from the pages

DRIVER = r"""
import os, shutil, signal, sys
kill_at, seen = int(sys.argv[2]), []
def point(fn):
    def wrapped(*a, **kw):
        for when in ("before", "after"):  # points 2i+1 and 2i+2: before and after call i
            seen.append(f"{when}:{fn.__name__}")
            if len(seen) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if when == "before":
                r = fn(*a, **kw)
        return r
    return wrapped
os.replace, os.fsync, shutil.rmtree = point(os.replace), point(os.fsync), point(shutil.rmtree)
from rq_core.paging.pack import pack
pack(sys.argv[1], move=len(sys.argv) > 3)
print(" ".join(seen))
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _temps(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith(".experts"))


def _paged_tokens(ck: Path) -> list[int]:
    from rq_core.checkpoint import load
    from rq_core.generate import generate
    from rq_core.paging.pager import ExpertPager

    model = load(ck, tokenizer=False, cpu_float32=True).model  # float32: MLX's CPU kernels are faster
    pager = ExpertPager(model, ck, slots=SLOTS)
    try:
        return generate(model, IDS, max_tokens=8, seed=0).tokens
    finally:
        pager.close()


def _points(ck: Path, *move: str) -> list[str]:
    """The write/rename points of one pack of CK, in order (a real pack, killed at none)."""
    r = subprocess.run([sys.executable, "-c", DRIVER, str(ck), "0", *move], env=_env(), capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"kill9_pack: the pack driver failed: {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout.split()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--move", action="store_true", help="kill `rq pack --move` instead")
    a = ap.parse_args(argv)
    if a.move:
        return main_move(a)

    from rq_core.checkpoint import DEFAULT_MODEL, load
    from rq_core.errors import RQError
    from rq_core.generate import generate
    from rq_core.paging.pack import pack

    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="rq-kill9-"))
    try:
        ck = tmp / "m"
        shutil.copytree(DEFAULT_MODEL, ck, ignore=shutil.ignore_patterns("experts", ".experts*"))
        ref = generate(load(ck, tokenizer=False, cpu_float32=True).model, IDS, max_tokens=8, seed=0).tokens
        points = {"first": _points(ck)}  # a first pack (no experts/ yet)
        points["repack"] = _points(ck)  # a re-pack over the one just written
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rq_cli.main", "pack", str(ck)], env=_env(), check=True,
                       capture_output=True, timeout=300)
        pack_s = time.perf_counter() - t0
        if _paged_tokens(ck) != ref:
            raise SystemExit("kill9_pack: a clean pack does not give the resident tokens")
        tally = {"first": 0, "repack": 0, "by_time": 0, "by_point": 0, "mid_swap": 0, "finished": 0,
                 "loaded": 0}
        for i in range(a.runs):
            kind = "repack" if rng.random() < 0.6 else "first"
            if kind == "first":
                shutil.rmtree(ck / "experts", ignore_errors=True)
            elif not (ck / "experts" / "index.json").is_file():
                pack(ck)
            tally[kind] += 1
            before = _paged_tokens(ck) if kind == "repack" else None
            if i % 2:  # at a write/rename point
                pts = points[kind]
                swap = [j + 1 for j, w in enumerate(pts) if w.endswith(":replace")]
                # half of these right at a rename (the window between the two renames is a point or two)
                k = rng.choice(swap) if rng.random() < 0.5 else rng.randint(1, len(pts))
                p = subprocess.Popen([sys.executable, "-c", DRIVER, str(ck), str(k)], env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                tally["by_point"] += 1
            else:  # at a random time
                p = subprocess.Popen([sys.executable, "-m", "rq_cli.main", "pack", str(ck)], env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(rng.uniform(0.3, 1.1) * pack_s)  # the first 30% is mostly imports
                p.send_signal(signal.SIGKILL)
                tally["by_time"] += 1
            _, err = p.communicate(timeout=300)
            if p.returncode == 0:
                tally["finished"] += 1
            elif p.returncode != -signal.SIGKILL:
                raise SystemExit(f"kill9_pack: run {i}: pack failed on its own: {err.decode()[-300:]}")
            if (ck / f".experts.old-{p.pid}").is_dir() and not (ck / "experts").exists():
                tally["mid_swap"] += 1
            try:
                got = _paged_tokens(ck)  # the next run: recovers, cleans up, loads
            except RQError as e:
                if kind == "repack":
                    raise SystemExit(f"kill9_pack: run {i}: the previous pack no longer loads: {e}")
                got = None
            if got is not None:
                tally["loaded"] += 1
                if got != ref or (before is not None and got != before):
                    raise SystemExit(f"kill9_pack: run {i} ({kind}): tokens changed after the kill")
            left = _temps(ck)
            if left:
                raise SystemExit(f"kill9_pack: run {i} ({kind}): the next run left temp folders: {left}")
        print(f"kill9_pack: {a.runs} runs ({tally['first']} first packs, {tally['repack']} re-packs; "
              f"{tally['by_time']} killed at a random time, {tally['by_point']} at a write/rename point, "
              f"{tally['mid_swap']} between the two renames, {tally['finished']} finished first): "
              f"{tally['loaded']} loads after the kill, all with the resident greedy tokens; every re-pack's "
              f"previous pack still loaded; no temp folders left: OK")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _resident_tokens(ck: Path) -> list[int]:
    from rq_core.checkpoint import load
    from rq_core.generate import generate

    return generate(load(ck, tokenizer=False, cpu_float32=True).model, IDS, max_tokens=8, seed=0).tokens


def _leftovers(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("."))


def main_move(a: argparse.Namespace) -> int:
    from rq_core.checkpoint import DEFAULT_MODEL
    from rq_core.paging.pack import moved_experts, pack

    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="rq-kill9-move-"))
    try:
        src = tmp / "src"
        shutil.copytree(DEFAULT_MODEL, src, ignore=shutil.ignore_patterns("experts", ".experts*"))
        ref = _resident_tokens(src)
        ck = tmp / "m"
        shutil.copytree(src, ck)
        t0 = time.perf_counter()
        pts = _points(ck, "move")
        move_s = time.perf_counter() - t0
        # the points from the pack's swap on: the shards' rewrites (the pages are complete by then)
        late = list(range(min(j + 1 for j, w in enumerate(pts) if w.endswith(":replace")), len(pts) + 1))
        tally = {"by_point": 0, "by_time": 0, "part_moved": 0, "finished": 0}
        for i in range(a.runs):
            shutil.rmtree(ck)
            shutil.copytree(src, ck)
            if i % 2:
                k = rng.choice(late) if rng.random() < 0.5 else rng.randint(1, len(pts))
                p = subprocess.Popen([sys.executable, "-c", DRIVER, str(ck), str(k), "move"], env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                tally["by_point"] += 1
            else:
                p = subprocess.Popen([sys.executable, "-m", "rq_cli.main", "pack", str(ck), "--move"], env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(rng.uniform(0.3, 1.1) * move_s)
                p.send_signal(signal.SIGKILL)
                tally["by_time"] += 1
            _, err = p.communicate(timeout=300)
            if p.returncode == 0:
                tally["finished"] += 1
            elif p.returncode != -signal.SIGKILL:
                raise SystemExit(f"kill9_pack --move: run {i}: pack failed on its own: {err.decode()[-300:]}")
            tally["part_moved"] += p.returncode != 0 and bool(moved_experts(ck))
            if _resident_tokens(ck) != ref:
                raise SystemExit(f"kill9_pack --move: run {i}: the resident tokens changed after the kill")
            pack(ck, move=True)
            if _resident_tokens(ck) != ref or _paged_tokens(ck) != ref:
                raise SystemExit(f"kill9_pack --move: run {i}: tokens changed once the move was finished")
            if not moved_experts(ck) or _leftovers(ck):
                raise SystemExit(f"kill9_pack --move: run {i}: the move did not finish cleanly: {_leftovers(ck)}")
        print(f"kill9_pack --move: {a.runs} runs ({tally['by_time']} killed at a random time, {tally['by_point']} "
              f"at a write/rename point, {tally['part_moved']} killed with experts moved, {tally['finished']} "
              "finished first): every one loaded all-resident with the same tokens, and a second --move finished it "
              "(same tokens all-resident and paged, no temp files): OK")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
