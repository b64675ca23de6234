"""Split an Nsight Compute per-instruction SASS export (`ncu --page source --csv --print-source sass`) into the
kernel's prologue, main loop and epilogue: warp-stall samples and executed instructions of each part.

    python3 benchmarks/diag/sass_buckets.py sass.csv[.gz]

The main loop is the backward branch whose body holds the most HMMA instructions (attn_v5's warp step)."""

from __future__ import annotations

import csv
import gzip
import re
import sys


def rows(path: str) -> list[tuple[int, str, int, int]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        lines = [ln for ln in f if not ln.startswith('"Kernel Name"')]
    out = []
    for r in csv.DictReader(lines):
        try:
            out.append((int(r["Address"], 16), r["Source"].strip(), int(r["Warp Stall Sampling (All Samples)"] or 0),
                        int(r["Instructions Executed"] or 0)))
        except (KeyError, ValueError):
            continue
    return out


def main_loop(ins: list[tuple[int, str, int, int]]) -> tuple[int, int]:
    best = (-1, 0, 0)
    for a, text, _, _ in ins:
        m = re.search(r"BRA\s+(?:`?\(?)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a:
            lo = int(m.group(1), 16)
            n = sum("HMMA" in t for b, t, _, _ in ins if lo <= b <= a)
            if n > best[0] or (n == best[0] and a - lo < best[2] - best[1]):
                best = (n, lo, a)
    return best[1], best[2]


def main() -> int:
    ins = rows(sys.argv[1])
    lo, hi = main_loop(ins)
    total = sum(s for _, _, s, _ in ins) or 1
    parts = {"prologue": [i for i in ins if i[0] < lo], "main loop": [i for i in ins if lo <= i[0] <= hi],
             "epilogue": [i for i in ins if i[0] > hi]}
    print(f"main loop {lo:#x}-{hi:#x}: {len(parts['main loop'])} instructions; samples in all {total}")
    for name, p in parts.items():
        s = sum(x[2] for x in p)
        bar = sum(x[2] for x in p if x[1].startswith("BAR") or " BAR." in x[1])
        print(f"{name:10s} samples {s:8d} ({100 * s / total:5.1f}%)  at barriers {100 * bar / total:5.1f}%  "
              f"instructions executed {sum(x[3] for x in p):12d}")
    reasons = loop_stall_reasons(sys.argv[1], lo, hi)
    if reasons:
        n = sum(reasons.values()) or 1
        print("main loop's warp states (samples): " + ", ".join(
            f"{k.removeprefix('stall_')} {100 * v / n:.1f}%" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])
            if v > 0))
    return 0


def loop_stall_reasons(path: str, lo: int, hi: int) -> dict[str, int]:
    """Samples by warp state (ncu's stall_* columns: `selected` is issuing) over the instructions in [lo, hi]."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        lines = [ln for ln in f if not ln.startswith('"Kernel Name"')]
    out: dict[str, int] = {}
    for r in csv.DictReader(lines):
        try:
            a = int(r["Address"], 16)
        except (KeyError, ValueError):
            continue
        if lo <= a <= hi:
            for k, v in r.items():
                if k and k.startswith("stall_") and "(Not Issued)" not in k and v not in ("", "-"):
                    out[k] = out.get(k, 0) + int(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
