"""The memory planner on the real configs (tests/data/configs) with the shipped recipes, next to the
paper's measured peaks. No weights are read. Writes the `plan` section of benchmarks/README.md.

    python benchmarks/plan_table.py [--no-readme]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rq_core import recipe  # noqa: E402
from rq_core.planner import plan  # noqa: E402

CASES = [  # (config, recipe, paper's measured peak GB)
    ("qwen3-30b-a3b.json", "qwen3-16gb", 6.8),
    ("gemma4-26b-a4b.json", "gemma4-16gb", 5.4),
    ("nemotron3-super-120b-a12b.json", "nemotron-32gb", 17.2),
]


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main() -> None:
    rows = []
    for cfg_name, rec_name, paper in CASES:
        cfg = json.loads((ROOT / "tests" / "data" / "configs" / cfg_name).read_text())
        r = recipe.load(rec_name)
        p = plan(cfg, r)
        at_paper = plan(cfg, r, budget=int(paper * 1e9))
        rows.append((cfg_name.removesuffix(".json"), rec_name, p, paper, at_paper))
    lines = [
        "## Memory plans for the real configs (`python benchmarks/plan_table.py`)",
        "",
        "From each config and shipped recipe, without weights: bytes of the quantized weights, what stays",
        "resident (everything but routed experts), KV cache at the recipe's context, the prompt's fp16 K/V",
        "while a compressing cache prefills it (kv.prefill_fp16's 4,096 tokens and two layers' decoded context), a prefill",
        "working reserve (512-token chunk), and how many expert slots per MoE layer then fit the budget.",
        "The paper's peaks are its measured numbers (its own quantization, not ours).",
        "",
        "| model | recipe | weights GB | resident GB | routed GB | per expert MB | KV GB (ctx) | prefill fp16 KV GB "
        "| reserve GB | budget GB | slots / experts | planned peak GB | paper peak GB "
        "| slots with the paper's peak as budget |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rec, p, paper, ap in rows:
        lines.append(
            f"| {name} | {rec} | {gb(p.total_bytes)} | {gb(p.resident_bytes)} | {gb(p.routed_bytes)} | "
            f"{p.bytes_per_expert / 1e6:.2f} | {gb(p.kv_bytes)} ({p.context}) | {gb(p.prefill_fp16_bytes)} | "
            f"{gb(p.activation_bytes)} | "
            f"{gb(p.budget_bytes)} | {p.slots_per_layer} / {p.experts_per_layer} ({100 * p.expert_fraction:.0f}%) | "
            f"{gb(p.planned_peak_bytes)} | {paper} | {ap.slots_per_layer} / {ap.experts_per_layer} "
            f"({'fits' if ap.fits else 'does not fit'}) |")
    lines += ["", "Long prompts: the prompt's fp16 K/V while a compressing cache prefills it, and the planned peak, with",
              "kv.prefill_fp16 = 4096 (the default since session 17: its 4,096 tokens in fp16 plus two layers' decoded",
              "context, the one waited for and the one queued ahead; benchmarks/README.md \"Long-prompt prefill\")",
              "against \"all\" (the whole prompt in fp16 until it is done). Counted by the planner.", "",
              "| model | recipe | context | prefill fp16 KV GB (bound 4096, default) | planned peak GB "
              "| prefill fp16 KV GB (\"all\") | planned peak GB | slots / experts (default / \"all\") |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cfg_name, rec_name, _ in CASES:
        cfg = json.loads((ROOT / "tests" / "data" / "configs" / cfg_name).read_text())
        for ctx in (32768, 131072):
            r = recipe.load(rec_name)
            r.kv.prefill_fp16 = 4096
            b = plan(cfg, r, context=ctx)
            r.kv.prefill_fp16 = None
            w = plan(cfg, r, context=ctx)
            lines.append(f"| {cfg_name.removesuffix('.json')} | {rec_name} | {ctx} | {gb(b.prefill_fp16_bytes)} | "
                         f"{gb(b.planned_peak_bytes)} | {gb(w.prefill_fp16_bytes)} | {gb(w.planned_peak_bytes)} | "
                         f"{b.slots_per_layer} / {w.slots_per_layer} of {b.experts_per_layer} |")
    lines += ["", "Per-role bytes (GB):", "",
              "| model | " + " | ".join(k for k in rows[0][2].role_bytes) + " |",
              "| --- |" + " --- |" * len(rows[0][2].role_bytes)]
    for name, _, p, _, _ in rows:
        lines.append(f"| {name} | " + " | ".join(gb(v) for v in p.role_bytes.values()) + " |")
    body = "\n".join(lines)
    print(body)
    if "--no-readme" not in sys.argv:
        from _readme import write_section

        write_section("plan", body)


if __name__ == "__main__":
    main()
