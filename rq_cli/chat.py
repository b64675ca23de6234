"""`rq chat`: an interactive conversation with a model at the terminal (as mlx_lm.chat, llama-cli)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import typer

from rq_cli.common import (COUNT, FRACTION, POSITIVE, SEED, KvAuto, KvConfig, MaxKvSize, MaxTokens, MemoryBudget, MinP,
                           ModelArg, ModelOpt, Pager, PrefillChunk, Range, Seed, Temp, TopK, TopP, console,
                           gpu_first_run_note, handle_errors, model_arg, print_error)
from rq_cli.run import Pages, attach, kv_auto_note, load_model, plan_context, settle_kv
from rq_core.errors import RQError

HELP = "/reset clears the conversation, /quit (or Ctrl-D) exits"


@handle_errors(max_tokens=POSITIVE, temp=Range(min=0), top_p=Range(0, 1, min_open=True), top_k=COUNT, min_p=FRACTION,
               seed=SEED, prefill_chunk=POSITIVE, max_kv_size=POSITIVE)
def chat(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT", show_default=False,
                                         help="A system message at the start of the conversation."),
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
    prefill_chunk: PrefillChunk = 512,
) -> None:
    """Chat at a prompt: each line is a user message; the reply streams back. The conversation is kept (in the
    model's chat template, or a plain transcript for a model without one); /reset clears it, /quit or Ctrl-D exits."""
    from rq_core.serve import Engine, Sampling

    m = load_model(model_arg(model, model_opt), kv, kv_config, memory_budget, pager, pages,
                   max_kv_size=max_kv_size)
    m = settle_kv(m, plan_context(m), prefill_chunk)
    if m.kv_auto_reason:
        console.print(kv_auto_note(m), highlight=False, soft_wrap=True)
    attach(m, context=plan_context(m), prefill_chunk=prefill_chunk)
    engine = Engine(m.ckpt, m.settings, prefill_chunk=prefill_chunk)
    gpu_first_run_note()
    start = [{"role": "system", "content": system}] if system is not None else []
    history = list(start)
    sampling = Sampling(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    console.print(f"rq chat: {engine.name}; {HELP}", highlight=False, soft_wrap=True)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    while True:
        try:
            line = input(">> ")
        except EOFError:
            sys.stdout.write("\n")
            break
        text = line.strip()
        if not text:
            continue
        if text == "/quit":
            break
        if text == "/reset":
            history = list(start)
            console.print("(conversation cleared)", highlight=False)
            continue
        if text.startswith("/") and " " not in text:
            print_error(f"unknown command {text} ({HELP})")
            continue
        ids = engine.chat_ids(history + [{"role": "user", "content": line}])
        try:
            reply = engine.complete(ids, sampling, show)
        except RQError as e:  # e.g. the conversation outgrew the context: the chat goes on
            print_error(f"{e} (/reset starts over)")
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            sys.stdout.write("\n")
            console.print("(reply interrupted)", highlight=False)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply.text}]
        sampling = dataclasses.replace(sampling, seed=None)  # seeded once: later replies continue the stream
