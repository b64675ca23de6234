"""Which layers' compressed K/V make the default cache's KL against fp16, and what the first and last layers' caches
at other widths do (session 18 study; CPU, bundled model).

    python benchmarks/diag/layer_kl.py --study layers [--windows 8]   # each layer alone compressed
    python benchmarks/diag/layer_kl.py --study edges [--only NAME,...]  # the first and last layers' caches replaced

Same windows, tokens and scoring as benchmarks/kv_study.py (prefill half, decode-scored in steps of 32), so the rows
of both studies are paired. The default cache here is isoquant3 `wht_so4` with a 32-token window, pair codebooks and
the value gain, and no edge layers (KVSettings' own default): the study that led to kv.edge_layers.
Writes benchmarks/results/s18_2026-12-01/{layer,edge}_kl.json unless --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.kv_study import Setting, paired_stats, token_logprobs  # noqa: E402
from rq_core import eval as ev  # noqa: E402
from rq_core.kv_cache import KVSettings  # noqa: E402

DEFAULT = KVSettings(mode="isoquant3", fp16_window=32)


@dataclass
class EdgeSetting:
    """The default cache with the caches of layers `edges` (negative: from the end) made from `edge`."""
    name: str
    edge: KVSettings
    edges: tuple = (0, -1)
    kv: KVSettings = field(default_factory=lambda: DEFAULT)

    def make_cache(self, model):
        caches = model.make_cache(self.kv)
        n = len(caches)
        edge = model.make_cache(self.edge)
        for i in self.edges:
            caches[i % n] = edge[i % n]
        return caches


def studies(n_layers: int) -> dict[str, list]:
    return {
        "layers": [Setting("default, all layers", DEFAULT)] + [
            Setting(f"default, layer {i} only", DEFAULT, fp16_layers=tuple(j for j in range(n_layers) if j != i))
            for i in range(n_layers)],
        "edges": [
            EdgeSetting("edges fp16", KVSettings(mode="fp16")),
            EdgeSetting("edges K4V4 scalar", KVSettings(mode="isoquant3", bits=4, fp16_window=32)),
            EdgeSetting("edges K4V3 scalar", KVSettings(mode="isoquant3", bits=3, key_bits=4, fp16_window=32)),
            EdgeSetting("edges K3V4 scalar", KVSettings(mode="isoquant3", bits=4, key_bits=3, fp16_window=32)),
            EdgeSetting("first fp16", KVSettings(mode="fp16"), edges=(0,)),
            EdgeSetting("last fp16", KVSettings(mode="fp16"), edges=(-1,)),
        ],
        # the shipped defaults (kv.edge_layers 1) beside the study's default, and turbo3 with the same settings
        "defaults": [Setting("isoquant3 default", replace(DEFAULT, edge_layers=1)),
                     Setting("isoquant3 default, no edge layers", DEFAULT),
                     Setting("turbo3 default", KVSettings(mode="turbo3", fp16_window=32, edge_layers=1))],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", choices=("layers", "edges", "defaults"), required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--step", type=int, default=32)
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_path = Path(args.out or ROOT / "benchmarks/results/s18_2026-12-01" /
                    {"layers": "layer_kl.json", "edges": "edge_kl.json", "defaults": "defaults_kl.json"}[args.study])
    em = ev.load_eval_model(None)
    ids = ev.encode_ids(em.tokenizer, ev.load_heldout_text())
    ctx = ev.check_context(args.context, em.context)
    prefill = ctx // 2
    wins = ev.windows(ids, ctx, args.windows)
    t = time.time()
    ref_lp, _, ref_full, _ = token_logprobs(em.model, wins, Setting("fp16", KVSettings(mode="fp16")),
                                         prefill=prefill, step=args.step)
    print(f"fp16 ppl {math.exp(-ref_lp.mean()):.3f} [{time.time() - t:.0f} s]", flush=True)
    only = [s for s in args.only.split(",") if s]
    rows = [r for r in studies(int(em.config["num_hidden_layers"]))[args.study] if not only or r.name in only]
    out = {"windows": args.windows, "context": ctx, "step": args.step, "ppl_fp16": math.exp(-ref_lp.mean()), "rows": []}
    for s in rows:
        t = time.time()
        lp, kl, _, top1 = token_logprobs(em.model, wins, s, prefill=prefill, step=args.step, ref_full=ref_full)
        st = paired_stats(ref_lp - lp)
        wt = top1.mean(axis=1)  # top-1 agreement per window: its SE over windows, as the KL's
        r = {"name": s.name, "mean_kl": float(kl.mean()), "p99_kl": float(np.quantile(kl, 0.99)),
             "top1_agreement": float(top1.mean()), "top1_se": float(wt.std(ddof=1) / math.sqrt(len(wt))),
             "window_kl": [float(x) for x in kl.mean(axis=1)], "window_top1": [float(x) for x in wt],
             "window_d_nll": [float(x) for x in (ref_lp - lp).mean(axis=1)], **st,
             "seconds": round(time.time() - t, 1)}
        out["rows"].append(r)
        print(f"{s.name:28s} KL {r['mean_kl']:.4f} p99 {r['p99_kl']:.3f} top-1 {r['top1_agreement']:.4f} ± "
              f"{1.96 * r['top1_se']:.4f} dNLL {st['d_nll']:+.4f} ± "
              f"{1.96 * st['se']:.4f} [{r['seconds']} s]", flush=True)
        out_path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
