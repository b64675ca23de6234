"""Calibrated (GPTQ) against round-to-nearest 4-bit on the bundled Shakespeare MoE: held-out perplexity.

Two comparisons, both with the shakespeare-moe recipe's group sizes:
  * "dense roles only": attention (the 4-bit dense role of a qwen2_moe) quantized to 4 bits, every other
    role kept in full precision — isolates the calibrated method;
  * "full recipe": the whole shakespeare-moe recipe (2-bit routed experts, 8-bit shared expert, ...),
    with the 4-bit roles RTN or GPTQ.
Calibration text: the model's training text (never the held-out plays), or --calib FILE.

    python3 benchmarks/calib_ppl.py [MODEL] [--calib FILE] [--eval-tokens 16384] [--seq 512] [--only dense|full]

Writes benchmarks/results/calib_ppl.json.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402


def perplexity(model, ids: list[int], seq: int) -> float:
    nll, n = 0.0, 0
    for i in range(0, len(ids) - 1, seq):
        x = mx.array(ids[i:i + seq + 1])[None]
        if x.shape[1] < 2:
            break
        logits = model(x[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum")
        nll += float(loss.item())
        n += x.shape[1] - 1
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--calib", default=None)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--only", choices=("dense", "full"), default=None,
                    help="run one comparison (the other's rows are left out of the JSON and table)")
    a = ap.parse_args()

    from rq_core.quant import recipe
    from rq_core.checkpoint import load, resolve_model_path
    from rq_core.tools.eval import load_heldout_text
    from rq_core.quant.quantize import quantize

    src = resolve_model_path(a.model)
    calib = a.calib
    if calib is None:
        train = ROOT / ".train" / "train.txt"
        if not train.is_file():
            sys.exit("no --calib given and no training text at .train/train.txt")
        tmpc = Path(tempfile.mkdtemp(prefix="rq-calib-")) / "calib.txt"
        tmpc.write_text(train.read_text(encoding="utf-8")[:200_000])  # the first plays of the training text
        calib = str(tmpc)
    ck = load(src)
    ids = ck.tokenizer.encode(load_heldout_text())[: a.eval_tokens + 1]
    results = {"float": perplexity(ck.model, ids, a.seq)}
    del ck

    def variant(dense_only: bool, method: str) -> recipe.Recipe:
        r = recipe.load("shakespeare-moe")
        r.calibration.tokens, r.calibration.seq_len = a.calib_tokens, 256
        for role, spec in r.roles.items():
            if dense_only and role not in ("attention", "dense_mlp"):
                spec.bits = None
            if spec.method == "gptq" or (role in ("attention", "dense_mlp") and spec.bits == 4):
                spec.method = method
        return r

    halves = [h for h in (True, False) if a.only is None or h == (a.only == "dense")]
    tmp = Path(tempfile.mkdtemp(prefix="rq-ppl-"))
    try:
        for dense_only in halves:
            for method in ("rtn", "gptq"):
                key = f"{'dense roles only' if dense_only else 'full recipe'} / {method}"
                out = tmp / key.replace(" ", "_").replace("/", "")
                res = quantize(src, variant(dense_only, method), out, calib=calib)
                m = load(out, tokenizer=False).model
                results[key] = perplexity(m, ids, a.seq)
                results[key + " bytes"] = res.bytes_out
                print(key, results[key], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta = {"model": str(src), "eval_tokens": len(ids) - 1, "seq": a.seq,
            "calib": a.calib or ".train/train.txt[:200000]", "calib_tokens": a.calib_tokens}
    f = results["float"]
    lines = [f"Model {Path(meta['model']).name}, held-out plays ({meta['eval_tokens']:,} tokens, windows of {a.seq}); "
             f"GPTQ calibrated on {a.calib_tokens:,} tokens of training text.", "",
             "| variant | 4-bit method | perplexity | vs float | weights MB |", "| --- | --- | --- | --- | --- |",
             f"| float (bf16) | - | {f:.3f} | - | - |"]
    for dense_only in halves:
        for method in ("rtn", "gptq"):
            key = f"{'dense roles only' if dense_only else 'full recipe'} / {method}"
            lines.append(f"| {key.split(' / ')[0]} | {method.upper()} | {results[key]:.3f} | "
                         f"{results[key] - f:+.3f} | {results[key + ' bytes'] / 1e6:.1f} |")
    body = "\n".join(lines)
    print(body)
    from _readme import save

    save("calib_ppl", {"meta": meta, "results": results}, body)


if __name__ == "__main__":
    main()
