"""benchmarks/diag/v5_trace.py's reading of attn_v5's phase stamps (device ns timer, SM cycles), on synthetic
stamps: phase ends since the first block's start, a phase's own length in SM cycles, the timer's low word
wrapping, and a phase a variant does not stamp counting in the next one."""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "diag"))
sys.path.insert(0, str(ROOT))


def _stamps(skip: int | None = None) -> np.ndarray:
    ghz = 1.8
    tr = np.zeros((2, 3, 16, 2), np.uint32)
    for g in range(2):
        for s in range(3):
            t0 = (2**32 - 5_000 + 100 * (3 * g + s)) % 2**32  # the ns timer wraps inside the launch
            c0 = 7_000 * (g + 1) + s
            last = s == 2
            for k in range(12 if last else 8):
                if k == skip:
                    continue
                t = t0 + 1_000 * k + (3_000 if k >= 4 else 0)  # phase 4 (the loop) takes 4 us, the others 1
                tr[g, s, k, 0] = t % 2**32
                tr[g, s, k, 1] = (c0 + round((t - t0) * ghz)) % 2**32
            tr[g, s, 15, 0] = 3 * g + s
    return tr


def test_phases_from_stamps():
    import v5_trace as V

    import rq_core.kernels as K

    r = V.summarize(_stamps(), K.V5_TRACE_PHASES)
    assert r["blocks"] == 6 and r["sms"] == 6 and abs(r["clock_ghz"] - 1.8) < 1e-3
    ph = {p["phase"]: p for p in r["phases"]}
    assert [p["phase"] for p in r["phases"]] == [K.V5_TRACE_PHASES[k] for k in range(1, 12)]
    assert abs(ph["warp 0 loop end"]["own_median_us"] - 4.0) < 1e-3
    assert abs(ph["q rotated"]["own_median_us"] - 1.0) < 1e-3
    # the first block starts at 0; the last one 500 ns later; its last stamp 11 + 3 us after its start
    assert ph["table+q loaded"]["end_median_us"] == 1.25 and ph["table+q loaded"]["end_max_us"] == 1.5
    assert abs(r["span_us"] - 14.5) < 1e-6 and r["start_spread_us"] == 0.5


def test_unstamped_phase_counts_in_the_next():
    import v5_trace as V

    import rq_core.kernels as K

    r = V.summarize(_stamps(skip=1), K.V5_TRACE_PHASES)
    ph = {p["phase"]: p for p in r["phases"]}
    assert "table+q loaded" not in ph
    assert abs(ph["q rotated"]["own_median_us"] - 2.0) < 1e-3


def test_weights_stamps_in_launch_order():
    """Stamps 12 and 13 (inside the last block's weights phase) read between "counted" (7) and the weights (8)."""
    import v5_trace as V

    import rq_core.kernels as K

    tr = _stamps()
    for g in range(2):  # the last block of each group: 12 at 7.25 us of its phases, 13 at 7.5 (cycles likewise)
        for k, frac in ((12, 0.25), (13, 0.5)):
            tr[g, 2, k] = tr[g, 2, 7] + np.array([round(1_000 * frac), round(1_800 * frac)], np.uint32)
    r = V.summarize(tr, K.V5_TRACE_PHASES)
    names = [p["phase"] for p in r["phases"]]
    i = names.index("counted")
    assert names[i + 1:i + 4] == [K.V5_TRACE_PHASES[12], K.V5_TRACE_PHASES[13], "splits' weights"]
    ph = {p["phase"]: p for p in r["phases"]}
    assert abs(ph[K.V5_TRACE_PHASES[12]]["own_median_us"] - 0.25) < 1e-3
    assert abs(ph["splits' weights"]["own_median_us"] - 0.5) < 1e-3


def test_slab_stamp_every_block():
    """Stamp 14 (the warps' slabs merged) is every block's and reads between the loops' end (5) and the partials (6)."""
    import v5_trace as V

    import rq_core.kernels as K

    tr = _stamps()
    for g in range(2):
        for s in range(3):  # every block: 14 at 0.75 of the way from stamp 5 to stamp 6
            tr[g, s, 14] = tr[g, s, 5] + np.array([750, round(1_800 * 0.75)], np.uint32)
    r = V.summarize(tr, K.V5_TRACE_PHASES)
    names = [p["phase"] for p in r["phases"]]
    i = names.index("all warps' loops end")
    assert names[i + 1:i + 3] == [K.V5_TRACE_PHASES[14], "partials written"]
    ph = {p["phase"]: p for p in r["phases"]}
    assert abs(ph[K.V5_TRACE_PHASES[14]]["own_median_us"] - 0.75) < 1e-3
    assert abs(ph["partials written"]["own_median_us"] - 0.25) < 1e-3
    assert ph[K.V5_TRACE_PHASES[14]]["end_max_us"] < ph["partials written"]["end_max_us"]
