"""benchmarks/paper_table.py --tiny end to end on the CPU (a 2-layer Qwen3-30B-A3B slice, written packed, run through
`rq run` in a subprocess under a budget that pages experts): the results file's fields."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_table_end_to_end(tmp_path):
    out = tmp_path / "paper_table.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paper_table.py"), "--tiny", "--models", "qwen3_moe",
                        "--contexts", "16", "--kv", "isoquant3", "--tokens", "2", "--no-min-budget", "--timeout", "300",
                        "--dir", str(tmp_path / "d"), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert {"date", "machine", "mlx", "command", "routing", "tokens", "tiny", "contexts", "kv", "models",
            "table"} <= set(d)
    (m,) = d["models"]
    assert "error" not in m, m.get("error")
    assert m["checkpoint"]["disk_bytes"] > 0 and (tmp_path / "d").is_dir()
    (c,) = m["cells"]
    assert "error" not in c["run"], c["run"]["error"]
    assert c["kv"] == "isoquant3" and c["run"]["kv_mode"] == "isoquant3"
    run, plan = c["run"], c["plan"]
    assert run["prompt_tokens"] == c["prompt_file_tokens"] and 8 <= run["prompt_tokens"] <= 16
    assert run["generated_tokens"] >= 1 and run["steady_decode_tok_per_s"] > 0 and run["prefill_s"] > 0
    assert 0 < run["peak_memory_bytes"] and run["peak_rss_bytes"] > 0 and run["child_peak_rss_bytes"] > 0
    assert run["kv_bytes"] > 0
    assert plan["fits"] and plan["slots_per_layer"] < plan["experts_per_layer"]  # the budget pages experts
    assert run["pager"]["misses"] > 0 and run["pager"]["hit_rate"] is not None
    assert 0.5 < c["measured_over_planned"] < 1.5
    assert "| qwen3-30b-a3b |" in d["table"]
