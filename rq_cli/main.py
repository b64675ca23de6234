"""The `rq` command line: thin wrappers that parse, show progress, print tables or --json."""

from __future__ import annotations

import typer

from rq_cli import bench, calibrate, chat, eval as eval_cmd, pack, profile, quantize, run, serve, soak
from rq_cli.common import OneLineErrors, RQCommand

app = typer.Typer(
    name="rq",
    help="RotaryQuant: run big Mixture-of-Experts LLMs in 16-32 GB.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)


def _version(value: bool) -> None:
    if value:
        from rq_core import __version__

        typer.echo(f"rq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass

app.command("quantize", cls=RQCommand, help="Quantize a checkpoint by role with a TOML recipe.")(quantize.quantize)
app.command("dequantize", cls=RQCommand, help="Write a full-precision copy of a quantized checkpoint.")(quantize.dequantize)
app.command("calibrate-codebook", cls=RQCommand, help="Compute a Lloyd-Max codebook for the KV cache.")(calibrate.calibrate_codebook)
app.command("pack", cls=RQCommand, help="Lay out experts as aligned page files for the pager.")(pack.pack)
app.command("run", cls=RQCommand, help="Generate text with a (quantized) model.")(run.run)
app.command("serve", cls=RQCommand, help="Serve a model over an OpenAI-compatible HTTP API.")(serve.serve)
app.command("chat", cls=RQCommand, help="Chat with a model at an interactive prompt.")(chat.chat)
app.command("profile", cls=RQCommand, help="Time attention kernels and say whether KV compression pays.")(profile.profile)
app.command("soak", cls=RQCommand, help="Generate for minutes or hours, tracking memory, speed and quality.")(soak.soak)
app.command("bench", cls=RQCommand, help="Decode/prefill speed, peak memory and KV bytes per context and KV mode.")(bench.bench)
app.add_typer(eval_cmd.app, name="eval", help="Quality: perplexity, needle retrieval, gates.")

if __name__ == "__main__":
    app()
