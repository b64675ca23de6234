"""`rq run`: generate text with a (quantized) checkpoint, streaming, with speed/memory/KV stats."""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Annotated, Any, Optional

import typer

from rq_cli.common import (COUNT, FRACTION, POSITIVE, SEED, KvAuto, KvConfig, MaxKvSize, MaxTokens, MemoryBudget, MinP,
                           ModelArg, ModelOpt, Pager, PrefillChunk, Range, Seed, Temp, TopK, TopP, check_kv_flags,
                           console, gpu_first_run_note, handle_errors, kv_settings, memory_budget_of, model_arg,
                           pager_policy, print_json, recipe_of)
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
    settings = kv_settings(rec, kv, kv_config, auto=True)  # mode "auto": settle_kv picks it
    return (settings, memory_budget_of(rec, path, memory_budget, pages), pager_policy(rec, pager),
            "recipe.toml" if rec is not None else "defaults")


Pages = Annotated[Optional[str], typer.Option(
    "--pages", metavar="DIR", show_default=False,
    help="The expert pages' folder with --memory-budget (`rq pack --out DIR`; default: CKPT/experts).")]
PLAN_CONTEXT = 4096  # what `rq serve` and `rq chat` plan memory for without a recipe (a prompt's length is unknown)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A checkpoint loaded for generation (`rq run`, `rq serve`, `rq chat`) and the settings it runs with."""

    ckpt: Any
    settings: Any  # KVSettings
    memory_budget: Optional[str]
    pager: str  # the pager policy
    pages: Optional[str]
    source: str  # where the settings came from: "recipe.toml" or "defaults"
    context: Optional[int]  # the model's context length
    kv_auto_reason: Optional[str] = None  # why --kv auto picked settings.mode (None: a mode was named)


def load_model(model: Optional[str], kv: Optional[str], kv_config: Optional[list[str]], memory_budget: Optional[str],
               pager: Optional[str], pages: Optional[str], plan_only: bool = False,
               max_kv_size: Optional[int] = None) -> Loaded:
    """The checkpoint (float32 on the CPU for small models; the pager casts pages to the model's dtype as it loads
    them) with its tokenizer and settings; a bad flag fails before the model loads."""
    check_kv_flags(kv, kv_config, auto=True)
    if max_kv_size is not None:
        _bounded_kv(kv, max_kv_size)  # a compressed --kv fails here, before the model loads
    from rq_core.checkpoint import context_length, load

    ckpt = load(model, cpu_float32=True)
    settings, memory_budget, pager, source = _settings(ckpt.path, kv, kv_config, memory_budget, pager, pages)
    if ckpt.tokenizer is None:
        raise RQError(f"{ckpt.path} has no tokenizer.json; generating text needs one")
    if pages is not None and memory_budget is None and not plan_only:
        raise RQError("--pages needs --memory-budget (or a recipe's [pager] memory_budget)")
    loaded = Loaded(ckpt, settings, memory_budget, pager, pages, source, context_length(ckpt.config))
    if max_kv_size is None:
        return loaded
    return dataclasses.replace(loaded, settings=_bounded_kv(settings.mode, max_kv_size, settings, source),
                               kv_auto_reason=f"--max-kv-size {max_kv_size} bounds fp16 K/V" if
                               settings.mode == "auto" else None)


def _bounded_kv(mode: Optional[str], n: int, settings: Any = None, source: str = "--kv") -> Any:
    """`settings` with full-attention layers keeping only their newest `n` tokens (fp16; auto becomes fp16); one
    line for a compressed mode, which has no bounded form."""
    if mode not in (None, "auto", "fp16"):
        where = f"--kv {mode}" if source == "--kv" else f"kv.mode {mode!r} ({source})"
        raise RQError(f"--max-kv-size bounds an fp16 KV cache; {where} is compressed and has no bounded form "
                      "(use --kv fp16, or drop --max-kv-size)")
    return None if settings is None else dataclasses.replace(settings, mode="fp16", max_kv_size=n)


def settle_kv(m: Loaded, context: int, prefill_chunk: int) -> Loaded:
    """`m` with --kv auto's mode picked for `context` tokens and the memory budget (rq_core.cache.auto.decide);
    as it is when a mode was named."""
    from rq_core.cache.auto import AUTO, decide
    from rq_core.quant.recipe import parse_size

    if m.settings.mode != AUTO:
        return m
    budget = parse_size(m.memory_budget, "--memory-budget") if m.memory_budget is not None else None
    c = decide(m.ckpt.model, m.ckpt.config, m.settings, context=context, budget=budget, prefill_chunk=prefill_chunk)
    return dataclasses.replace(m, settings=dataclasses.replace(m.settings, mode=c.mode), kv_auto_reason=c.reason)


def kv_auto_note(m: Loaded) -> str:
    """'KV auto: MODE, why' when --kv auto picked the mode, else ''."""
    return f"KV auto: {m.settings.mode}, {m.kv_auto_reason}" if m.kv_auto_reason else ""


def attach(m: Loaded, *, context: int, prefill_chunk: int, plan_only: bool = False, json_out: bool = False) -> Any:
    """The expert pager for the memory budget (rq_core.paging.pager), attached to the model; None when everything
    is resident. With `plan_only`, print the plan instead (rq_cli.run_pager)."""
    if m.memory_budget is None and not plan_only:
        return None
    from rq_cli.run_pager import attach_pager

    s = m.settings
    return attach_pager(m.ckpt, m.memory_budget, m.pager, plan_only, json_out, context=context,
                        prefill_chunk=prefill_chunk, kv_mode=s.mode, prefill_fp16=s.prefill_fp16,
                        edge_layers=s.edge_layers, pages=m.pages)


def plan_context(m: Loaded) -> int:
    """The context a server or a chat plans its memory for: the recipe's pager.context, else the model's context
    (at most PLAN_CONTEXT)."""
    rec = recipe_of(m.ckpt.path)
    if rec is not None:
        return rec.pager.context
    return min(m.context or PLAN_CONTEXT, PLAN_CONTEXT)


@handle_errors(max_tokens=COUNT, temp=Range(min=0), top_p=Range(0, 1, min_open=True), top_k=COUNT, min_p=FRACTION,
               seed=SEED, prefill_chunk=POSITIVE, ranks=POSITIVE, max_kv_size=POSITIVE)
def run(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", metavar="TEXT", show_default=False,
                                         help="Prompt text."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", metavar="PATH", show_default=False,
                                              help="Read the prompt text from this file (a long prompt)."),
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT", show_default=False,
                                         help="A system message before the prompt, in the chat template "
                                              "(implies --chat)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template (the default when "
                              "the tokenizer has one; a checkpoint without one gets a plain transcript)."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as plain text, without the chat template."),
    max_tokens: MaxTokens = 256,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    seed: Seed = 0,
    kv: KvAuto = None,
    kv_config: KvConfig = None,
    max_kv_size: MaxKvSize = None,
    memory_budget: MemoryBudget = None,
    pager: Pager = None,
    pages: Pages = None,
    plan_only: bool = typer.Option(False, "--plan", help="Print the memory plan for --memory-budget and exit."),
    ranks: int = typer.Option(1, "--ranks", metavar="N", help="With --plan: the layers each of N ranks holds "
                              "(`mlx.launch ... rq run`: pipeline-parallel over the machines)."),
    prefill_chunk: PrefillChunk = 512,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate text; streams it to stdout, then a stats line (stderr).

    KV and pager settings not given as flags come from the checkpoint's `recipe.toml` (written by
    `rq quantize`), so a model quantized for 16 GB runs the way its recipe planned; --kv-config sets any
    other [kv] key of the recipe for this run."""
    model = model_arg(model, model_opt)
    if (prompt is None) == (prompt_file is None):
        raise RQError("give the prompt with --prompt TEXT or --prompt-file PATH (one of them)")
    if raw and (chat or system is not None):
        raise RQError(f"--raw sends the prompt without the chat template; it does not go with "
                      f"{'--chat' if chat else '--system'}")
    if prompt_file is not None:
        try:
            prompt = open(prompt_file, encoding="utf-8").read()
        except OSError as e:
            raise RQError(f"--prompt-file {prompt_file}: {e.strerror or e}")
    from rq_core import distributed as dist

    rank = dist.start() if dist.launched() and not plan_only else None  # None: one process
    m = dist.agree(rank, functools.partial(load_model, model, kv, kv_config, memory_budget, pager, pages,
                                           plan_only=plan_only, max_kv_size=max_kv_size),
                   lambda m: dist.fingerprint(m.ckpt))
    if rank is not None:  # this rank's layers only, from here on
        m = dataclasses.replace(m, ckpt=dist.shard_checkpoint(m.ckpt, rank))
    if plan_only and ranks > 1:
        rows = dist.plan_split(m.ckpt.model, ranks)
        if json_out:
            print_json({"ranks": rows})
        else:
            console.print(dist.render_split(rows), highlight=False)
        return
    ckpt, tok, ctx = m.ckpt, m.ckpt.tokenizer, m.context
    # the chat template by default where the tokenizer has one (as mlx-lm); --chat without one: a plain transcript
    wrapped = not raw and (chat or system is not None or bool(tok.chat_template))
    if wrapped:
        ids = tok.encode_chat(([{"role": "system", "content": system}] if system is not None else []) +
                              [{"role": "user", "content": prompt}])
    else:
        ids = tok.encode(prompt)
    if ctx is not None and len(ids) > ctx:
        raise RQError(f"the prompt is {len(ids)} tokens, longer than the model's context of {ctx}")
    m = settle_kv(m, len(ids) + max_tokens, prefill_chunk)
    settings, kv = m.settings, m.settings.mode
    attach_it = functools.partial(attach, m, context=len(ids) + max_tokens, prefill_chunk=prefill_chunk,
                                  plan_only=plan_only, json_out=json_out)
    pager_obj = dist.agree(rank, attach_it,  # the ranks must run the same prompt and sampling
                           lambda _: repr((ids, max_tokens, temp, top_p, top_k, min_p, seed, prefill_chunk)).encode())
    if plan_only:
        if m.kv_auto_reason and not json_out:
            console.print(kv_auto_note(m), highlight=False, soft_wrap=True)
        return

    from rq_core.generate import generate
    from rq_core.tokenizer import StreamDecoder

    gpu_first_run_note()
    stream = StreamDecoder(tok)

    def on_token(t: int) -> None:
        piece = stream.add(t)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    caches = ckpt.model.make_cache(settings)
    generate = dist.guard(rank, generate)  # one process: generate itself
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
        print_json({"text": text_out, **d, "kv_mode": kv, "kv_auto_reason": m.kv_auto_reason,
                    "kv_window": settings.fp16_window,
                    "kv_prefill_fp16": settings.prefill_fp16 if kv != "fp16" else None,
                    "kv_value_gain": settings.value_gain if kv != "fp16" else None,
                    "rotation": settings.rotation if kv == "isoquant3" else None,
                    "kv_key_bits": settings.key_bits if kv != "fp16" else None,
                    "kv_pair_points": list(pairs) if pairs else None,
                    "kv_edge_layers": settings.edge_layers if kv != "fp16" else None,
                    "kv_edge_bits": settings.edge_bits if kv != "fp16" and settings.edge_layers else None,
                    "attention_paths": attention_paths(caches), "max_kv_size": settings.max_kv_size,
                    "chat_template": wrapped and bool(tok.chat_template),
                    "settings_from": m.source, "model_type": ckpt.model_type, "model": str(ckpt.path)})
        return
    tail = stream.flush()
    sys.stdout.write(tail + "\n")
    sys.stdout.flush()
    ratio = f" ({res.kv_bytes_fp16 / res.kv_bytes:.2f}x smaller)" if res.kv_bytes_fp16 > res.kv_bytes > 0 else ""
    notes = ([f"pair codebooks {pairs[0]}/{pairs[1]}"] if pairs else []) + (
        [f"{settings.edge_layers} edge layer(s) at {settings.edge_bits} bits"] if kv != "fp16" and settings.edge_layers
        else [])
    kv_stat = f"KV {kv}{f' ({chr(44).join(notes)})' if notes else ''} {_fmt_bytes(res.kv_bytes)}"
    auto_note = f" | {kv_auto_note(m)}" if m.kv_auto_reason else ""
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
        f"peak mem {_fmt_bytes(res.peak_memory_bytes)} (rss {_fmt_bytes(res.peak_rss_bytes)}) | {kv_stat}{auto_note}",
        highlight=False, soft_wrap=True)
    if pager_obj is not None:
        st = pager_obj.report()
        hr = f"{100 * st.hit_rate:.1f}%" if st.hit_rate is not None else "n/a (OS cache)"
        console.print(f"pager {st.policy}: {st.slots} slots/layer, hit rate {hr}, {st.misses} reads "
                      f"({_fmt_bytes(st.bytes_read)}), {st.evictions} evictions", highlight=False, soft_wrap=True)
