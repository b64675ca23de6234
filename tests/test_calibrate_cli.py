"""`rq calibrate-codebook`: JSON fields, TOML output, sample fitting, one-line errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from rq_cli.main import app
from rq_core.codec.codebook import Codebook, get_codebook

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["calibrate-codebook", *args])


def test_sphere_json_and_toml(tmp_path):
    out = tmp_path / "cb.toml"
    r = _run("--bits", "3", "--dim", "128", "--distribution", "sphere", "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert {"bits", "dim", "distribution", "levels", "thresholds", "mse"} <= set(info)
    assert info["bits"] == 3 and info["dim"] == 128 and info["distribution"] == "sphere"
    np.testing.assert_allclose(info["levels"][4:], [0.2444, 0.7533, 1.3366, 2.1315], atol=2e-3)
    assert len(info["thresholds"]) == 7
    np.testing.assert_allclose(Codebook.load(out).levels, info["levels"])
    # The cache accepts the file as its codebook.
    assert get_codebook(str(out), 3, 128).bits == 3


def test_gaussian_human_output():
    r = _run("--bits", "2", "--distribution", "gaussian")
    assert r.exit_code == 0 and "+1.5104" in r.stdout


def test_from_samples(tmp_path):
    path = tmp_path / "k.safetensors"
    x = mx.random.normal((3000, 64), key=mx.random.key(0)) * mx.array([30.0] * 2 + [1.0] * 62)
    mx.save_safetensors(str(path), {"keys": x.astype(mx.bfloat16), "other": mx.zeros((4, 64))})
    r = _run("--from-samples", str(path), "--tensor", "keys", "--bits", "3", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["dim"] == 64 and info["distribution"] == "samples" and info["n_samples"] == 3000 * 64
    assert np.all(np.diff(info["levels"]) > 0) and 0 < info["mse"] < 0.05


@pytest.mark.parametrize("args,msg", [
    (["--bits", "3", "--dim", "100"], "power of two"),
    (["--bits", "5", "--dim", "128"], "bits must be"),
    (["--bits", "0", "--distribution", "gaussian"], "bits must be"),
    (["--distribution", "cauchy", "--dim", "64"], "unknown distribution"),
    (["--distribution", "sphere"], "needs --dim"),
])
def test_bad_input_is_one_line(args, msg):
    r = _run(*args)
    assert r.exit_code != 0 and msg in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_samples_errors(tmp_path):
    path = tmp_path / "s.safetensors"
    mx.save_safetensors(str(path), {"a": mx.ones((8, 64)), "b": mx.ones((8, 48))})
    for args, msg in [(["--tensor", "missing"], "no tensor 'missing'"), ([], "pick one with --tensor"),
                      (["--tensor", "b"], "power of two")]:
        r = _run("--from-samples", str(path), *args)
        assert r.exit_code != 0 and msg in r.output and len(r.output.strip().splitlines()) == 1
    r = _run("--from-samples", str(tmp_path / "none.safetensors"))
    assert r.exit_code != 0 and "not found" in r.output
