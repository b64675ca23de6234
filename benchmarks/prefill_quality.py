"""What kv.prefill_fp16 costs in quality: the bundled model's held-out text in windows whose first half is prefilled in
chunks, with the whole prefill kept in fp16 until it ends (kv.prefill_fp16 = all) or at most N prefilled tokens in fp16 (the
bound: later chunks attend to the older tokens compressed, so the prompt's own hidden states change). The second half
is scored in decode steps, as `rq eval ppl` scores it; every mode against fp16 on the same tokens.

    python3 benchmarks/prefill_quality.py [--context 2048] [--windows 4] [--chunk 128] [--bound 128]

Writes benchmarks/results/prefill_quality.json.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rq_core.tools.eval import encode_ids, load_eval_model, load_heldout_text, window_logprobs, windows  # noqa: E402
from rq_core.cache.kv_cache import DEFAULT_FP16_WINDOW, KVSettings  # noqa: E402


def table(out: dict) -> str:
    lines = ["| prefill | ΔPPL vs fp16 | ΔNLL ± 1.96 SE | mean KL | top-1 agreement |", "| --- | --- | --- | --- | --- |"]
    for r in out["rows"]:
        lines.append(f"| {r['mode']} | {100 * r['delta_ppl']:+.2f}% | {r['delta_nll']:+.4f} ± "
                     f"{1.96 * r['delta_nll_se']:.4f} | {r['mean_kl']:.4f} | {r['top1_agreement']:.3f} |")
    p = out["paired"]
    lines.append(f"\n{p['a']} against {p['b']}: ΔNLL {p['delta_nll']:+.4f} ± {1.96 * p['se']:.4f} (1.96 SE over "
                 f"{out['windows']} windows, {out['scored_tokens']} scored tokens)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk (tokens)")
    ap.add_argument("--bound", type=int, default=128, help="kv.prefill_fp16 of the bounded row")
    a = ap.parse_args()
    em = load_eval_model(None)
    ids = encode_ids(em.tokenizer, load_heldout_text())
    wins = windows(ids, a.context, a.windows)
    prefill = a.context // 2
    modes = {"fp16": KVSettings(mode="fp16"),
             "isoquant3 (whole prefill in fp16)": KVSettings(mode="isoquant3", fp16_window=DEFAULT_FP16_WINDOW,
                                                             prefill_fp16=None),
             f"isoquant3, prefill_fp16 {a.bound}": KVSettings(mode="isoquant3", fp16_window=DEFAULT_FP16_WINDOW,
                                                              prefill_fp16=a.bound)}
    nll: dict[str, list[float]] = {m: [] for m in modes}
    kl: dict[str, list[float]] = {m: [] for m in modes}
    top1: dict[str, int] = {m: 0 for m in modes}
    t0 = time.perf_counter()
    count = 0
    for wi, w in enumerate(wins):
        tgt = mx.array(w[prefill + 1:].astype(np.int32))[:, None]
        ref = None
        for m, kv in modes.items():
            lp = window_logprobs(em.model, w, kv, prefill=prefill, step=32, prefill_chunk=a.chunk)
            nll[m].append(float(-mx.take_along_axis(lp, tgt, axis=-1).mean().item()))
            if ref is None:
                ref = lp
            kl[m].append(float((mx.exp(ref) * (ref - lp)).sum(axis=-1).mean().item()))
            top1[m] += int((mx.argmax(ref, axis=-1) == mx.argmax(lp, axis=-1)).sum().item())
        count += int(tgt.shape[0])
        print(f"window {wi + 1}/{len(wins)} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    n = len(wins)
    rows = []
    base = np.array(nll["fp16"])
    for m in modes:
        d = np.array(nll[m]) - base
        se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
        rows.append({"mode": m, "ppl": math.exp(float(np.mean(nll[m]))), "delta_ppl": math.exp(float(d.mean())) - 1,
                     "delta_nll": float(d.mean()), "delta_nll_se": se, "mean_kl": float(np.mean(kl[m])),
                     "top1_agreement": top1[m] / count})
    names = list(modes)
    diff = np.array(nll[names[2]]) - np.array(nll[names[1]])
    paired = {"a": names[2], "b": names[1], "delta_nll": float(diff.mean()),
              "se": float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
              "per_window": [float(x) for x in diff]}
    out = {"device": str(mx.default_device()), "context": a.context, "prefill": prefill, "prefill_chunk": a.chunk,
           "windows": n, "scored_tokens": count, "bound": a.bound, "rows": rows, "paired": paired,
           "seconds": time.perf_counter() - t0}
    body = table(out)
    print(body)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _readme import save

    save("prefill_quality", out, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
