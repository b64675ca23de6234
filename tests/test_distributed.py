"""Pipeline-parallel generation over mx.distributed's ring backend on localhost: 2 and 3 ranks give the greedy
tokens of one process for every family (fp16 and isoquant3 KV, a chunked prefill), with a pager budget per
rank; bad input (a mismatched checkpoint, a budget one rank cannot hold, a peer that dies or freezes) is one line
on rank 0 and a non-zero exit on every rank, within a bounded time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _tiny_models import TINY, make_tiny
from rq_core.checkpoint import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_dist_worker.py")
LIMIT = 60  # seconds any launch may take before the test fails (instead of hanging)


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _spawn(tmp: Path, argvs: list[list[str]], env: dict | None = None) -> list[subprocess.Popen]:
    """One process per argv, ranks 0..n-1 of a ring on localhost (the environment mlx.launch sets)."""
    hostfile = tmp / f"hosts-{time.monotonic_ns()}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _ports(len(argvs))]))
    base = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "MLX_HOSTFILE": str(hostfile),
            **(env or {})}
    return [subprocess.Popen(argv, env={**base, "MLX_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for r, argv in enumerate(argvs)]


def _wait(procs: list[subprocess.Popen], limit: float = LIMIT) -> list[tuple[int, str, str]]:
    end = time.monotonic() + limit
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(0.1, end - time.monotonic()))
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _rq(*args: str) -> list[str]:
    return [sys.executable, "-m", "rq_cli.main", "run", *args]


def _single(path: Path, kv: str) -> list[int]:
    """The one-process tokens of a worker case (the worker's prompt, settings and chunked prefill)."""
    import _dist_worker as w
    from rq_core.checkpoint import load
    from rq_core.generate import generate

    model = load(path, cpu_float32=True, tokenizer=False).model
    return generate(model, w.PROMPT, max_tokens=8, kv=w.KV[kv], prefill_chunk=6).tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    out = {fam: make_tiny(fam, root / fam) for fam in TINY}
    out["bundled"] = DEFAULT_MODEL
    deep = json.loads(json.dumps(TINY["qwen3_moe"]))
    deep["num_hidden_layers"] = 4
    out["qwen3_moe-4"] = make_tiny("qwen3_moe", root / "qwen3_moe-4", config=deep)
    # KV sharing (layers 3, 4 reuse layers 1, 2) and per-layer embeddings: one cut allowed, at layer 1
    g = json.loads(json.dumps(TINY["gemma4"]))
    g["text_config"].update(num_hidden_layers=5, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
                            vocab_size_per_layer_input=320, use_double_wide_mlp=True,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                         "sliding_attention", "full_attention"])
    out["gemma4-shared"] = make_tiny("gemma4", root / "gemma4-shared", config=g)
    return out


def _pipelined(tmp: Path, ranks: int, cases: list[tuple[Path, str]]) -> list[list[int]]:
    res = tmp / "tokens.json"
    argv = [sys.executable, str(WORKER), str(res), json.dumps([[str(p), kv] for p, kv in cases])]
    got = _wait(_spawn(tmp, [argv] * ranks))
    for rc, o, e in got:
        assert rc == 0, e[-2000:]
    return json.loads(res.read_text())


BOTH = ("fp16", "isoquant3")


@pytest.mark.parametrize("ranks,names", [
    (2, [(n, BOTH) for n in ("qwen3_moe", "qwen2_moe", "nemotron_h", "gemma4", "gemma4-shared", "bundled")]),
    (3, [("qwen3_moe-4", BOTH), ("nemotron_h", ("fp16",)), ("gemma4", ("fp16",)), ("bundled", ("fp16",))]),
])
def test_greedy_tokens_equal_one_process(models, tmp_path, ranks, names):
    cases = [(models[n], kv) for n, kvs in names for kv in kvs]
    got = _pipelined(tmp_path, ranks, cases)
    for (path, kv), toks in zip(cases, got):
        want = _single(path, kv)
        assert len(want) == 8
        assert toks == want, (path.name, kv, ranks)


def test_split_is_balanced_and_keeps_kv_sharing_together(models):
    from rq_core import distributed as dist
    from rq_core.checkpoint import load

    assert dist.split([10, 10, 10, 10], 2) == [(2, 4), (0, 2)]  # rank 0 holds the last layers
    assert dist.split([30, 10, 10, 10], 2) == [(1, 4), (0, 1)]
    assert dist.split([5, 5, 5, 5, 5, 5], 3) == [(4, 6), (2, 4), (0, 2)]
    assert dist.split([10, 10, 10, 10], 2, {2}) == [(1, 4), (0, 1)]  # 10 | 30 (the first of two equal splits)
    model = load(models["gemma4-shared"], tokenizer=False).model
    assert dist.kept_together(model) == {2, 3, 4}
    assert dist.split(dist.layer_bytes(model), 2, dist.kept_together(model)) == [(1, 5), (0, 1)]
    with pytest.raises(Exception, match="at most 2 slices .*KV-sharing"):
        dist.split(dist.layer_bytes(model), 3, dist.kept_together(model))


def test_plan_ranks_prints_the_split_without_reading_weights(models):
    from typer.testing import CliRunner

    from rq_cli.main import app

    r = CliRunner().invoke(app, ["run", str(DEFAULT_MODEL), "-p", "x", "--plan", "--ranks", "2", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["ranks"]
    assert [row["layers"] for row in rows] == [[3, 6], [0, 3]]
    assert rows[0]["layer_bytes"] == rows[1]["layer_bytes"] > 0
    r = CliRunner().invoke(app, ["run", str(models["gemma4-shared"]), "-p", "x", "--plan", "--ranks", "3"])
    assert r.exit_code != 0 and "KV-sharing" in r.output and "Traceback" not in r.output


def _one_line_on_rank0(got: list[tuple[int, str, str]]) -> str:
    assert all(rc != 0 for rc, _, _ in got), [g[0] for g in got]
    lines = [ln for ln in got[0][2].splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), got[0][2]
    for _, o, e in got[1:]:
        assert o == "" and e == ""  # the other ranks stay silent
    return lines[0]


def test_cli_tokens_pager_budget_per_rank_and_silence(tmp_path):
    from rq_core.paging.pack import pack

    pages = tmp_path / "pages"
    pack(DEFAULT_MODEL, out=pages)
    args = [str(DEFAULT_MODEL), "-p", "Once upon a time", "-n", "10", "--kv", "isoquant3", "--json"]
    one = subprocess.run(_rq(*args), capture_output=True, text=True, timeout=LIMIT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    want = json.loads(one.stdout)["tokens"]
    paged = args + ["--memory-budget", "8MB", "--pages", str(pages)]
    alone = subprocess.run(_rq(*paged), capture_output=True, text=True, timeout=LIMIT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert alone.returncode != 0 and "too small" in alone.stderr  # 8 MB cannot hold the whole model
    got = _wait(_spawn(tmp_path, [_rq(*paged)] * 2))
    assert [g[0] for g in got] == [0, 0], got[0][2]
    d = json.loads(got[0][1])
    assert d["tokens"] == want
    assert 2 <= d["pager"]["slots"] < 8 and d["pager"]["evictions"] > 0  # each rank pages its own layers' experts
    assert got[1][1] == "" and got[1][2] == ""


def test_a_rank_that_cannot_hold_its_slice(tmp_path):
    from rq_core.paging.pack import pack

    pages = tmp_path / "pages"
    pack(DEFAULT_MODEL, out=pages)
    base = [str(DEFAULT_MODEL), "-p", "hi", "-n", "2", "--pages", str(pages)]
    got = _wait(_spawn(tmp_path, [_rq(*base, "--memory-budget", "1GB"), _rq(*base, "--memory-budget", "10KB")]))
    line = _one_line_on_rank0(got)
    assert "rank 1: --memory-budget 10KB is too small" in line


def test_the_fingerprint_covers_the_rq_and_mlx_versions(monkeypatch):
    """Ranks on other installs are refused like other checkpoints: the versions are part of what they compare."""
    import mlx.core as mx

    import rq_core
    from rq_core import distributed as dist
    from rq_core.checkpoint import load

    ck = load(None, tokenizer=False)
    base = dist.fingerprint(ck, "same flags")
    assert dist.fingerprint(ck, "same flags") == base
    monkeypatch.setattr(rq_core, "__version__", rq_core.__version__ + ".dev1")
    assert dist.fingerprint(ck, "same flags") != base
    monkeypatch.undo()
    monkeypatch.setattr(mx, "__version__", "0.0.0")
    assert dist.fingerprint(ck, "same flags") != base


def test_mismatched_checkpoints_are_refused(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(DEFAULT_MODEL, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    got = _wait(_spawn(tmp_path, [_rq(str(DEFAULT_MODEL), "-p", "hi", "-n", "2"),
                                  _rq(str(other), "-p", "hi", "-n", "2")]))
    assert "rank 1 has another checkpoint" in _one_line_on_rank0(got)
    got = _wait(_spawn(tmp_path, [_rq(str(DEFAULT_MODEL), "-p", "hi", "-n", "2"),
                                  _rq(str(tmp_path / "missing"), "-p", "hi", "-n", "2")]))
    assert "rank 1: " in _one_line_on_rank0(got)


def _until_tokens(p: subprocess.Popen, limit: float = 30) -> None:
    """Wait until rank 0 streamed some text (generation is under way)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if p.stdout.read(1):
            return
        assert p.poll() is None, p.stderr.read()
    raise AssertionError("no tokens")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_peer_that_disappears_mid_run(tmp_path, how):
    argv = _rq(str(DEFAULT_MODEL), "-p", "Once upon a time", "-n", "2000", "--kv", "fp16")
    procs = _spawn(tmp_path, [argv] * 2, env={"RQ_PEER_TIMEOUT": "3"})
    try:
        _until_tokens(procs[0])
        t0 = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        rc0 = procs[0].wait(timeout=20)
        err = procs[0].stderr.read()
        assert time.monotonic() - t0 < 15
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert rc0 != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert ("a peer stopped" if how == "kill" else "no progress from the other ranks for 3 s") in lines[0]
    assert procs[1].returncode != 0
