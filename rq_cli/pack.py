"""`rq pack CKPT [--out DIR | --move] [--json]`."""

from __future__ import annotations

from typing import Optional

import typer

from rq_cli.common import ModelOpt, console, handle_errors, model_arg, print_json, progress_bar


@handle_errors
def pack(
    ckpt: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False, help="A (quantized) checkpoint directory or hub id (default: the "
                                                   "bundled model)."),
    model_opt: ModelOpt = None,
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="DIR", help="Write the pages to this folder instead of "
                                      "CKPT/experts (then `rq run CKPT --pages DIR`), e.g. for a read-only "
                                      "checkpoint or the bundled model."),
    move: bool = typer.Option(False, "--move", help="Then take the routed experts out of the shards (rewritten "
                              "atomically): the checkpoint holds them once, in CKPT/experts, and still runs "
                              "without a budget. Run it again to finish a move that was interrupted."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Lay out each routed expert contiguously (aligned) in CKPT/experts/ (or --out DIR) for the pager; with
    --move, the checkpoint then holds its routed experts only there (once on disk)."""
    from rq_core.paging.pack import pack as run_pack
    from rq_core.paging.planner import fmt_bytes

    ckpt = model_arg(ckpt, model_opt)
    with progress_bar(disable=json_out) as progress:
        res = run_pack(ckpt, out=out, progress=progress, move=move)
    if json_out:
        print_json({"pack": res.as_dict()})
        return
    console.print(f"wrote {res.out}: {res.experts} experts in {res.layers} layer file(s), "
                  f"{fmt_bytes(res.page_bytes)} pages, {fmt_bytes(res.bytes_written)}", highlight=False)
