"""Where attn_v5's time goes inside one launch: every block's thread 0 stamps the device's ns timer and its SM's
cycle counter at the phase ends of `rq_core.kernels.V5_TRACE_PHASES` (attention_v5(trace=True), CUDA only).

    python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 [--reps 5] [--json OUT.json]

Prints, per context, the launch's span (first block's start to the last block's last stamp), then for each phase
the median and the maximum over blocks of its end since the first block's start (ns timer), and the median over
blocks of the phase's own length (SM cycles, converted with the clock rate the two counters give). The stamps cost a
few instructions each: compare the span with `kernel_time.py`'s time of the untraced kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def summarize(tr, phases: tuple[str, ...]) -> dict:
    """tr: uint32 [groups, ns, 16, 2] of one launch -> phase table (µs)."""
    import numpy as np

    import rq_core.kernels as K

    blocks = tr.reshape(-1, 16, 2).astype(np.int64)
    t = blocks[:, :, 0]
    c = blocks[:, :, 1]
    t0 = t[:, 0].min()
    rel = (t - t0) % (1 << 32)  # the ns timer's low word, relative to the first block's start
    cyc = (c - c[:, :1]) % (1 << 32)
    last = [b for b in range(len(blocks)) if t[b, 11] != 0]
    order = getattr(K, "V5_TRACE_ORDER", tuple(range(12)))
    done = [k for k in order if k != 0 and (t[:, k] != 0).any()]
    # SM clock (cycles per ns) from blocks that ran long enough for the ns timer's granularity not to matter
    span_b = rel[:, 7] - rel[:, 0]
    ok = span_b > 2000
    ghz = float(np.median(cyc[ok, 7] / span_b[ok])) if ok.any() else 1.755
    out = {"blocks": len(blocks), "clock_ghz": round(ghz, 3),
           "span_us": round(float(max(rel[b, 11] for b in last) if last else rel[:, 7].max()) / 1e3, 2),
           "start_spread_us": round(float(rel[:, 0].max()) / 1e3, 2), "sms": len(set(blocks[:, 15, 0].tolist())),
           "phases": []}
    # blocks resident at once on an SM (their start to partials-written intervals overlapping): whether a grid of more
    # blocks than SMs runs them side by side or in waves (shared memory and registers decide)
    by_sm: dict[int, list[tuple[int, int]]] = {}
    for b in range(len(blocks)):
        by_sm.setdefault(int(blocks[b, 15, 0]), []).append((int(rel[b, 0]), int(rel[b, 7])))
    conc = []
    for iv in by_sm.values():
        ev = sorted([(a, 1) for a, _ in iv] + [(e, -1) for _, e in iv])
        cur = top = 0
        for _, d in ev:
            cur += d
            top = max(top, cur)
        conc.append(top)
    out["resident_max"] = max(conc)
    out["resident_median"] = float(statistics.median(conc))
    for i, k in enumerate(done):
        rows = last if k in getattr(K, "V5_TRACE_LAST", range(8, 14)) else range(len(blocks))  # the last blocks' phases
        prev = done[i - 1] if i > 0 else 0  # a phase a variant skips (no stamp) counts in the next one
        ends = [float(rel[b, k]) / 1e3 for b in rows]
        own = [float(cyc[b, k] - cyc[b, prev]) / ghz / 1e3 for b in rows]
        out["phases"].append({"phase": phases[k], "end_median_us": round(statistics.median(ends), 2),
                              "end_max_us": round(max(ends), 2),
                              "own_median_us": round(statistics.median(own), 2),
                              "own_max_us": round(max(own), 2)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    import mlx.core as mx
    import numpy as np

    import attention as A
    import rq_core.kernels as K

    rng = np.random.default_rng(0)
    res = {}
    for T in [int(x) for x in a.contexts.split(",")]:
        L = A.build(T, 1, rng, qmm=False)
        runs = []
        for r in range(a.reps + 1):
            out, lse, tr = K.attention_v5(L["q"][0], L["mats"][0], L["kc"][0], L["kn"][0], L["vc"][0], L["vn"][0],
                                          L["levels"], bits=A.BITS, scale=A.SCALE, valid_len=T, blocks=a.blocks,
                                          trace=True)
            mx.eval(out, tr)
            if r > 0:  # the first launch compiles
                runs.append(summarize(np.array(tr), K.V5_TRACE_PHASES))
        best = min(runs, key=lambda s: s["span_us"])
        res[T] = {"best": best, "spans_us": [s["span_us"] for s in runs]}
        print(f"== T={T}: {best['blocks']} blocks on {best['sms']} SMs, clock {best['clock_ghz']} GHz, span "
              f"{best['span_us']} µs (runs {res[T]['spans_us']}), blocks' starts spread {best['start_spread_us']} µs, "
              f"resident an SM at once: median {best['resident_median']:g}, max {best['resident_max']}")
        print(f"  {'phase':24s} {'end med':>8s} {'end max':>8s} {'own med':>8s} {'own max':>8s}")
        for p in best["phases"]:
            print(f"  {p['phase']:24s} {p['end_median_us']:8.2f} {p['end_max_us']:8.2f} {p['own_median_us']:8.2f} "
                  f"{p['own_max_us']:8.2f}")
        del L
        mx.clear_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
