"""`rq bench` on the bundled model (CPU): the JSON fields, positive and consistent numbers, refused contexts."""

import json

import pytest
from typer.testing import CliRunner

from rq_cli.common import parse_contexts
from rq_cli.main import app
from rq_core.tools.bench import check_contexts, spread
from rq_core.errors import RQError


@pytest.fixture(scope="module")
def report():
    res = CliRunner().invoke(app, ["bench", "--context", "128,768", "--kv", "fp16,isoquant3", "--tokens", "6",
                                   "--repeats", "2", "--prefill-tokens", "48", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_fields_and_cells(report):
    for k in ("model", "model_type", "backend", "mlx_version", "contexts", "kv_modes", "tokens", "repeats",
              "prefill_tokens", "fill", "max_position_embeddings", "decode", "prefill", "kv_settings"):
        assert k in report, k
    assert report["contexts"] == [128, 768] and report["kv_modes"] == ["fp16", "isoquant3"]
    cells = {(r["context"], r["kv"]) for r in report["decode"]}
    assert cells == {(c, m) for c in (128, 768) for m in ("fp16", "isoquant3")}
    assert [p["kv"] for p in report["prefill"]] == ["fp16", "isoquant3"]


def test_numbers_are_positive_and_consistent(report):
    rows = {(r["context"], r["kv"]): r for r in report["decode"]}
    for r in report["decode"]:
        d = r["decode_tok_per_s"]
        assert 0 < d["min"] <= d["median"] <= d["max"]
        assert len(r["decode_tok_per_s_runs"]) == 2 and min(r["decode_tok_per_s_runs"]) == d["min"]
        assert r["generated_tokens"] == 6  # no EOS stop: every run decodes all its tokens
        assert r["tokens_same_every_run"]  # same fill, greedy: the same tokens
        assert r["peak_memory_bytes"] > r["kv_bytes"] > 0
        # an fp16-equivalent cache of `context` tokens: 2 bytes x (K + V) x heads x head dim x full-attention layers
        assert r["kv_bytes_fp16"] % r["context"] == 0
    for c in (128, 768):
        assert rows[(c, "isoquant3")]["kv_bytes"] < rows[(c, "fp16")]["kv_bytes"]
        assert rows[(c, "isoquant3")]["kv_bytes_fp16"] == rows[(c, "fp16")]["kv_bytes_fp16"]
    for m in ("fp16", "isoquant3"):
        assert rows[(768, m)]["kv_bytes"] > rows[(128, m)]["kv_bytes"]
        assert rows[(768, m)]["kv_bytes_fp16"] == 6 * rows[(128, m)]["kv_bytes_fp16"]
    for p in report["prefill"]:
        s = p["prefill_tok_per_s"]
        assert p["tokens"] == 48 and 0 < s["min"] <= s["median"] <= s["max"] and p["peak_memory_bytes"] > 0


def test_context_beyond_the_model_is_refused_in_one_line():
    res = CliRunner().invoke(app, ["bench", "--context", "2K", "--tokens", "8", "--json"])
    assert res.exit_code != 0
    lines = [l for l in res.output.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and "max_position_embeddings (2048)" in lines[0], res.output
    with pytest.raises(RQError):
        check_contexts([100], 10, 105)
    check_contexts([100], 5, 105)


def test_too_few_tokens_for_a_rate_are_refused_in_one_line():
    """Two tokens are the prompt's and one turn of one: no interval to time (a rate of 0 would be silently wrong)."""
    res = CliRunner().invoke(app, ["bench", "--context", "64", "--tokens", "2", "--json"])
    lines = [l for l in res.output.strip().splitlines() if l.strip()]
    assert res.exit_code != 0 and len(lines) == 1 and "--tokens must be at least 3" in lines[0], res.output


def test_parse_contexts_and_spread():
    assert parse_contexts("2K,32k,131072") == [2048, 32768, 131072]
    with pytest.raises(RQError):
        parse_contexts("2K,abc")
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_decode_vs_mlxlm_at_tiny_scale(tmp_path):
    """benchmarks/decode_vs_mlxlm.py end to end on tiny configs of the three families (mlx-lm installed): one copy of
    the weights, the same logits in float32, every cell measured."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("mlx_lm")
    sys.path.insert(0, str(Path(__file__).parent))
    from _tiny_models import TINY

    root = Path(__file__).resolve().parents[1]
    args = []
    for f in ("qwen3_moe", "gemma4", "nemotron_h"):
        (tmp_path / f"{f}.json").write_text(json.dumps(TINY[f]))
        args += ["--config", str(tmp_path / f"{f}.json")]
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "decode_vs_mlxlm.py"), *args, "--recipe",
                        str(root / "tests" / "data" / "tiny-rtn.toml"), "--contexts", "40,120", "--tokens", "4",
                        "--repeats", "2", "--prefill", "60,300", "--prefill-repeats", "1", "--dir", str(tmp_path / "ck"),
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["models"]) == {"qwen3_moe", "gemma4", "nemotron_h"}
    for m in res["models"].values():
        sw = m["shared_weights"]
        assert sw["same_objects"] == sw["arrays"] > 0 and sw["added_bytes"] < 1 << 20
        # gemma4 in float32 too: measured 2.3e-5 at most (0.0 for the others); 4x that
        assert m["logits_check_float32"]["max_abs_diff"] < 1e-4
        assert m["logits_check_float32"]["top1_agree"] == 1.0
        own = m["stored_dtype_vs_float32"]
        assert set(own) == {"rq", "mlx_lm"} and all(c["top1_agree"] > 0 for c in own.values())
    assert res["models"]["nemotron_h"]["mamba_dt_clamp_aligned"] is True
    assert res["models"]["qwen3_moe"]["mamba_dt_clamp_aligned"] is False
    assert len(res["rows"]) == 3 * 2 * 3
    for row in res["rows"]:
        assert row["decode_tok_per_s"]["min"] > 0 and len(row["decode_tok_per_s_runs"]) == 2
        assert row["generated_tokens"] == 4
        if row["runner"] == "mlx-lm fp16":
            assert row["ratio_to_mlx_lm_fp16"] == 1.0
        if row["runner"] == "rq isoquant3":  # the CPU: the compressed layers' reference path, each counted
            assert row["attention_paths"] and set(row["attention_paths"]) <= {"reference", "sdpa"}
    assert not (tmp_path / "ck" / "qwen3_moe").exists()  # written by the run, removed without --keep
    # prefill: every runner on the same prompt; 300 tokens are past the tiny configs' 256 positions: skipped, said so
    assert len(res["prefill"]) == 3 * 3
    for row in res["prefill"]:
        assert row["prompt_tokens"] == 60 and row["prefill_tok_per_s"]["min"] > 0 and row["peak_memory_bytes"] > 0
        if row["runner"] == "mlx-lm fp16":
            assert row["ratio_to_mlx_lm_fp16"] == 1.0 and row["peak_ratio_to_mlx_lm_fp16"] == 1.0
    assert all(m["prefill_skipped_beyond_max_position_embeddings"] == [300] for m in res["models"].values())
    assert "| qwen3_moe (2 layers) | 60 | " in res["table"] and "Prefill:" in res["table"]


def test_decode_vs_mlxlm_table_of_merged_and_cut_short_runs():
    """The table of a results file merged from several runs: each model's run named, a run cut short marked (by its
    repetitions, or by the float32 check it did not reach), older entries without the newer fields rendered."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from decode_vs_mlxlm import table

    check = {"max_abs_diff": 0.5, "logit_std": 1.0, "top1_agree": 1.0}
    shared = {"same_objects": 3, "arrays": 3, "added_bytes": 0}

    def info(cmd, **kw):
        return {"layers": 2, "repeats": 3, "logits_check": check, "shared_weights": shared,
                "run": {"date": "D", "command": cmd}, **kw}

    infos = {"a": info("run a", logits_check_float32=check, mamba_dt_clamp_aligned=True,
                       stored_dtype_vs_float32={"rq": check, "mlx_lm": check}),
             "b": info("run b", partial=True, repeats_done=2),
             "c": info("run c", partial=True, repeats_done=3)}
    rows = [{"config": k, "context": 64, "runner": "rq fp16", "decode_tok_per_s": {"median": 2, "min": 1, "max": 3},
             "ratio_to_mlx_lm_fp16": None, "peak_memory_bytes": 2**30} for k in infos]
    text = table(rows, infos)
    assert "| a (2 layers) | 64 | 2.0 (1.0-3.0) | - | - | - | - | 1.00, -, - |" in text  # a row per model and context
    assert "| b (2 layers, 2 of 3 repetitions) |" in text
    assert "| c (2 layers, float32 check not reached) |" in text
    assert "(mlx-lm's Mamba dt clamped as rq's: a)" in text and "stored dtype from float32: rq 0.5, mlx-lm 0.5" in text
    assert "b 0.5 / - " in text and "Rows from several runs" in text and "; c D (each model's command" in text
    del infos["a"]["mamba_dt_clamp_aligned"]
    assert "clamped" not in table(rows, infos)
    # prefill rows kept from an earlier run of b (48 layers) under b's cut-short 2-layer run: labelled as theirs
    old_run = {"date": "E", "command": "run b before"}
    pre = [{"config": "b", "layers": 48, "run": old_run, "prompt_tokens": 8192, "runner": "rq fp16",
            "prefill_tok_per_s": {"median": 2, "min": 1, "max": 3}, "ratio_to_mlx_lm_fp16": None,
            "peak_memory_bytes": 2**30}]
    text = table(rows, infos, pre)
    assert "| b (48 layers) | 8192 | 2 (1-3) |" in text and "rows from a run of their own: b E, `run b before`" in text
    assert "| b (2 layers, 2 of 3 repetitions) | 64 |" in text


def test_runners_take_turns():
    """The runners (KV modes in `rq bench`, rq and mlx-lm in benchmarks/decode_vs_mlxlm.py) decode in turns of
    `chunk` tokens, each its own count; a runner's peak leaves out the bytes the other runners' caches hold (a runner
    holding nothing peaks far below one holding 8 MB)."""
    import mlx.core as mx

    from rq_core.tools.bench import decode_in_turns

    seen = []

    def start(name, hold):
        held = mx.zeros((hold,), mx.uint8) if hold else None
        if held is not None:
            mx.eval(held)

        def gen(cache=held):  # holds the runner's bytes as its cache would
            for i in range(10):
                seen.append(name)
                mx.eval(mx.zeros((1 << 12,), mx.float32) + i)  # a step's temporaries: its turn's peak is measured
                yield i
        return gen(), {"kv_bytes": hold, "paths": lambda: {"fused": 1}}

    out = decode_in_turns({"a": lambda: start("a", 8 << 20), "b": lambda: start("b", 0)}, ["a", "b"], 10, 4)
    assert seen == ["a", "b"] + ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4 + ["a"] * 1 + ["b"] * 1
    for r in ("a", "b"):
        assert out[r]["tokens"] == list(range(10)) and out[r]["generated_tokens"] == 10
        assert out[r]["intervals"] == 3 + 3 + 0 and out[r]["paths"] == {"fused": 1}
    assert out["a"]["peak_memory_bytes"] - out["b"]["peak_memory_bytes"] > 6 << 20
