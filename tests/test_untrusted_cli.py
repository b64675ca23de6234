"""Hostile input to the command line: what is at -o is never deleted, a full disk is one line and leaves
nothing, chat templates run with a time/size limit, text must be UTF-8, every number is checked, all JSON
is strict, and `rq --version` prints the one version there is."""

from __future__ import annotations

import errno
import io
import itertools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _tiny_models import make_tiny
from rq_cli.main import app
from rq_core.quant import recipe
from rq_core.errors import RQError

ROOT = Path(__file__).resolve().parent.parent
RECIPE = Path(__file__).parent / "data" / "tiny-rtn.toml"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny full-precision checkpoint with the golden tokenizer."""
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("untrusted") / "src")


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_error(r, *needles: str) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    for n in needles:
        assert n in lines[0], r.output
    return lines[0]


_DEAD_PIDS = itertools.count(4_194_305)  # above Linux's largest pid_max (2^22) and macOS's 99,998: never a live process


def _dead_pid() -> int:
    """A PID no process has (a reaped child's can be handed out again while other tests spawn processes)."""
    return next(_DEAD_PIDS)


def _loads(path: Path) -> None:
    from rq_core.checkpoint import load

    load(path, tokenizer=False)


# ------------------------------------------------------------------------ 1. what is at -o stays
def test_quantize_never_deletes_a_folder_that_appears_at_out(src, tmp_path):
    from rq_core.quant.quantize import quantize

    out = tmp_path / "q"

    def someone_else_writes_there(stage, done, total):
        if stage == "quantize" and done == 1:
            out.mkdir()
            (out / "notes.txt").write_text("mine")

    with pytest.raises(RQError, match="appeared while quantizing"):
        quantize(src, recipe.load(RECIPE), out, progress=someone_else_writes_there)
    assert (out / "notes.txt").read_text() == "mine" and sorted(os.listdir(out)) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # and no temp folder is left


def test_quantize_removes_only_its_own_stale_temp_folders(src, tmp_path):
    from rq_core.quant.quantize import TMP_MARK, quantize

    dead = _dead_pid()
    killed = tmp_path / f".q.tmp-{dead}"  # what a kill -9 leaves: marked, its process gone
    killed.mkdir()
    (killed / TMP_MARK).touch()
    (killed / "part-00000.safetensors").write_bytes(b"half")
    empty = tmp_path / f".q.tmp-{_dead_pid()}"  # killed between mkdir and the mark
    empty.mkdir()
    users = tmp_path / f".q.tmp-{_dead_pid()}"  # same name pattern, not ours: no mark, has data
    users.mkdir()
    (users / "data.txt").write_text("keep")
    alive = tmp_path / f".q.tmp-{os.getppid()}"  # a run still going
    alive.mkdir()
    (alive / TMP_MARK).touch()

    quantize(src, recipe.load(RECIPE), tmp_path / "q")
    _loads(tmp_path / "q")
    assert not killed.exists() and not empty.exists()
    assert (users / "data.txt").read_text() == "keep" and alive.is_dir()
    assert not (tmp_path / "q" / TMP_MARK).exists()


# ------------------------------------------------------------------------- 2. the disk fills up
def test_quantize_disk_full_is_one_line_and_leaves_nothing(src, tmp_path, monkeypatch):
    """Shard writes hit ENOSPC after a few KB (the file the writer opens raises as a full disk does)."""
    import rq_core.quant.quantize as qmod

    class FullDisk(io.FileIO):
        room = 4096

        def write(self, b):
            if FullDisk.room < len(b):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            FullDisk.room -= len(b)
            return super().write(b)

    def full_disk_open(path, mode="r", *a, **kw):
        assert "b" in mode and "w" in mode, mode
        return FullDisk(path, "wb")

    monkeypatch.setattr(qmod, "open", full_disk_open, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    r = _invoke("quantize", src, "--recipe", RECIPE, "-o", work / "q")
    _one_line_error(r, "No space left on device", "partial output was removed")
    assert list(work.iterdir()) == []


def test_quantize_real_write_failure_is_one_line_and_leaves_nothing(src, tmp_path):
    """The kernel refuses writes past a file-size limit (RLIMIT_FSIZE): the same failure as a full disk."""
    work = tmp_path / "work"
    work.mkdir()
    limit = 64 * 1024  # the tiny checkpoint's shard is ~1 MB; config.json and the recipe are smaller

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-m", "rq_cli.main", "quantize", str(src), "--recipe", str(RECIPE),
                        "-o", str(work / "q")], capture_output=True, text=True, env=env, preexec_fn=limit_file_size,
                       timeout=300)
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(err) == 1 and err[0].startswith("error:"), p.stderr
    assert "File too large" in err[0] and "Traceback" not in p.stderr
    assert list(work.iterdir()) == []


# ------------------------------------------------------------------------------- 3. chat templates
@pytest.fixture
def chat_ckpt(src, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    return ck


class _Hang(Exception):
    pass


@pytest.fixture
def no_hang():
    """Fail (instead of hanging the suite) if a call does not return within 60 s."""
    def on_alarm(*_):
        raise _Hang("no answer within 60 s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("template, needle", [
    ("{% for i in range(1e8) %}x{% endfor %}", "range() takes integers"),
    ("{% for i in range(100000000) %}x{% endfor %}", "at most 100000"),
    ("{{ 'a'.ljust(10**10) }}", "MiB of memory"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output is longer"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "nests too deeply"),
])
def test_hostile_chat_template_is_one_line(chat_ckpt, no_hang, template, needle):
    (chat_ckpt / "chat_template.jinja").write_text(template)
    r = _invoke("run", chat_ckpt, "--prompt", "hi", "--chat", "-n", "1")
    _one_line_error(r, "chat template failed", needle)


def test_chat_template_that_never_ends_is_stopped(chat_ckpt, no_hang, monkeypatch):
    import rq_core.tokenizer as tok

    monkeypatch.setattr(tok, "TEMPLATE_SECONDS", 2.0)
    (chat_ckpt / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    r = _invoke("run", chat_ckpt, "--prompt", "hi", "--chat", "-n", "1")
    _one_line_error(r, "chat template failed", "did not finish in 2 s")


def test_chat_template_still_renders(chat_ckpt):
    (chat_ckpt / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    from rq_core.tokenizer import load_tokenizer

    tk = load_tokenizer(chat_ckpt)
    assert tk.apply_chat_template([{"role": "user", "content": "hé"}]) == "<user>hé<a>"


# ---------------------------------------------------------------------------------- 4. UTF-8 text
def test_prompt_bytes_that_are_not_utf8_are_one_line(src):
    # Python hands command-line bytes that are not UTF-8 (b"\xff") to the program as lone surrogates
    r = _invoke("run", src, "--prompt", b"caf\xff".decode("utf-8", "surrogateescape"), "-n", "1")
    _one_line_error(r, "--prompt", "not valid UTF-8", "0xff")


def test_prompt_file_that_is_not_utf8_is_one_line(src, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"To be, or not to be\n" * 50 + b"\xc3\x28 that is the question\n")
    r = _invoke("eval", "ppl", src, "--text", bad, "--windows", "1")
    _one_line_error(r, "not valid UTF-8", "0xc3")
    # calibration text used to be decoded with replacement characters: a silently different text
    gptq = tmp_path / "gptq.toml"
    gptq.write_text(RECIPE.read_text().replace("[roles.attention]", '[roles.attention]\nmethod = "gptq"', 1))
    assert recipe.load(gptq).calibrated
    r = _invoke("quantize", src, "--recipe", gptq, "--calib", bad, "-o", tmp_path / "q")
    _one_line_error(r, "not valid UTF-8")
    assert not (tmp_path / "q").exists()


def test_recipe_and_template_files_that_are_not_utf8_are_one_line(src, tmp_path, chat_ckpt):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(RECIPE.read_bytes() + b'\ndescription = "\xff"\n')
    r = _invoke("quantize", src, "--recipe", bad, "-o", tmp_path / "q")
    _one_line_error(r, "not valid UTF-8")
    (chat_ckpt / "chat_template.jinja").write_bytes(b"{{ '\xfe' }}")
    r = _invoke("run", chat_ckpt, "--prompt", "hi", "--chat", "-n", "1")
    _one_line_error(r, "chat_template.jinja", "not valid UTF-8")


# --------------------------------------------------------------------------------- 5. flag values
def _commands():
    """(argv prefix, click command) of every leaf command."""
    import typer

    root = typer.main.get_command(app)
    out = []

    def walk(group, prefix):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                walk(cmd, prefix + [name])
            else:
                out.append((prefix + [name], cmd))

    walk(root, [])
    return out


def _numeric_options():
    """(argv, command, parameter name, flag, float?) of every int or float option, from the annotations."""
    import inspect
    import typing

    from rq_cli.common import param_decls

    for argv, cmd in _commands():
        fn = inspect.unwrap(cmd.callback)
        hints = typing.get_type_hints(fn)  # Annotated aliases (rq_cli.common) stripped to their types
        for name in inspect.signature(fn).parameters:
            kinds = set(typing.get_args(hints[name]) or (hints[name],)) - {type(None)}
            decls = [d for d in param_decls(fn, name) if d.startswith("--")]
            if decls and kinds & {int, float} and bool not in kinds:
                yield argv, cmd, name, decls[0], float in kinds


def test_every_numeric_option_has_declared_bounds():
    missing = []
    for argv, cmd, name, flag, _ in _numeric_options():
        if name not in getattr(cmd.callback, "ranges", {}):
            missing.append(f"{' '.join(argv)} {flag}")
    assert not missing, missing
    assert len(list(_numeric_options())) >= 25  # the walk sees options given directly and as Annotated aliases


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_option_rejects_non_finite_values(tmp_path, value):
    floats = [(argv, name, flag) for argv, _, name, flag, is_float in _numeric_options() if is_float]
    assert len(floats) >= 8
    for argv, name, flag in floats:
        # required options get harmless values; the model path does not exist, so a run that got past the
        # number check would fail on that instead, with a different line
        extra = ["--report", str(tmp_path / "r.json")] if argv == ["soak"] else []
        extra += ["--prompt", "hi"] if argv == ["run"] else []
        extra += ["--recipe", str(RECIPE)] if argv == ["quantize"] else []
        model = [] if argv == ["calibrate-codebook"] else [str(tmp_path / "none")]
        args = [*argv, *model, *extra, flag, value]
        if argv == ["soak"] and name not in ("hours", "minutes", "seconds"):
            args += ["--minutes", "1"]
        _one_line_error(_invoke(*args), flag, "finite")


@pytest.mark.parametrize("args, needle", [
    # checked by hand in `rq run` before; these guard the move into the declared ranges
    (["run", "--prompt", "hi", "--temp", "-0.5"], "--temp must be >= 0"),
    (["run", "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["run", "--prompt", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["run", "--prompt", "hi", "--max-tokens", "-1"], "--max-tokens must be >= 0"),
])
def test_run_bounds_that_moved_still_hold(args, needle):
    _one_line_error(_invoke(*args), needle)


@pytest.mark.parametrize("args, needle", [
    (["run", "--prompt", "hi", "--seed", "-1"], "--seed must be in [0,"),
    (["soak", "--report", "r.json", "--minutes", "-2"], "--minutes must be > 0"),
    (["soak", "--report", "r.json", "--minutes", "1", "--max-throughput-drop", "2"], "must be in [0, 1]"),
    (["profile", "--threshold", "1.5"], "--threshold must be in [0, 1]"),
    (["eval", "niah", "--seed", "-3"], "--seed must be in [0,"),
    (["run", "--prompt", "hi", "--memory-budget", "0GB"], "must be a positive size"),
    (["run", "--prompt", "hi", "--temp", "abc"], "--temp"),  # not a number at all: one line too
])
def test_out_of_range_flags_are_one_line(args, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_error(_invoke(*args), needle)


def test_soak_hours_nan_does_not_pass_or_write_nan(tmp_path):
    rep = tmp_path / "r.json"
    _one_line_error(_invoke("soak", "--hours", "nan", "--report", rep), "--hours", "finite")
    assert not rep.exists()


@pytest.mark.parametrize("table, key, value, needle", [
    ("calibration", "damp", float("nan"), "'calibration.damp' = nan is not a finite number"),
    ("promote", "kurtosis_threshold", float("inf"), "'promote.kurtosis_threshold' = inf is not a finite number"),
    ("kv", "fp16_window", -1, "kv.fp16_window = -1 must be >= 0"),
    ("kv", "seed", -1, "kv.seed = -1 must be between 0"),
    ("kv", "fp16_window", 2.5, "'kv.fp16_window' must be an integer"),
    ("pager", "context", 0, "pager.context = 0 must be >= 1"),
    ("calibration", "tokens", 0, "calibration.tokens = 0 must be >= 1"),
    ("calibration", "damp", -0.5, "calibration.damp = -0.5 must be >= 0"),
    ("pager", "memory_budget", "0GB", "must be a positive size"),
])
def test_recipe_numbers_are_checked(table, key, value, needle):
    import re

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    data = tomllib.loads(RECIPE.read_text())
    data.setdefault(table, {})[key] = value
    with pytest.raises(RQError, match=re.escape(needle)):
        recipe.parse(data, "r.toml")


def test_recipe_nan_in_toml_text_is_one_line(src, tmp_path):
    bad = tmp_path / "nan.toml"
    bad.write_text(RECIPE.read_text() + "damp = nan\n")  # the file ends in [calibration]
    _one_line_error(_invoke("quantize", src, "--recipe", bad, "-o", tmp_path / "q"), "calibration.damp", "finite")


def _strict(text: str):
    def no_constants(c):
        raise AssertionError(f"{c} is not JSON")

    return json.loads(text, parse_constant=no_constants)


def test_json_output_is_strict(tmp_path, capsys):
    from rq_cli.common import print_json
    from rq_core.tools.soak import write_json_atomic

    obj = {"ppl": float("nan"), "rate": float("inf"), "ok": [1.5, float("-inf")], "n": 3}
    print_json(obj)
    assert _strict(capsys.readouterr().out) == {"ppl": None, "rate": None, "ok": [1.5, None], "n": 3}
    write_json_atomic(tmp_path / "r.json", obj)
    assert _strict((tmp_path / "r.json").read_text())["ok"] == [1.5, None]


# -------------------------------------------------------------------------------------- 6. version
def test_version_is_printed_and_has_one_home():
    import rq_core

    r = _invoke("--version")
    assert r.exit_code == 0 and r.output.strip() == f"rq {rq_core.__version__}"
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rq_core.__version__"}
