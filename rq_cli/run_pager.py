"""The expert-pager part of `rq run` (`--memory-budget`, `--pager`, `--plan`)."""

from __future__ import annotations

from typing import Any, Optional

from rq_cli.common import console, print_json
from rq_core.errors import RQError


def attach_pager(ckpt: Any, memory_budget: Optional[str], policy: str, plan_only: bool, json_out: bool, *,
                 context: int, prefill_chunk: int, kv_mode: str = "fp16", prefill_fp16: Optional[int] = None,
                 edge_layers: int = 0, pages: Optional[str] = None) -> Any:
    """Plan slots for the budget and attach an ExpertPager to ckpt.model; with --plan print the plan
    and return None. No weights are read here (the model is lazy). `pages`: the pack folder (`--pages`,
default CKPT/experts)."""
    from rq_core.paging.pack import INDEX, expert_banks, find_pages, load_index
    from rq_core.paging.pager import ExpertPager, check_policy, slots_for_budget
    from rq_core.paging.planner import fmt_bytes
    from rq_core.quant.recipe import parse_size

    check_policy(policy, "--pager")
    if memory_budget is None:
        budget = None
    else:
        budget = parse_size(memory_budget, "--memory-budget")
    packed = (find_pages(ckpt.path, pages) / INDEX).is_file()
    if pages is not None and not packed:
        raise RQError(f"--pages {pages}: no expert pages there (run `rq pack {ckpt.path} --out {pages}` first)")
    index = load_index(ckpt.path, pages=pages, banks=expert_banks(ckpt.model)) if packed else None
    p = slots_for_budget(ckpt.model, ckpt.config, budget if budget is not None else 1 << 62, context=context,
                         prefill_chunk=prefill_chunk, kv_mode=kv_mode, index=index, prefill_fp16=prefill_fp16,
                         edge_layers=edge_layers)
    p["budget_bytes"] = budget
    p["policy"] = policy
    if plan_only:
        if json_out:
            print_json({"plan": p})
        else:
            for k, v in p.items():
                shown = fmt_bytes(v) if k.endswith("bytes") and isinstance(v, int) else v
                console.print(f"{k:<20} {shown}", highlight=False)
        return None
    if not p["experts_per_layer"]:
        raise RQError("--memory-budget: this model has no routed experts to page")
    if not p["fits"]:
        raise RQError(f"--memory-budget {memory_budget} is too small: resident weights {fmt_bytes(p['resident_bytes'])}"
                      f" + KV {fmt_bytes(p['kv_bytes'])} + prompt K/V in fp16 while prefilling "
                      f"{fmt_bytes(p['prefill_fp16_bytes'])} + working memory {fmt_bytes(p['activation_bytes'])} leave "
                      f"room for {p['slots_per_layer']} expert(s) a layer, top-k needs {p['top_k']}; the smallest budget "
                      f"that runs is {p['min_budget_bytes']:,} bytes ({fmt_bytes(p['min_budget_bytes'])})")
    if index is None:
        raise RQError(f"{ckpt.path} has no expert pages: run `rq pack {ckpt.path}` first")
    return ExpertPager(ckpt.model, ckpt.path, slots=p["slots_per_layer"], policy=policy, pages=pages)
