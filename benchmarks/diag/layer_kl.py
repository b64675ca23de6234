"""Which layers' compressed K/V make the default cache's KL against fp16 (session 18 study; CPU, bundled model).

    python benchmarks/diag/layer_kl.py [--windows 8] [--out JSON]

Rows: the default isoquant3 cache in every layer; then each layer alone compressed (the others fp16); then each
layer alone with keys only / values only compressed where --split is given. Same windows, tokens and scoring as
benchmarks/kv_study.py (prefill half, decode-scored in steps of 32), so the rows are paired.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.kv_study import Setting, paired_stats, token_logprobs  # noqa: E402
from rq_core import eval as ev  # noqa: E402
from rq_core.kv_cache import KVSettings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--step", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/s18_2026-12-01/layer_kl.json"))
    ap.add_argument("--extra", default="", help="comma-separated extra rows: kbits4 (keys 4-bit scalar everywhere)")
    args = ap.parse_args()
    em = ev.load_eval_model(None)
    ids = ev.encode_ids(em.tokenizer, ev.load_heldout_text())
    ctx = ev.check_context(args.context, em.context)
    prefill = ctx // 2
    wins = ev.windows(ids, ctx, args.windows)
    n = int(em.config["num_hidden_layers"])
    t = time.time()
    ref_lp, _, ref_full = token_logprobs(em.model, wins, Setting("fp16", KVSettings(mode="fp16")),
                                         prefill=prefill, step=args.step)
    print(f"fp16 ppl {math.exp(-ref_lp.mean()):.3f} [{time.time() - t:.0f} s]", flush=True)
    default = KVSettings(mode="isoquant3", fp16_window=32)
    rows = [Setting("default, all layers", default)]
    rows += [Setting(f"default, layer {i} only", default, fp16_layers=tuple(j for j in range(n) if j != i))
             for i in range(n)]
    out = {"windows": args.windows, "context": ctx, "step": args.step, "ppl_fp16": math.exp(-ref_lp.mean()), "rows": []}
    for s in rows:
        t = time.time()
        lp, kl, _ = token_logprobs(em.model, wins, s, prefill=prefill, step=args.step, ref_full=ref_full)
        st = paired_stats(ref_lp - lp)
        r = {"name": s.name, "mean_kl": float(kl.mean()), "p99_kl": float(np.quantile(kl, 0.99)),

             "window_kl": [float(x) for x in kl.mean(axis=1)], **st, "seconds": round(time.time() - t, 1)}
        out["rows"].append(r)
        print(f"{s.name:28s} KL {r['mean_kl']:.4f} p99 {r['p99_kl']:.3f} dNLL {st['d_nll']:+.4f} ± "
              f"{1.96 * st['se']:.4f} [{r['seconds']} s]", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
