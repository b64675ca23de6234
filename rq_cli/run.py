"""`rq run`: generate text with a (quantized) checkpoint, streaming, with speed/memory/KV stats."""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import typer

from rq_cli.common import (COUNT, POSITIVE, SEED, Range, console, gpu_first_run_note, handle_errors, pair_points_arg,
                           print_json)
from rq_core.errors import RQError

KV_CHOICES = ("fp16", "isoquant3", "turbo3")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _settings(path, kv: Optional[str], kv_window: Optional[int], memory_budget: Optional[str],
              pager: Optional[str], rotation: Optional[str] = None, prefill_fp16: Optional[str] = None,
              edge_layers: Optional[int] = None, pages: Optional[str] = None) -> tuple:
    """(KVSettings, memory budget, pager policy, where they came from): flags first, then the
    checkpoint's recipe.toml, then the defaults (fp16, a 32-token window for compressed modes, everything resident, lru)."""
    from rq_core.kv_cache import DEFAULT_EDGE_LAYERS, DEFAULT_FP16_WINDOW, KVSettings, prefill_fp16_value

    rec = None
    if (path / "recipe.toml").is_file():
        from rq_core import recipe as recipe_mod

        rec = recipe_mod.load(path / "recipe.toml")
    base = rec.kv if rec is not None else KVSettings(fp16_window=DEFAULT_FP16_WINDOW, edge_layers=DEFAULT_EDGE_LAYERS)
    over = {k: v for k, v in (("mode", kv), ("fp16_window", kv_window), ("rotation", rotation),
                              ("edge_layers", edge_layers)) if v is not None}
    if prefill_fp16 is not None:  # "all" overrides with None
        over["prefill_fp16"] = prefill_fp16_value(prefill_fp16, "--prefill-fp16")
    settings = dataclasses.replace(base, **over)
    from rq_core.pack import INDEX, find_pages

    if rec is not None and memory_budget is None and rec.pager.memory_budget and \
            (find_pages(path, pages) / INDEX).is_file():
        memory_budget = rec.pager.memory_budget  # packed for paging: keep the recipe's budget
    if pager is None:
        pager = rec.pager.policy if rec is not None else "lru"
    return settings, memory_budget, pager, "recipe.toml" if rec is not None else "defaults"


@handle_errors(max_tokens=COUNT, temp=Range(min=0), top_p=Range(0, 1, min_open=True), seed=SEED, kv_window=COUNT,
               edge_layers=COUNT, prefill_chunk=POSITIVE)
def run(
    model: Optional[str] = typer.Argument(None, help="Checkpoint directory or Hugging Face hub id "
                                                     "(default: the bundled model)."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    seed: int = typer.Option(0, "--seed", help="Random seed for sampling."),
    kv: Optional[str] = typer.Option(None, "--kv", help="KV cache of full-attention layers: fp16, isoquant3 or "
                                                        "turbo3 (default: the checkpoint's recipe.toml, else fp16)."),
    kv_window: Optional[int] = typer.Option(None, "--kv-window", "--fp16-window",
                                            help="Newest tokens kept in fp16 beside a compressed KV cache (default: "
                                                 "the recipe's fp16_window, else 32, which measured better quality for "
                                                 "+6% KV bytes at 2K)."),
    rotation: Optional[str] = typer.Option(None, "--rotation",
                                           help="Rotation of an isoquant3 cache: wht_so4 (default), rwht_so4 (random "
                                                "signs first), wht, so4, so3 (default: the recipe's)."),
    pair_points: Optional[str] = typer.Option(None, "--pair-points",
                                              help="Codebooks of a compressed KV cache: keys' and values' points a pair "
                                                   "of rotated coordinates, e.g. 128,32, or 'off' for scalar codebooks "
                                                   "(default: the recipe's kv.pair_points, else 128,32 for isoquant3)."),
    prefill_fp16: Optional[str] = typer.Option(None, "--prefill-fp16",
                                               help="A compressed KV cache keeps at most N prompt tokens in fp16 while "
                                                    "it prefills, compressing older ones as the chunks arrive, or "
                                                    "'all' to keep the whole prompt in fp16 until it is done (default: "
                                                    "the recipe's kv.prefill_fp16, else 4096)."),
    edge_layers: Optional[int] = typer.Option(None, "--edge-layers",
                                              help="The first and last N compressed layers keep keys and values at 4 "
                                                   "bits (default: the recipe's kv.edge_layers, else 1; 0 = none)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", help="Prompt tokens per prefill step."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget",
                                                help="Keep the run inside SIZE (e.g. 16GB): experts beyond what fits "
                                                     "are paged from CKPT/experts (see `rq pack`). Default: the "
                                                     "recipe's [pager] memory_budget when the checkpoint is packed."),
    pager: Optional[str] = typer.Option(None, "--pager", help="Expert paging policy with --memory-budget: lru "
                                                              "(the only one; default: the recipe's, else lru)."),
    plan_only: bool = typer.Option(False, "--plan", help="Print the memory plan for --memory-budget and exit."),
    pages: Optional[str] = typer.Option(None, "--pages", help="The expert pages' folder with --memory-budget "
                                                              "(`rq pack --out DIR`; default: CKPT/experts)."),
) -> None:
    """Generate text; streams it to stdout, then a stats line (stderr).

    KV and pager settings not given as flags come from the checkpoint's `recipe.toml` (written by
    `rq quantize`), so a model quantized for 16 GB runs the way its recipe planned."""
    if kv is not None and kv not in KV_CHOICES:
        raise RQError(f"unknown --kv {kv!r} (choose from: {', '.join(KV_CHOICES)})")
    if prefill_fp16 is not None:
        from rq_core.kv_cache import prefill_fp16_value

        prefill_fp16_value(prefill_fp16, "--prefill-fp16")  # a bad value fails before the model loads
    if rotation is not None and rotation not in ("wht_so4", "rwht_so4", "wht", "so4", "so3"):
        raise RQError(f"unknown --rotation {rotation!r} (choose from: wht_so4, rwht_so4, wht, so4, so3)")
    pp = pair_points_arg("isoquant3", pair_points, None)

    from rq_core.checkpoint import context_length, load
    from rq_core.generate import generate
    from rq_core.kv_cache import KVSettings
    from rq_core.tokenizer import StreamDecoder

    # float32 on the CPU (small models); the pager casts pages to the model's dtype as it loads them.
    ckpt = load(model, cpu_float32=True)
    settings, memory_budget, pager, source = _settings(ckpt.path, kv, kv_window, memory_budget, pager, rotation,
                                                       prefill_fp16, edge_layers, pages)
    if pp is not None:
        if pp and settings.key_bits is not None:
            raise RQError("--pair-points cannot be combined with the recipe's kv.key_bits")
        settings = dataclasses.replace(settings, pair_points=pp)
    kv = settings.mode
    tok = ckpt.tokenizer
    if tok is None:
        raise RQError(f"{ckpt.path} has no tokenizer.json; `rq run --prompt` needs one")
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    ctx = context_length(ckpt.config)
    if ctx is not None and len(ids) > ctx:
        raise RQError(f"the prompt is {len(ids)} tokens, longer than the model's context of {ctx}")

    if pages is not None and memory_budget is None and not plan_only:
        raise RQError("--pages needs --memory-budget (or a recipe's [pager] memory_budget)")
    pager_obj = None
    if memory_budget is not None or plan_only:  # expert pager (rq_core.pager); --plan: print and exit
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
    res = generate(ckpt.model, ids, max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed,
                   kv=settings, eos_token_ids=ckpt.eos_token_ids, prefill_chunk=prefill_chunk,
                   context_length=ctx, on_token=None if json_out else on_token, cache=caches)
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
        kv_stat += f" vs fp16 {_fmt_bytes(res.kv_bytes_fp16)}{ratio}"
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
