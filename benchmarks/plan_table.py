"""The memory planner on the real configs (tests/data/configs) with the shipped recipes, next to the paper's measured
peaks. No weights are read, so it runs anywhere in a second.

    python3 benchmarks/plan_table.py

Writes benchmarks/results/plan_table.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rq_core.quant import recipe  # noqa: E402
from rq_core.paging.planner import plan  # noqa: E402

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
        "| model | recipe | weights GB | resident GB | KV GB (context) | prompt's fp16 K/V GB | budget GB "
        "| expert slots / layer | planned peak GB | paper's peak GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    data = []
    for name, rec, p, paper, ap in rows:
        lines.append(
            f"| {name} | {rec} | {gb(p.total_bytes)} | {gb(p.resident_bytes)} | {gb(p.kv_bytes)} ({p.context:,}) | "
            f"{gb(p.prefill_fp16_bytes)} | {gb(p.budget_bytes)} | {p.slots_per_layer} / {p.experts_per_layer} | "
            f"{gb(p.planned_peak_bytes)} | {paper} |")
        data.append({"config": name, "recipe": rec, "paper_peak_gb": paper, "total_bytes": p.total_bytes,
                     "resident_bytes": p.resident_bytes, "routed_bytes": p.routed_bytes,
                     "bytes_per_expert": p.bytes_per_expert, "kv_bytes": p.kv_bytes, "context": p.context,
                     "prefill_fp16_bytes": p.prefill_fp16_bytes, "activation_bytes": p.activation_bytes,
                     "budget_bytes": p.budget_bytes, "slots_per_layer": p.slots_per_layer,
                     "experts_per_layer": p.experts_per_layer, "planned_peak_bytes": p.planned_peak_bytes,
                     "role_bytes": dict(p.role_bytes),
                     "slots_at_paper_peak": ap.slots_per_layer, "fits_at_paper_peak": ap.fits})
    lines += ["", "No weights read: the planner's count from each config and shipped recipe. Resident: everything but the "
              "routed experts. Prompt's fp16 K/V: held while a compressing cache prefills (kv.prefill_fp16). "
              "Paper's peak: the paper's measured peak for the model, with its own quantization."]
    body = "\n".join(lines)
    print(body)
    from _readme import save

    save("plan_table", {"rows": data}, body)


if __name__ == "__main__":
    main()
