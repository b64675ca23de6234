"""The README's quality table on the bundled model: held-out perplexity against a unigram model, then for each KV
cache (fp16, turbo3, IsoQuant-3 with every rotation; --window-row adds the default configuration) ΔPPL, needle
retrieval and the twelve gates of `rq eval gates` (thresholds: rq_core/assets/gates.toml).

    python3 benchmarks/quality.py --window-row 32          # the README's table
    python3 benchmarks/quality.py --only turbo3 --merge    # rerun some rows into the results file
    python3 benchmarks/quality.py --combine a.json b.json:fp16,turbo3 --out c.json   # one table from earlier files

Writes benchmarks/results/quality.json (or --out). On a CPU this takes tens of minutes (the gates' settings decide).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's QR (turbo3's dense rotation) thrashes otherwise

import argparse
import json
import math
import sys
import time

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._readme import RESULTS, save  # noqa: E402
from rq_core.tools import eval as ev  # noqa: E402
from rq_core.cache.kv_cache import DEFAULT_EDGE_LAYERS  # noqa: E402

MODES = [("fp16", None), ("turbo3", None), ("isoquant3", "so3"), ("isoquant3", "so4"), ("isoquant3", "wht"),
         ("isoquant3", "wht_so4")]


def heldout_vs_unigram(em: ev.EvalModel, ids: np.ndarray, windows: int) -> dict:
    """Plain causal perplexity (no cache) on the first `windows` windows of the model's context, and the
    add-one unigram perplexity on the same tokens with counts from the training corpus when present,
    else from the rest of the held-out text (stated in `unigram_counts`)."""
    C = em.context
    wins = ev.windows(ids, C, windows)
    nll = 0.0
    n = 0
    for w in wins:
        logits = em.model(mx.array(w[None, :-1])).astype(mx.float32)[0]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll -= float(mx.take_along_axis(lp, mx.array(w[1:, None]), axis=-1).sum().item())
        n += len(w) - 1
    targets = np.concatenate([w[1:] for w in wins])
    V = int(em.config.get("vocab_size", int(ids.max()) + 1))
    train_ids = ROOT / ".train" / "train_ids.npy"
    if train_ids.is_file():
        counts, src = np.bincount(np.load(train_ids).astype(np.int64), minlength=V), "training corpus"
    else:
        counts, src = np.bincount(ids[len(wins) * C + 1 :].astype(np.int64), minlength=V), "rest of held-out text"
    p = (counts + 1.0) / (counts.sum() + V)
    uni = float(np.exp(-np.log(p[targets]).mean()))
    return {"ppl": math.exp(nll / n), "unigram_ppl": uni, "tokens": n, "context": C, "unigram_counts": src}


# The sample of the README's quality table (what benchmarks/results/quality.json was measured on): 4 windows of 1,024
# tokens and 2 of the full context, 4 prompts, needles at 1,024 and 2,048 tokens; `--set KEY=VALUE` overrides.
SAMPLE = {"windows": 4, "full_windows": 2, "prompts": 4, "niah_lengths": [1024, 2048], "niah_depths": [0.25, 0.75],
          "niah_trials": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--gates", default=None, help="gates TOML (default: the bundled one)")
    ap.add_argument("--ppl-windows", type=int, default=8, help="windows for the held-out vs unigram line")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a [settings] value of the gates file (sample sizes, not thresholds), "
                         "e.g. --set windows=2 --set 'niah_depths=[0.5]'")
    ap.add_argument("--window-row", type=int, action="append", default=[], metavar="N",
                    help="also turbo3 and wht_so4 rows whose caches keep their newest N tokens in fp16")
    ap.add_argument("--pair-row", default="128,32", metavar="K,V",
                    help="IsoQuant-3 wht_so4 rows with pair codebooks of K and V points (kv.pair_points; the default "
                         "128,32 is isoquant3's own), with each --window-row's window ('off': none). The other rows "
                         "are scalar codebooks (the paper's)")
    ap.add_argument("--pair-ablation", action="store_true",
                    help="also the rotation ablation's bare rows with the pair codebooks of --pair-row")
    ap.add_argument("--value-gain", default="on", choices=("on", "off", "both"),
                    help="the compressed rows with kv.value_gain (on: the default), without it (off: labels end in "
                         "+nogain), or both")
    ap.add_argument("--edge-layers", type=int, default=DEFAULT_EDGE_LAYERS, metavar="N",
                    help="the windowed rows' first and last N compressed layers at 4 bits (kv.edge_layers; default "
                         f"{DEFAULT_EDGE_LAYERS}, as rq run; labels end in +eN). The bare rows have none, as the paper")
    ap.add_argument("--only", default="", help="comma-separated row labels to run (e.g. isoquant3/wht_so4+w32)")
    ap.add_argument("--out", type=Path, default=RESULTS / "quality.json", help="results file (default %(default)s)")
    ap.add_argument("--merge", action="store_true",
                    help="add the rows run into the results file (same model and settings required), replacing rows "
                         "of the same label, instead of overwriting it")
    ap.add_argument("--combine", nargs="+", default=None, metavar="FILE[:LABEL,...]",
                    help="run nothing: one table from earlier results files of the same model and settings (each "
                         "file's rows, or only the labels named; a later file's row replaces one of the same label), "
                         "written to --out")
    args = ap.parse_args()
    if args.combine:
        print(render(combine(args.combine, args.out)))
        return

    t0 = time.time()
    em = ev.load_eval_model(args.model)
    ids = ev.encode_ids(em.tokenizer, ev.load_heldout_text())
    cfg = ev.load_gates(args.gates)
    cfg["settings"].update(SAMPLE)  # the table's sample, larger than `rq eval gates`' default
    for kv_pair in args.set:
        key, _, value = kv_pair.partition("=")
        if key not in cfg.get("settings", {}) or key == "":
            raise SystemExit(f"--set: unknown setting {key!r} (known: {', '.join(cfg.get('settings', {}))})")
        cfg["settings"][key] = tomllib.loads(f"v = {value}")["v"]
    base = heldout_vs_unigram(em, ids, args.ppl_windows)
    print(f"held-out ppl {base['ppl']:.2f} vs unigram {base['unigram_ppl']:.2f} ({base['tokens']} tokens)", flush=True)

    runner = ev.GateRunner(em, cfg, ids)
    rows = []
    # the rotation ablation compares bare caches (no fp16 window, as the paper); --window-row adds the
    # default configuration (a window of N newest tokens in fp16) for TurboQuant-3 and IsoQuant-3 wht_so4
    # (scalar codebooks: pair_points (); isoquant3's default is the pair codebooks of --pair-row's rows)
    settings = [ev.kv_settings(mode, rot, fp16_window=0, pair_points=()) for mode, rot in MODES]
    edges = args.edge_layers
    settings += [ev.kv_settings(m, r, fp16_window=n, pair_points=(), edge_layers=edges) for n in args.window_row
                 for m, r in (("turbo3", None), ("isoquant3", "wht_so4"))]
    if args.pair_row != "off":
        from rq_core.codec.codebook import check_pair_points

        pp = check_pair_points(args.pair_row.split(","))
        if args.pair_ablation:
            settings += [ev.kv_settings(mode, rot, fp16_window=0, pair_points=pp) for mode, rot in MODES
                         if mode == "isoquant3"]
        settings += [ev.kv_settings("isoquant3", "wht_so4", fp16_window=n, pair_points=pp, edge_layers=edges if n else 0)
                     for n in args.window_row or ([] if args.pair_ablation else [0])]
    if args.value_gain != "on":
        import dataclasses

        plain = [dataclasses.replace(kv, value_gain=False) for kv in settings if kv.mode != "fp16"]
        settings = ([kv for kv in settings if args.value_gain == "both" or kv.mode == "fp16"]
                    + plain)
    only = {x for x in args.only.split(",") if x}
    unknown = only - {ev.label(kv) for kv in settings}
    if unknown:
        raise SystemExit(f"--only: no row labelled {sorted(unknown)} (add --window-row N for +wN rows)")
    for kv in settings:
        if only and ev.label(kv) not in only:
            continue
        t = time.time()
        rep = runner.run(kv)
        d = rep.as_dict()
        d["seconds"] = round(time.time() - t, 1)
        d["measured"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        rows.append(d)
        print(f"{rep.label}: {rep.passed}/{len(rep.gates)} gates, ΔPPL {rep.details['ppl'] / rep.details['ppl_fp16'] - 1:+.4%}, "
              f"needle {rep.details['needle_accuracy']:.2f} (fp16 {rep.details['needle_accuracy_fp16']:.2f}) "
              f"[{d['seconds']} s]", flush=True)
        for g in rep.gates:
            if not g["passed"]:
                print(f"    FAIL {g['name']}: {g['value']:.4g} ({g['threshold']})", flush=True)

    now = datetime.now(timezone.utc)
    model = Path(em.path).resolve()
    out = {"date": now.strftime("%Y-%m-%d %H:%M UTC"),
           "model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model), "device": str(mx.default_device()),
           "heldout": base, "settings": cfg.get("settings", {}), "thresholds": cfg["gates"], "modes": rows,
           "seconds": round(time.time() - t0, 1)}
    path = args.out
    if args.merge:
        old = json.loads(path.read_text())
        if old["settings"] != out["settings"] or abs(old["heldout"]["ppl"] - base["ppl"]) > 1e-6 * base["ppl"]:
            raise SystemExit(f"--merge: {path} was measured with other settings or another model")
        new_labels = {r["kv"] for r in rows}
        out = dict(old, modes=[r for r in old["modes"] if r["kv"] not in new_labels] + rows,
                   merged=old.get("merged", []) + [out["date"]])
        out.pop("machine", None)  # this run's (save)
    table = render(out)
    save("quality", out, table, path)
    print(table)


def combine(specs: list[str], path: Path) -> dict:
    """One results dict from FILE[:LABEL,...] specs of the same model, settings and held-out text (rows in the order
    given; a later row replaces an earlier one of the same label), written to `path` (date: the first file's)."""
    out: dict | None = None
    rows: dict[str, dict] = {}
    for spec in specs:
        src, _, labels = spec.partition(":")
        d = json.loads(Path(src).read_text())
        keep = [x for x in labels.split(",") if x]
        if out is None:
            out = {k: v for k, v in d.items() if k not in ("command", "table")}
            out["merged"] = []
        elif d["settings"] != out["settings"] or abs(d["heldout"]["ppl"] / out["heldout"]["ppl"] - 1) > 1e-6:
            raise SystemExit(f"--combine: {src} was measured with other settings or another model")
        missing = set(keep) - {r["kv"] for r in d["modes"]}
        if missing:
            raise SystemExit(f"--combine: {src} has no rows {sorted(missing)}")
        for r in d["modes"]:
            if not keep or r["kv"] in keep:
                rows.pop(r["kv"], None)
                rows[r["kv"]] = dict(r, measured=r.get("measured") or d["date"])
        out["merged"].append(d["date"])
    assert out is not None
    modes = list(rows.values())
    modes.sort(key=lambda r: r["kv"] != "fp16")  # the reference first (render reads its details)
    now = datetime.now(timezone.utc)
    out.update(modes=modes, date=now.strftime("%Y-%m-%d %H:%M UTC"), combined=[Path(s).name for s in specs])
    save("quality", out, render(out), path)
    return out


def render(out: dict) -> str:
    b, s = out["heldout"], out["settings"]
    modes = out["modes"]
    ref = modes[0]["details"]
    lines = [
        (f"Rows measured {min(r['measured'] for r in modes)} to {max(r['measured'] for r in modes)}"
         if out.get("combined") or out.get("merged") else f"Measured {out['date']}")
        + (", the bundled model" if Path(out["model"]).name == "default_model" else f", model `{out['model']}`")
        + f". Held-out plays (never trained on): perplexity **{b['ppl']:.2f}** "
        f"against **{b['unigram_ppl']:.1f}** for an add-one unigram model ({b['tokens']:,} tokens, no KV cache). "
        f"KV rows: {s.get('windows')} windows of {ref['context']} tokens ({ref['tokens']:,} scored) and "
        f"{s.get('full_windows')} of the full {ref['full_context']}; the first half of a window is prefilled and "
        f"compressed, the second half scored in decode steps. ΔPPL and KL against fp16 on the same tokens; needles: "
        f"{ref['needle_trials']} five-digit numbers hidden in held-out text, exact match.", "",
        "| KV cache | PPL | ΔPPL | ΔPPL full context | mean KL | top-1 agree | needle acc (fp16) | KV bytes / fp16 | gates passed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in modes:
        d = r["details"]
        g = {x["name"]: x for x in r["gates"]}
        lines.append(
            f"| {r['kv']} | {d['ppl']:.3f} | {d['ppl'] / d['ppl_fp16'] - 1:+.3%} | {d['ppl_full'] / d['ppl_full_fp16'] - 1:+.3%} "
            f"| {g['mean_kl']['value']:.4f} | {g['top1_agreement']['value']:.3f} "
            f"| {d['needle_accuracy']:.2f} ({d['needle_accuracy_fp16']:.2f}) | {g['kv_bytes_ratio']['value']:.3f} "
            f"| {r['passed']}/{r['total']} |")
    lines.append("")
    lines.append("`+wN`: the newest N tokens kept in fp16; `+pKxV`: pair codebooks of K (keys) and V (values) points; "
                 "`+eN`: the first and last N compressed layers at 4 bits; `+nogain`: without the values' "
                 "reconstruction gain. The bare rows (no suffix) are the paper's rotation ablation: scalar codebooks, no window. "
                 "fp16 fails `kv_bytes_ratio` by construction; on the CPU its cache holds float32 (ratio 2.0).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
