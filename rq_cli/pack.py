"""`rq pack CKPT [--json]`."""

from __future__ import annotations

import typer

from rq_cli.common import console, handle_errors, print_json, progress_bar


@handle_errors
def pack(
    ckpt: str = typer.Argument(..., help="A (quantized) checkpoint directory."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Lay out each routed expert contiguously (16 KiB aligned) in CKPT/experts/ for the pager."""
    from rq_core.pack import pack as run_pack
    from rq_core.planner import fmt_bytes

    with progress_bar(disable=json_out) as progress:
        res = run_pack(ckpt, progress=progress)
    if json_out:
        print_json({"pack": res.as_dict()})
        return
    console.print(f"wrote {res.out}: {res.experts} experts in {res.layers} layer file(s), "
                  f"{fmt_bytes(res.page_bytes)} pages, {fmt_bytes(res.bytes_written)}", highlight=False)
