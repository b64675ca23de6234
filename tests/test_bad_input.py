"""Bad input gives one clear line and exit 2 (never a traceback); interrupted writers leave nothing
that loads; the wheel's package list covers the tree and the data the code reads at run time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from _tiny_models import make_tiny
from rq_cli.common import handle_errors
from rq_cli.main import app
from rq_core.quant import recipe
from rq_core.errors import RQError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
RECIPE = Path(__file__).parent / "data" / "tiny-rtn.toml"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny full-precision qwen3_moe checkpoint and its quantized + packed copy."""
    from rq_core.paging.pack import pack
    from rq_core.quant.quantize import quantize

    root = tmp_path_factory.mktemp("bad")
    src = make_tiny("qwen3_moe", root / "src")
    q = root / "q"
    quantize(src, recipe.load(RECIPE), q)
    pack(q)
    return src, q


def _one_line_error(r, *needles: str) -> None:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    for n in needles:
        assert n in lines[0], r.output


def _invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_config_missing_tensors_is_one_line(ckpts, tmp_path):
    src, _ = ckpts
    bad = tmp_path / "m"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_experts"] *= 2  # the config promises experts the weights do not have
    (bad / "config.json").write_text(json.dumps(cfg))
    _one_line_error(_invoke("run", bad, "-p", "hi", "-n", "1"), "does not match its config")


def test_quantizing_a_quantized_checkpoint_is_one_line(ckpts, tmp_path):
    _, q = ckpts
    _one_line_error(_invoke("quantize", q, "-r", RECIPE, "-o", tmp_path / "o"), "already quantized")
    _one_line_error(_invoke("quantize", q, "-r", RECIPE, "--analyze"), "already quantized")
    assert not (tmp_path / "o").exists()


def test_corrupt_page_index_is_one_line(ckpts, tmp_path):
    _, q = ckpts
    bad = tmp_path / "q"
    shutil.copytree(q, bad)
    (bad / "experts" / "index.json").write_text("{bad")
    _one_line_error(_invoke("run", bad, "-p", "hi", "-n", "1", "--memory-budget", "1GB"), "rq pack")


@pytest.mark.parametrize("text,needle", [("{x", "not valid JSON"), ("[1]", "JSON object"), ('{"a": 1}', "model_type")])
def test_plan_from_a_bad_config_file_is_one_line(tmp_path, text, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(text)
    _one_line_error(_invoke("quantize", cfg, "-r", "qwen3-16gb", "--plan"), needle)


def test_bad_chat_template_json_is_one_line(ckpts, tmp_path):
    src, _ = ckpts
    bad = tmp_path / "m"
    shutil.copytree(src, bad)
    shutil.copy(ROOT / "tests" / "golden" / "qwen3_moe" / "model" / "tokenizer.json", bad)
    (bad / "chat_template.json").write_text("{x")
    _one_line_error(_invoke("run", bad, "-p", "hi", "-n", "1", "--chat"), "chat_template.json")


def test_codebook_out_is_a_directory(tmp_path):
    _one_line_error(_invoke("calibrate-codebook", "--dim", "32", "--out", tmp_path), "is a directory")
    assert list(tmp_path.iterdir()) == []


def test_codebook_out_is_readable_by_others(tmp_path):
    out = tmp_path / "cb.toml"
    assert _invoke("calibrate-codebook", "--dim", "32", "--out", out).exit_code == 0
    assert out.stat().st_mode & 0o044 == 0o044


def test_os_errors_are_one_line(capsys):
    @handle_errors
    def boom() -> None:
        raise PermissionError(13, "Permission denied", "/x/y.toml")

    with pytest.raises(typer.Exit) as e:
        boom()
    assert e.value.exit_code == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and "/x/y.toml" in err and len(err.strip().splitlines()) == 1


def test_eval_context_zero_is_rejected_not_defaulted():
    # `--context 0` used to fall back silently to the model's full context (a long run)
    _one_line_error(_invoke("eval", "ppl", "--context", "0"), "--context")


def test_console_script_errors_without_traceback(tmp_path):
    exe = shutil.which("rq")
    if exe is None:
        pytest.skip("rq console script not installed")
    (tmp_path / "empty").mkdir()
    for args in (["run", str(tmp_path / "empty"), "-p", "hi"], ["pack", str(tmp_path / "empty")],
                 ["calibrate-codebook", "--dim", "24"],
                 ["calibrate-codebook", "--dim", "32", "--bits", "5"], ["run", "-p", "hi", "--kv", "bad"]):
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stdout == ""


def test_json_stdout_is_one_object(ckpts, tmp_path):
    src, q = ckpts
    ck = tmp_path / "q"
    shutil.copytree(q, ck)
    for args in (["quantize", src, "-r", RECIPE, "-o", tmp_path / "o", "--json"], ["pack", ck, "--json"],
                 ["run", ck, "-p", "hi", "-n", "2", "--json"],
                 ["run", ck, "-p", "hi", "-n", "2", "--json", "--memory-budget", "1GB"],
                 ["calibrate-codebook", "--dim", "32", "--json"]):
        r = _invoke(*args)
        assert r.exit_code == 0, r.output
        assert r.stdout.count("\n") == 1 and isinstance(json.loads(r.stdout), dict), (args, r.stdout)


# ------------------------------------------------------------------------------- interrupted writers
def test_interrupted_pack_keeps_the_old_pages(ckpts, tmp_path):
    from rq_core.paging.pack import load_index, pack

    _, q = ckpts
    ck = tmp_path / "q"
    shutil.copytree(q, ck)
    before = (ck / "experts" / "index.json").read_bytes()

    def boom(stage, done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack(ck, progress=boom)
    assert (ck / "experts" / "index.json").read_bytes() == before
    assert load_index(ck)["version"] == 1
    assert not [p for p in ck.iterdir() if p.name.startswith(".experts")]
    shutil.rmtree(ck / "experts")
    with pytest.raises(KeyboardInterrupt):
        pack(ck, progress=boom)
    assert not (ck / "experts").exists()


_KILL = """
import os, signal, sys
from rq_core.quant import recipe
from rq_core.{mod} import {fn}
def progress(stage, done, total):
    if done == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # killed midway, no cleanup runs
{call}
"""


@pytest.mark.parametrize("what", ["quantize", "pack"])
def test_killed_writer_leaves_nothing_that_loads(ckpts, tmp_path, what):
    from rq_core.checkpoint import load

    src, q = ckpts
    if what == "quantize":
        out = tmp_path / "q"
        code = _KILL.format(mod="quant.quantize", fn="quantize",
                            call=f"quantize({str(src)!r}, recipe.load({str(RECIPE)!r}), {str(out)!r}, progress=progress)")
    else:
        ck = tmp_path / "ck"
        shutil.copytree(q, ck)
        shutil.rmtree(ck / "experts")
        out = ck / "experts"
        code = _KILL.format(mod="paging.pack", fn="pack", call=f"pack({str(ck)!r}, progress=progress)")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not out.exists()
    for p in out.parent.iterdir():  # what the killed writer left is hidden and incomplete
        if p.name.startswith("."):
            assert not (p / "config.json").exists() and not (p / "index.json").exists()
            with pytest.raises(RQError):
                load(p)


# ------------------------------------------------------------------------------------------ packaging
def test_wheel_package_list_covers_the_tree_and_runtime_data():
    from rq_core.kernels import launch as kernels
    from rq_core.quant.recipe import RECIPES_DIR

    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(st["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for top in ("rq_core", "rq_cli")
               for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk <= listed, f"packages missing from pyproject.toml: {on_disk - listed}"
    pdir = st["package-dir"]
    assert (ROOT / pdir["rq_core._metal"]).resolve() == kernels.SRC_DIR
    assert (ROOT / pdir["rq_core._recipes"]).resolve() == RECIPES_DIR
    globs = st["package-data"]["rq_core._metal"]
    needed = {s.body for s in kernels.SPECS.values()} | {"common.h", "prelude_metal.h", "prelude_cuda.h"}
    shipped = {p.name for g in globs for p in kernels.SRC_DIR.glob(g)}
    assert needed <= shipped, f"kernel sources not in the wheel: {needed - shipped}"
    assert recipe.load("qwen3-16gb").name == "qwen3-16gb"  # bundled names resolve through RECIPES_DIR
