"""The command line exists and lists every command."""

from typer.testing import CliRunner

from rq_cli.main import app


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ["quantize", "calibrate-codebook", "pack", "run", "profile", "soak", "eval"]:
        assert name in result.output


def _commands():
    """(argv, click command) of every leaf command."""
    import typer

    out = []

    def walk(group, prefix):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                walk(cmd, prefix + [name])
            else:
                out.append((prefix + [name], cmd))

    walk(typer.main.get_command(app), [])
    return out


def test_help_has_no_type_tags_or_braces() -> None:
    """Every command's help: values named by a metavar (N, SIZE, ...), flags by nothing, arguments as MODEL or
    [MODEL] in the usage line, and no words about measurements."""
    import re

    cmds = _commands()
    assert len(cmds) >= 9
    for argv, _ in [([], None), (["eval"], None), *cmds]:
        r = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        for tag in ("<bool>", "<str>", "<int>", "<float>", "{", "}"):
            assert tag not in r.output, (argv, tag, r.output)
        assert not re.search(r"\bmeasured\b", r.output), (argv, r.output)
        usage = next(ln for ln in r.output.splitlines() if "Usage:" in ln)
        if argv not in ([], ["eval"], ["calibrate-codebook"]):
            assert usage.split()[-1] in ("MODEL", "[MODEL]") and "model" not in usage, usage


def test_shared_options_have_one_name_and_default() -> None:
    """The commands that build a KV cache take MODEL or --model, --kv (default: the recipe's) and --kv-config;
    the sampling options of run and soak share their names."""
    cmds = dict((" ".join(a), c) for a, c in _commands())
    for name in ("run", "eval ppl", "eval gates", "eval niah", "profile", "soak"):
        params = {p.name: p for p in cmds[name].params}
        assert "--model" in params["model_opt"].opts and "-m" in params["model_opt"].opts, name
        assert params["kv_config"].opts == ["--kv-config"] and params["kv_config"].multiple, name
        assert params["kv"].opts == ["--kv"], name
        if name != "eval niah":  # several modes, each against fp16 (its help says so)
            assert params["kv"].default is None, name
        assert params["json_out"].opts == ["--json"], name
    for name in ("quantize", "pack"):
        assert "--model" in {o for p in cmds[name].params for o in p.opts}, name
    run, soak = ({p.name: p for p in cmds[n].params} for n in ("run", "soak"))
    for opt in ("temp", "top_p", "seed", "max_tokens", "memory_budget", "pager", "kv"):
        assert run[opt].opts == soak[opt].opts, opt
    # the same modes, and auto where one cache is run and picked (run, serve, chat)
    assert run["kv"].help.split(" (default")[0].replace("auto, ", "") == soak["kv"].help.split(" (default")[0]
    assert "auto, fp16" in run["kv"].help and "auto" not in soak["kv"].help.split(" (default")[0]


def test_error_lines_keep_brackets() -> None:
    """fail() prints text, not rich markup: [begin, end] and [bold] reach the user as typed."""
    import typer

    from rq_cli.common import fail, handle_errors
    from rq_core.errors import RQError

    t = typer.Typer()

    @t.command()
    @handle_errors
    def cmd(n: int = typer.Option(0, "--n")) -> None:
        if n == 1:
            fail("x must lie in [begin, end] (got [bold]7[/bold])")
        raise RQError("a path like /tmp/[abc]/model")

    r = CliRunner().invoke(t, ["--n", "1"])
    assert r.exit_code == 2 and r.output.strip() == "error: x must lie in [begin, end] (got [bold]7[/bold])", r.output
    r = CliRunner().invoke(t, [])
    assert r.exit_code == 2 and r.output.strip() == "error: a path like /tmp/[abc]/model", r.output


def test_kv_config_help_names_every_recipe_key() -> None:
    from rq_cli.common import KV_CONFIG_KEYS
    from rq_core.quant.recipe import KV_KEYS

    assert set(KV_CONFIG_KEYS) == set(KV_KEYS) - {"mode"}


def test_quantize_and_pack_take_model_option(tmp_path) -> None:
    import json
    from pathlib import Path

    golden = Path(__file__).parent / "golden" / "qwen2_moe" / "model"
    recipe = Path(__file__).parent / "data" / "tiny-rtn.toml"
    a = CliRunner().invoke(app, ["quantize", str(golden), "-r", str(recipe), "--plan", "--json"])
    b = CliRunner().invoke(app, ["quantize", "--model", str(golden), "-r", str(recipe), "--plan", "--json"])
    assert a.exit_code == b.exit_code == 0, (a.output, b.output)
    assert json.loads(a.stdout) == json.loads(b.stdout)
    r = CliRunner().invoke(app, ["quantize", "-r", str(recipe), "--plan"])
    assert r.exit_code == 2 and r.output.startswith("error: missing MODEL"), r.output
    r = CliRunner().invoke(app, ["pack", "--model", str(golden), "--out", str(tmp_path / "pages"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["pack"]["experts"] > 0
