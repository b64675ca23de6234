"""`rq soak`: statistics, report schema and atomic writes, a short real soak, leak detection, Ctrl-C."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rq_cli.main import app
from rq_core.tools import soak as soak_mod
from rq_core.tools.soak import (LEAK_ENV, MB, Thresholds, coefficient_of_variation, linear_fit, summarize, theil_sen,
                          validate_report, write_json_atomic)

GOLDEN = Path(__file__).parent / "golden" / "qwen3_moe" / "model"
needs_golden = pytest.mark.skipif(not (GOLDEN / "config.json").is_file(), reason="golden tiny model missing")


def test_fits_and_cv() -> None:
    xs = [0.0, 1.0, 2.0, 3.0, 4.0]
    slope, icpt, r2 = linear_fit(xs, [2 * x + 1 for x in xs])
    assert slope == pytest.approx(2) and icpt == pytest.approx(1) and r2 == pytest.approx(1)
    # One wild point tilts least squares but not Theil-Sen.
    ys = [10.0, 10.0, 10.0, 10.0, 1.0]
    assert linear_fit(xs, ys)[0] < -1
    assert theil_sen(xs, ys)[0] == pytest.approx(0)
    assert coefficient_of_variation([1.0, 1.0, 1.0]) == 0
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        linear_fit([1.0, 1.0], [1.0, 2.0])


def _samples(n: int, *, active_growth: float = 0.0, tok_end: float = 100.0) -> list[dict]:
    out = []
    for i in range(n):
        tps = 100.0 + (tok_end - 100.0) * i / (n - 1)
        out.append({"t_s": float(i * 10), "rss_bytes": 500 * MB, "active_bytes": int(100 * MB + i * active_growth),
                    "cache_bytes": 0, "peak_memory_bytes": 120 * MB, "tokens_total": 100 * i,
                    "generations_total": i, "interval_tokens": 100, "interval_decode_s": 100 / tps,
                    "decode_tok_per_s": tps, "gates": {"finite": {"passed": True}}})
    return out


def test_summary_judges_growth_drift_and_gates() -> None:
    th = Thresholds(max_growth_mb=64, max_growth_frac=0.05, max_throughput_drop=0.3)
    flat = summarize(_samples(10), th)
    assert flat["passed"] and flat["failures"] == []
    assert flat["memory_growth"]["growth_bytes"] == pytest.approx(0)
    leak = summarize(_samples(10, active_growth=20 * MB), th)  # 160 MB over the fitted samples
    assert not leak["passed"] and "grew" in leak["failures"][0]
    assert leak["memory_growth_bytes_per_hour"] == pytest.approx(20 * MB / 10 * 3600)
    slow = summarize(_samples(10, tok_end=50.0), th)
    # thirds of the 9 fitted samples, tokens over decode time: harmonic means of their tok/s
    first = 3 / sum(1 / (100 - 50 * i / 9) for i in (1, 2, 3))
    last = 3 / sum(1 / (100 - 50 * i / 9) for i in (7, 8, 9))
    assert not slow["passed"] and slow["throughput_drift"] == pytest.approx(last / first - 1, rel=1e-9)
    bad = _samples(10)
    bad[5]["gates"]["finite"] = {"passed": False, "detail": "NaN"}
    s = summarize(bad, th)
    assert not s["passed"] and s["gates"]["finite"]["failures"] == 1
    # A run whose time went to its first checks (a slow machine): no generation, so no verdict to pass
    idle = summarize(_samples(2)[:1], th)
    assert idle["tokens_generated"] == 0 and not idle["passed"] and "no token was generated" in idle["failures"][0]


def test_atomic_write_and_validation(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "r.json"
    write_json_atomic(p, {"a": 1})
    write_json_atomic(p, {"a": 2})
    assert json.loads(p.read_text()) == {"a": 2}
    assert [f.name for f in p.parent.iterdir()] == ["r.json"]  # no temp files left behind
    assert validate_report({"schema": "nope"})  # many problems
    assert validate_report([]) == ["the report is not a JSON object"]


def _run(tmp_path: Path, *extra: str, env: dict | None = None):
    rep = tmp_path / "soak.json"
    args = ["soak", str(GOLDEN), "--seconds", "7", "--interval", "1", "--max-tokens", "12",
            "--max-throughput-drop", "0.95", "--report", str(rep), "--json", *extra]
    result = CliRunner().invoke(app, args, env=env or {})
    return result, rep


@needs_golden
def test_short_soak_passes_and_report_validates(tmp_path: Path) -> None:
    result, rep = _run(tmp_path)
    assert result.exit_code == 0, result.output
    report = json.loads(rep.read_text())
    assert validate_report(report) == []
    assert report["status"] == "completed" and report["passed"] is True
    assert report["summary"]["samples"] >= 4 and report["summary"]["tokens_generated"] > 0
    assert report["kv_mode"] == "isoquant3" and report["kv"]["fp16_window"] == 32  # the cache `rq run` makes
    last = report["samples"][-1]
    assert last["decode_tok_per_s"] > 0 and last["rss_bytes"] > 0 and last["active_bytes"] > 0
    assert set(report["summary"]["gates"]) == {"finite", "kv_bytes_ratio", "deterministic",
                                               "no_degenerate_repetition"}
    assert 0 <= report["samples"][0]["probe_greedy_agreement"] <= 1
    assert report["elapsed_s"] < 7 + 3  # the time limit holds even mid-generation
    assert json.loads(result.stdout)["passed"] is True


@needs_golden
def test_a_run_shorter_than_its_first_checks_still_decodes(tmp_path: Path) -> None:
    """Time up before the first generation (its first checks took longer than the run: a slow machine): the run
    still decodes to its first token, so there is something to judge."""
    result, rep = _run(tmp_path, "--seconds", "0.01")
    report = json.loads(rep.read_text())
    assert validate_report(report) == []
    assert report["summary"]["tokens_generated"] >= 2, report["summary"]  # the prefill's token and a decoded one
    assert not any("no token" in f for f in report["summary"]["failures"])
    assert result.exit_code == (0 if report["passed"] else 1)


@needs_golden
def test_injected_leak_fails_on_growth(tmp_path: Path) -> None:
    result, rep = _run(tmp_path, env={LEAK_ENV: "40"})
    assert result.exit_code == 1, result.output
    report = json.loads(rep.read_text())
    assert validate_report(report) == []
    assert report["passed"] is False
    assert report["summary"]["memory_growth"]["passed"] is False
    assert any("grew" in f for f in report["summary"]["failures"])
    assert report["samples"][-1]["test_leak_bytes"] >= 3 * 40 * MB
    # the compressed mode's checks all ran (kv_bytes_ratio only exists for compressed caches)
    assert set(report["summary"]["gates"]) == {"finite", "kv_bytes_ratio", "deterministic",
                                               "no_degenerate_repetition"}


@needs_golden
def test_ctrl_c_leaves_a_valid_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    orig = soak_mod.Soak._one_generation

    def interrupted(self, i, acc):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return orig(self, i, acc)

    monkeypatch.setattr(soak_mod.Soak, "_one_generation", interrupted)
    rep = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["soak", str(GOLDEN), "--minutes", "10", "--interval", "0.2",
                                      "--max-tokens", "8", "--report", str(rep)])
    report = json.loads(rep.read_text())
    assert validate_report(report) == []
    assert report["status"] == "interrupted"
    assert result.exit_code == (0 if report["passed"] else 1)


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["soak", str(GOLDEN), "--report", str(tmp_path / "r.json")])
    assert r.exit_code == 2 and "exactly one of --hours or --minutes" in r.output
    r = CliRunner().invoke(app, ["soak", str(GOLDEN), "--hours", "1", "--minutes", "2", "--report", "x.json"])
    assert r.exit_code == 2
    r = CliRunner().invoke(app, ["soak", str(GOLDEN), "--minutes", "1", "--kv", "int9", "--report", "x.json"])
    assert r.exit_code == 2 and "unknown --kv 'int9'" in r.output
    assert "Traceback" not in r.output


GOLDEN_Q2 = Path(__file__).parent / "golden" / "qwen2_moe" / "model"


@pytest.mark.skipif(not (GOLDEN_Q2 / "config.json").is_file(), reason="golden tiny model missing")
def test_soak_with_pager_reports_its_stats(tmp_path: Path) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(GOLDEN_Q2, ck)
    assert CliRunner().invoke(app, ["pack", str(ck)]).exit_code == 0
    rep = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["soak", str(ck), "--seconds", "3", "--interval", "1", "--max-tokens", "8",
                                 "--max-throughput-drop", "0.95", "--memory-budget", "4MB", "--report", str(rep)])
    assert r.exit_code in (0, 1), r.output
    report = json.loads(rep.read_text())
    assert validate_report(report) == [], r.output
    p = report["samples"][-1]["pager"]
    assert report["pager"] == "lru" and p["hits"] + p["misses"] > 0 and p["bytes_read"] > 0
