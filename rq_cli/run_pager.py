"""The expert-pager part of `rq run` (`--memory-budget`, `--pager`, `--plan`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import typer

from rq_cli.common import console, print_error, print_json, recipe_of
from rq_core.errors import RQError


def table_plan(ckpt: Any, p: dict, context: int, prefill_chunk: int, **kv: Any) -> Any:
    """The planner's Plan (what `rq quantize --plan` renders) for the loaded checkpoint: parameters by role from the
    config, bytes by role and the budget's numbers (`p`, pager.slots_for_budget) measured on the loaded model."""
    from mlx.utils import tree_flatten

    from rq_core.paging.pager import activation_dtype
    from rq_core.paging.planner import fmt_bytes, kv_bytes, plan
    from rq_core.quant.recipe import Recipe
    from rq_core.quant.roles import role_of

    rec = recipe_of(ckpt.path) or Recipe(name="(none: as stored)", family=None, roles={})
    rec = dataclasses.replace(rec, kv=dataclasses.replace(rec.kv, **kv))
    base = plan(ckpt.config, rec, budget=p["budget_bytes"], context=context, prefill_chunk=prefill_chunk)
    per_tok = kv_bytes(ckpt.config, rec.kv.mode, rec.kv.bits, rec.kv.edge_layers, rec.kv.edge_bits,
                       act_bytes=activation_dtype(ckpt.model).size)[0]  # in the dtype the loaded model computes in
    role_bytes = dict.fromkeys(base.role_bytes, 0)
    for name, v in tree_flatten(ckpt.model.parameters()):  # quantized: codes, scales and biases of one weight
        stem, _, leaf = name.rpartition(".")
        role = role_of(f"{stem}.weight" if leaf in ("scales", "biases") else name, ckpt.config)
        role_bytes[role] = role_bytes.get(role, 0) + v.nbytes
    E = p["experts_per_layer"]
    return dataclasses.replace(
        base, role_bytes=role_bytes, total_bytes=sum(role_bytes.values()), resident_bytes=p["resident_bytes"],
        bytes_per_expert=p["bytes_per_expert"], kv_bytes_per_token=per_tok, kv_bytes=p["kv_bytes"],
        prefill_fp16_bytes=p["prefill_fp16_bytes"], activation_bytes=p["activation_bytes"],
        budget_bytes=p["budget_bytes"], slots_per_layer=p["slots_per_layer"],
        expert_fraction=p["slots_per_layer"] / E if E else 1.0, fits=p["fits"],
        planned_peak_bytes=p["planned_peak_bytes"],
        notes=([f"planned peak includes {fmt_bytes(p['staging_bytes'])} of staging for page reads"]
               if p["staging_bytes"] else []) +
              ([f"{fmt_bytes(p['reserve_bytes'])} of the budget (1%) left free for what the parts do not count"]
               if p.get("reserve_bytes") else []) +
              ([] if p["fits"] else [f"the smallest budget that runs: {fmt_bytes(p['min_budget_bytes'])}"]))


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
    if budget is None:  # all resident, no pager: a prompt chunk's experts may run dequantized, a bank at a time
        from rq_core.models.base import dense_prompt_bank_bytes

        dense = dense_prompt_bank_bytes(ckpt.model, min(prefill_chunk, max(context, 1)) * p["top_k"])
        p["activation_bytes"] += dense
        p["planned_peak_bytes"] += dense
    if plan_only:
        if json_out:
            print_json({"plan": p})
        else:
            from rq_core.paging.planner import render

            console.print(render(table_plan(ckpt, p, context, prefill_chunk, mode=kv_mode, prefill_fp16=prefill_fp16,
                                              edge_layers=edge_layers)))
        if not p["fits"]:
            print_error(f"--memory-budget {memory_budget} is too small for this plan; the smallest budget that runs "
                        f"is {p['min_budget_bytes']:,} bytes ({fmt_bytes(p['min_budget_bytes'])})")
            raise typer.Exit(1)
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
    return ExpertPager(ckpt.model, ckpt.path, slots=p["slots_per_layer"], policy=policy, pages=pages,
                       memory_limit=p["memory_limit_bytes"])
