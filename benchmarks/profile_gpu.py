"""`rq profile` on a Qwen3-30B-A3B-shaped model with random weights: where decode time goes at 2K-32K.

The real config (tests/data/configs/qwen3-30b-a3b.json), weights drawn at random in memory and
quantized by role as recipes/qwen3-16gb.toml does (attention 4-bit, routed experts 2-bit, router
8-bit, embeddings and head 6-bit; round-to-nearest: timing does not depend on the method). With
--layers below 48 the per-layer parts are scaled to 48 (`layer_scale`). Context by synthetic fill.

    python3 benchmarks/profile_gpu.py --layers 48 --contexts 2048,8192,32768 --kv isoquant3,fp16

Compressed caches are as `rq run` makes them: the 32-token fp16 window (--window) and isoquant3's defaults (pair
codebooks (128, 32)). The paper measured a 45% KV-attention share of decode time for this model.

Writes benchmarks/results/profile_gpu.json (after every context, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from rq_core.checkpoint import build_model  # noqa: E402
from rq_core.cache.kv_cache import DEFAULT_FP16_WINDOW, KVSettings  # noqa: E402
from rq_core.models.base import SwitchLinear  # noqa: E402
from rq_core.tools.profile import STAGES, backend, profile_model  # noqa: E402

import _readme as results  # noqa: E402

CONFIG = ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b.json"
PAPER_SHARE = 0.45  # the paper's KV-attention share of decode time for Qwen3-30B-A3B


def role_bits(path: str, module: nn.Module):
    """qwen3-16gb's per-role bits (group 64)."""
    if not hasattr(module, "to_quantized"):
        return False
    if isinstance(module, SwitchLinear):
        return {"group_size": 64, "bits": 2}
    if path.endswith("mlp.gate"):
        return {"group_size": 64, "bits": 8}
    if "embed_tokens" in path or path == "lm_head":
        return {"group_size": 64, "bits": 6}
    return {"group_size": 64, "bits": 4}


def build(layers: int) -> tuple[nn.Module, dict]:
    cfg = json.loads(CONFIG.read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg["num_hidden_layers"] = layers
    mx.random.seed(0)
    model = build_model(cfg)
    # One layer at a time: random fp32 → bf16 → quantized, evaluated, so the peak stays ~one layer.
    for layer in model.layers:
        layer.set_dtype(mx.bfloat16)
        nn.quantize(layer, class_predicate=role_bits)
        mx.eval(layer.parameters())
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, class_predicate=role_bits)  # what is left: embeddings and lm_head
    mx.eval(model.parameters())
    return model, cfg


def table(reports: list[dict], layers: int) -> str:
    lines = []
    for rep in reports:
        lines.append(f"\n**KV {rep['kv_mode']}** ({rep['attention_path']} attention path"
                     f"{'' if layers == 48 else f', {layers} layers timed, scaled ×{48 / layers:g}'})\n")
        four = any(r.get("kv_attention_four_kernel_ms") for r in rep["results"])
        lines.append("| context | decode step (ms) | tok/s | KV attention (ms) "
                     + ("| same, four-kernel path (ms) " if four else "")
                     + "| experts (ms) | rest (ms) | KV share | paper | verdict |")
        lines.append("| --- " * (10 if four else 9) + "|")
        for r in rep["results"]:
            a = r["attribution"]
            f4 = f"| {r['kv_attention_four_kernel_ms']:.2f} " if four else ""
            lines.append(f"| {r['context']} | {r['decode_step_ms']:.2f} | {r['decode_tok_per_s']:.1f} "
                         f"| {a['kv_attention']:.2f} {f4}| {a['experts']:.2f} | {a['rest']:.2f} "
                         f"| {r['kv_attention_share']:.1%} | {PAPER_SHARE:.0%} | {r['verdict']} |")
        staged = [r for r in rep["results"] if r["kernels"]]
        if staged:
            lines.append("\nper layer (µs): " + ", ".join(STAGES) + "; Kernel C strategy; "
                         "stages + append vs the `attend` time\n")
            lines.append("| context | rotation | A qk_dot | B softmax | C value_accum | D rotate_inverse "
                         "| append | C strategy (other) | sum / attention |")
            lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            for r in staged:
                k = r["kernels_per_layer_us"]
                # append_ms and C_strategies_ms are per decode step of all 48 layers
                app = "-" if r.get("append_ms") is None else f"{r['append_ms'] * 1e3 / 48:.1f}"
                alt = {s: v for s, v in r.get("C_strategies_ms", {}).items() if s != r["strategy"]}
                alt_s = ", ".join(f"{s} {v * 1e3 / 48:.1f}" for s, v in alt.items())
                lines.append(f"| {r['context']} | " + " | ".join(f"{k[s]:.1f}" for s in STAGES)
                             + f" | {app} | {r['strategy']}" + (f" ({alt_s})" if alt_s else "")
                             + f" | {r['kernels_to_attention']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--kv", default="isoquant3,fp16")
    ap.add_argument("--window", type=int, default=DEFAULT_FP16_WINDOW,
                    help="compressed caches' fp16 window (rq run's default; 0: the bare cache)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    t0 = time.time()
    model, cfg = build(args.layers)
    print(f"built {args.layers} layers in {time.time() - t0:.1f} s; device {mx.default_device()}; "
          f"active {mx.get_active_memory() / 2**30:.2f} GiB", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    meta = {"device": str(mx.default_device()), "backend": backend(), "layers_timed": args.layers, "config": "qwen3-30b-a3b", "paper_share": PAPER_SHARE,
            "repeats": args.repeats, "warmup": args.warmup, "fp16_window": args.window}
    reports: list[dict] = []

    def save(partial: dict | None = None) -> None:
        # Written after every context, so a run cut short still leaves what it measured.
        meta["peak_memory_bytes"] = int(mx.get_peak_memory())
        done = reports + ([partial] if partial else [])
        results.save("profile_gpu", {"meta": meta, "reports": done}, table(done, args.layers))

    for mode in args.kv.split(","):
        t1 = time.time()
        partial = {"kv_mode": mode, "attention_path": None, "results": []}

        def on_context(r: dict) -> None:
            partial["results"].append(r)
            partial["attention_path"] = r["attention_path"]
            save(partial)
            print(json.dumps({k: r[k] for k in ("context", "decode_step_ms", "kv_attention_share", "attribution",
                                                "kernels", "kernels_to_attention", "strategy") if k in r}),
                  f"({time.time() - t0:.0f} s)", flush=True)

        kv = KVSettings(mode=mode, fp16_window=0 if mode == "fp16" else args.window)
        rep = profile_model(model, contexts, kv=kv, vocab_size=cfg["vocab_size"],
                            warmup=args.warmup, repeats=args.repeats, layer_scale=48 / args.layers,
                            on_context=on_context)
        print(f"{mode}: {time.time() - t1:.1f} s", flush=True)
        reports.append(rep)
        save()
    print(table(reports, args.layers))


if __name__ == "__main__":
    main()
