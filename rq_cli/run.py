"""`rq run`: generate text with a (quantized) checkpoint, streaming, with speed/memory/KV stats."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from rq_cli.common import (COUNT, FRACTION, POSITIVE, SEED, Kv, KvConfig, MaxTokens, MemoryBudget, MinP, ModelArg,
                           ModelOpt, Pager, PrefillChunk, Range, Seed, Temp, TopK, TopP, check_kv_flags, console,
                           gpu_first_run_note, handle_errors, kv_settings, memory_budget_of, model_arg, pager_policy,
                           print_json, recipe_of)
from rq_core.errors import RQError


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _settings(path, kv: Optional[str], kv_config: Optional[list[str]], memory_budget: Optional[str],
              pager: Optional[str], pages: Optional[str] = None) -> tuple:
    """(KVSettings, memory budget, pager policy, where they came from): the checkpoint's recipe.toml (else the
    defaults: fp16, a 32-token window for compressed modes, everything resident, lru), then the flags."""
    rec = recipe_of(path)
    settings = kv_settings(rec, kv, kv_config)
    return (settings, memory_budget_of(rec, path, memory_budget, pages), pager_policy(rec, pager),
            "recipe.toml" if rec is not None else "defaults")


@handle_errors(max_tokens=COUNT, temp=Range(min=0), top_p=Range(0, 1, min_open=True), top_k=COUNT, min_p=FRACTION,
               seed=SEED, prefill_chunk=POSITIVE)
def run(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    prompt: str = typer.Option(..., "--prompt", "-p", metavar="TEXT", show_default=False, help="Prompt text."),
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT", show_default=False,
                                         help="A system message before the prompt, with the chat template "
                                              "(implies --chat)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    max_tokens: MaxTokens = 256,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    seed: Seed = 0,
    kv: Kv = None,
    kv_config: KvConfig = None,
    memory_budget: MemoryBudget = None,
    pager: Pager = None,
    pages: Optional[str] = typer.Option(None, "--pages", metavar="DIR", show_default=False,
                                        help="The expert pages' folder with --memory-budget (`rq pack --out DIR`; "
                                             "default: CKPT/experts)."),
    plan_only: bool = typer.Option(False, "--plan", help="Print the memory plan for --memory-budget and exit."),
    prefill_chunk: PrefillChunk = 512,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate text; streams it to stdout, then a stats line (stderr).

    KV and pager settings not given as flags come from the checkpoint's `recipe.toml` (written by
    `rq quantize`), so a model quantized for 16 GB runs the way its recipe planned; --kv-config sets any
    other [kv] key of the recipe for this run."""
    model = model_arg(model, model_opt)
    check_kv_flags(kv, kv_config)  # a bad value fails before the model loads

    from rq_core.checkpoint import context_length, load
    from rq_core.generate import generate
    from rq_core.tokenizer import StreamDecoder

    # float32 on the CPU (small models); the pager casts pages to the model's dtype as it loads them.
    ckpt = load(model, cpu_float32=True)
    settings, memory_budget, pager, source = _settings(ckpt.path, kv, kv_config, memory_budget, pager, pages)
    kv = settings.mode
    tok = ckpt.tokenizer
    if tok is None:
        raise RQError(f"{ckpt.path} has no tokenizer.json; `rq run --prompt` needs one")
    if chat or system is not None:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    ctx = context_length(ckpt.config)
    if ctx is not None and len(ids) > ctx:
        raise RQError(f"the prompt is {len(ids)} tokens, longer than the model's context of {ctx}")

    if pages is not None and memory_budget is None and not plan_only:
        raise RQError("--pages needs --memory-budget (or a recipe's [pager] memory_budget)")
    pager_obj = None
    if memory_budget is not None or plan_only:  # expert pager (rq_core.paging.pager); --plan: print and exit
        from rq_cli.run_pager import attach_pager

        pager_obj = attach_pager(ckpt, memory_budget, pager, plan_only, json_out,
                                 context=len(ids) + max_tokens, prefill_chunk=prefill_chunk, kv_mode=kv,
                                 prefill_fp16=settings.prefill_fp16, edge_layers=settings.edge_layers,
                                 pages=pages)
        if pager_obj is None:
            return

    gpu_first_run_note()
    stream = StreamDecoder(tok)

    def on_token(t: int) -> None:
        piece = stream.add(t)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    caches = ckpt.model.make_cache(settings)
    res = generate(ckpt.model, ids, max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                   seed=seed, kv=settings, eos_token_ids=ckpt.eos_token_ids, prefill_chunk=prefill_chunk,
                   context_length=ctx, on_token=None if json_out else on_token, cache=caches)
    from rq_core.attention.dispatch import attention_paths, format_paths  # (mlx: imported only to run)

    # the codebooks the compressed caches took (the settings' default depends on the head dim; edge layers are scalar)
    pairs = next((c.pair_points for c in caches if getattr(c, "pair_points", None)), None)
    text_out = tok.decode(res.tokens)
    if json_out:
        d = res.as_dict()
        if pager_obj is not None:
            d["pager"] = pager_obj.report().as_dict()
        print_json({"text": text_out, **d, "kv_mode": kv, "kv_window": settings.fp16_window,
                    "kv_prefill_fp16": settings.prefill_fp16 if kv != "fp16" else None,
                    "kv_value_gain": settings.value_gain if kv != "fp16" else None,
                    "rotation": settings.rotation if kv == "isoquant3" else None,
                    "kv_key_bits": settings.key_bits if kv != "fp16" else None,
                    "kv_pair_points": list(pairs) if pairs else None,
                    "kv_edge_layers": settings.edge_layers if kv != "fp16" else None,
                    "kv_edge_bits": settings.edge_bits if kv != "fp16" and settings.edge_layers else None,
                    "attention_paths": attention_paths(caches),
                    "settings_from": source, "model_type": ckpt.model_type, "model": str(ckpt.path)})
        return
    tail = stream.flush()
    sys.stdout.write(tail + "\n")
    sys.stdout.flush()
    ratio = f" ({res.kv_bytes_fp16 / res.kv_bytes:.2f}x smaller)" if res.kv_bytes_fp16 > res.kv_bytes > 0 else ""
    notes = ([f"pair codebooks {pairs[0]}/{pairs[1]}"] if pairs else []) + (
        [f"{settings.edge_layers} edge layer(s) at {settings.edge_bits} bits"] if kv != "fp16" and settings.edge_layers
        else [])
    kv_stat = f"KV {kv}{f' ({chr(44).join(notes)})' if notes else ''} {_fmt_bytes(res.kv_bytes)}"
    if kv != "fp16":
        kv_stat += f" vs fp16 {_fmt_bytes(res.kv_bytes_fp16)}{ratio}, attention {format_paths(attention_paths(caches))}"
    elif res.kv_bytes > res.kv_bytes_fp16:  # rq_core.checkpoint computes small models in float32 on the CPU
        kv_stat += " (float32 on the CPU)"
    slow_first = ""  # a first step 10x a steady one: a GPU's one-time kernel compile, shown apart
    if res.steady_decode_tok_per_s > 0 and res.first_step_s * res.steady_decode_tok_per_s > 10:
        slow_first = (f" (first step {res.first_step_s:.2f} s, kernel compile; then "
                      f"{res.steady_decode_tok_per_s:.1f} tok/s)")
    console.print(
        f"prompt {res.prompt_tokens} tok @ {res.prefill_tok_per_s:.1f} tok/s | "
        f"decode {res.generated_tokens} tok @ {res.decode_tok_per_s:.1f} tok/s{slow_first} | "
        f"peak mem {_fmt_bytes(res.peak_memory_bytes)} (rss {_fmt_bytes(res.peak_rss_bytes)}) | {kv_stat}",
        highlight=False, soft_wrap=True)
    if pager_obj is not None:
        st = pager_obj.report()
        hr = f"{100 * st.hit_rate:.1f}%" if st.hit_rate is not None else "n/a (OS cache)"
        console.print(f"pager {st.policy}: {st.slots} slots/layer, hit rate {hr}, {st.misses} reads "
                      f"({_fmt_bytes(st.bytes_read)}), {st.evictions} evictions", highlight=False, soft_wrap=True)
