"""`rq serve`: an OpenAI-compatible HTTP server for one model (rq_core.serve)."""

from __future__ import annotations

from typing import Optional

import typer

from rq_cli.common import (COUNT, FRACTION, POSITIVE, SEED, KvAuto, KvConfig, MaxKvSize, MaxTokens, MemoryBudget, MinP,
                           ModelArg, ModelOpt, Pager, PrefillChunk, Range, Seed, Temp, TopK, TopP, console,
                           gpu_first_run_note, handle_errors, model_arg)
from rq_cli.run import Pages, attach, kv_auto_note, load_model, plan_context, settle_kv


@handle_errors(max_tokens=POSITIVE, temp=Range(min=0), top_p=Range(0, 1, min_open=True), top_k=COUNT, min_p=FRACTION,
               seed=SEED, prefill_chunk=POSITIVE, max_kv_size=POSITIVE, port=Range(0, 65535))
def serve(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    host: str = typer.Option("127.0.0.1", "--host", metavar="HOST", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", metavar="N", help="Port to listen on (0: any free port)."),
    max_tokens: MaxTokens = 512,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    seed: Optional[int] = typer.Option(None, "--seed", metavar="N", show_default=False,
                                       help="Random seed for requests without one (default: unseeded)."),
    kv: KvAuto = None,
    kv_config: KvConfig = None,
    max_kv_size: MaxKvSize = None,
    memory_budget: MemoryBudget = None,
    pager: Pager = None,
    pages: Pages = None,
    prefill_chunk: PrefillChunk = 512,
) -> None:
    """Serve the model over HTTP: POST /v1/chat/completions and /v1/completions (streamed with "stream": true),
    GET /v1/models and /health. The flags' sampling values are the defaults a request's fields override.

    The model loads once; requests run one at a time, each in a fresh KV cache."""
    from rq_core.serve import Engine, Sampling, serve as run_server

    m = load_model(model_arg(model, model_opt), kv, kv_config, memory_budget, pager, pages,
                   max_kv_size=max_kv_size)
    m = settle_kv(m, plan_context(m), prefill_chunk)
    if m.kv_auto_reason:
        console.print(kv_auto_note(m), highlight=False, soft_wrap=True)
    attach(m, context=plan_context(m), prefill_chunk=prefill_chunk)
    engine = Engine(m.ckpt, m.settings, prefill_chunk=prefill_chunk,
                    name=model_arg(model, model_opt) or m.ckpt.path.name)
    gpu_first_run_note()
    defaults = Sampling(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)

    def ready(url: str) -> None:
        console.print(f"rq serve: {engine.name} at {url}/v1 (Ctrl-C stops)", highlight=False, soft_wrap=True)

    try:
        run_server(engine, host, port, defaults, on_ready=ready)
    except KeyboardInterrupt:
        console.print("rq serve: stopped", highlight=False)
