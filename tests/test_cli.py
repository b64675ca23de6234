"""The command line exists and lists every command."""

from typer.testing import CliRunner

from rq_cli.main import app


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ["quantize", "calibrate-codebook", "pack", "run", "profile", "soak", "eval"]:
        assert name in result.output
