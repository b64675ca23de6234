"""benchmarks/quality.py --combine, run as a script: one table from earlier results of the same sample, each row as
measured."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "quality.py"


def _row(kv: str, ppl: float, measured: str) -> dict:
    gates = [{"name": n, "value": v, "passed": True} for n, v in
             (("mean_kl", 0.01), ("top1_agreement", 0.9), ("kv_bytes_ratio", 0.2))]
    return {"kv": kv, "measured": measured, "passed": 3, "total": 3, "gates": gates,
            "details": {"ppl": ppl, "ppl_fp16": 10.0, "ppl_full": ppl, "ppl_full_fp16": 10.0, "context": 64,
                        "tokens": 32, "full_context": 128, "needle_trials": 2, "needle_accuracy": 1.0,
                        "needle_accuracy_fp16": 1.0}}


def _file(tmp_path: Path, name: str, rows: list, settings: dict | None = None, ppl: float = 9.0) -> str:
    d = {"date": f"{name} date", "machine": f"{name} machine", "mlx": "0", "model": "m", "device": "cpu",
         "settings": settings or {"windows": 2}, "thresholds": {},
         "heldout": {"ppl": ppl, "unigram_ppl": 99.0, "tokens": 10, "context": 64}, "modes": rows}
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(d))
    return str(p)


def _combine(out: Path, *specs: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--combine", *specs, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_combine_keeps_rows_as_measured_and_later_ones_replace(tmp_path):
    a = _file(tmp_path, "a", [_row("fp16", 10.0, "t0"), _row("turbo3", 11.0, "t1"), _row("isoquant3", 12.0, "t1")])
    b = _file(tmp_path, "b", [_row("isoquant3", 10.5, "t2"), _row("turbo3+w32", 10.2, "t2")])
    r = _combine(tmp_path / "c.json", f"{a}:fp16,turbo3,isoquant3", b)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "c.json").read_text())
    assert [m["kv"] for m in out["modes"]] == ["fp16", "turbo3", "isoquant3", "turbo3+w32"]
    assert {m["kv"]: m["measured"] for m in out["modes"]}["isoquant3"] == "t2"  # b's row replaced a's
    assert out["machine"] == "a machine" and "--combine" in out["command"]  # where the rows ran; how it was made
    assert "Rows measured t0 to t2" in r.stdout and "| isoquant3 | 10.500 | +5.000%" in r.stdout
    assert out["table"] == r.stdout.rstrip()
    r = _combine(tmp_path / "d.json", f"{a}:fp16", b)
    assert r.returncode == 0, r.stderr
    assert [m["kv"] for m in json.loads((tmp_path / "d.json").read_text())["modes"]] == ["fp16", "isoquant3",
                                                                                         "turbo3+w32"]


def test_combine_refuses_other_samples_and_missing_rows(tmp_path):
    a = _file(tmp_path, "a", [_row("fp16", 10.0, "t0")])
    for bad, msg in ((_file(tmp_path, "b", [_row("x", 1.0, "t")], settings={"windows": 4}), "other settings"),
                     (_file(tmp_path, "e", [_row("x", 1.0, "t")], ppl=9.5), "other settings"),
                     (f"{a}:turbo3", "no rows")):
        r = _combine(tmp_path / "c.json", *([bad] if bad.endswith(":turbo3") else [a, bad]))
        assert r.returncode != 0 and msg in r.stderr
        assert not (tmp_path / "c.json").exists()
