"""benchmarks/kernel_time.py's reading of an ncu CSV: kernels between a phase's start and end markers."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _row(i, name, metric, unit, value):
    return (f'"{i}","1","python3","h","{name}","1","7","(128, 1, 1)","(4, 33, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def test_parse_phases(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_time as KT

    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    t = "gpu__time_duration.sum"
    rows = ["==PROF== Connected", head,
            _row(0, "mlx::custom_kernel_rq_attn_v5_x(float*)", t, "usecond", "300"),  # warm-up: outside
            _row(1, "mlx::custom_kernel_rq_marker_1(const float *, float *)", t, "nsecond", "3,000"),
            _row(2, "mlx::custom_kernel_rq_attn_v5_x(float*)", t, "usecond", "20"),
            _row(2, "mlx::custom_kernel_rq_attn_v5_x(float*)", "dram__bytes_read.sum", "Mbyte", "52.5"),
            _row(3, "mlx::custom_kernel_rq_attn_v5_x(float*)", t, "nsecond", "22,000"),
            _row(4, f"mlx::custom_kernel_rq_marker_{KT.END + 1}(const float *, float *)", t, "nsecond", "3,000"),
            _row(5, "mlx::custom_kernel_rq_attn_v4_x(float*)", t, "usecond", "500"),  # next warm-up: outside
            "==PROF== Disconnected"]
    (tmp_path / "n.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "s.json").write_text('[{"phase": 1, "context": 131072, "method": "v5", "reps": 2, "bytes": 52428800}]')

    class A:
        parse = str(tmp_path / "n.csv")
        schedule = str(tmp_path / "s.json")
        copy_tbps = 4.0
        json = str(tmp_path / "o.json")

    KT.parse(A)
    import json

    (r,) = json.loads((tmp_path / "o.json").read_text())
    assert r["gpu_us"] == 21.0 and r["kernels_per_rep"] == 1.0 and abs(r["dram_read_MB"] - 26.25) < 1e-9
    assert "| 128K | v5 | 21.0 |" in capsys.readouterr().out
