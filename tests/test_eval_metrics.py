"""rq_core.tools.eval's metrics against independent float64 numpy computations on constructed distributions.

The models here are stubs whose logits are fixed tables, so every expected number (KL(fp16 ‖ mode) and its
direction, perplexity, top-1 agreement, p99 KL, needle accuracy, McNemar's p, repeated 4-grams, each gate's
verdict) is computed in the test from the tables alone, without rq_core.tools.eval's arithmetic.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest

from rq_core.tools import eval as ev
from rq_core.cache.kv_cache import KVSettings

# Float32 (mlx) against float64 (numpy) on these tables: `PYTHONPATH=. python3 tests/test_eval_metrics.py` prints
# the relative error of each value checked with REL; the largest measured was 8.8e-7 (rel_delta_ppl), at most
# 2.9e-7 for the rest. REL is 11x that, and far below the gaps the direction and formula checks require (> 10%).
REL = 1e-5

V = 256          # vocabulary of the table model (every window token is distinct, so a token names its position)
CONTEXT = 64     # windows of 65 tokens: 32 prefilled, 32 decode-scored
WINDOWS = 3


# ---------------------------------------------------------------------------------------- stubs
class _Cache:
    def __init__(self, mode: str):
        self.mode = mode

    def end_prefill(self) -> None:
        pass


class TableModel:
    """Logits after reading token i are tables[kv.mode][i] (the same for any position)."""

    def __init__(self, tables: dict[str, np.ndarray]):
        self.tables = tables

    def make_cache(self, kv: KVSettings) -> list[_Cache]:
        return [_Cache(kv.mode)]

    def __call__(self, x: mx.array, cache: list[_Cache]) -> mx.array:
        return mx.array(self.tables[cache[0].mode][np.array(x)].astype(np.float32))


def _softmax64(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _percentile_by_hand(x: np.ndarray, q: float) -> float:
    """Linear interpolation between order statistics at rank q/100 * (n - 1) (numpy's default method)."""
    s = sorted(float(v) for v in x)
    r = q / 100 * (len(s) - 1)
    lo = int(math.floor(r))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (r - lo) * (s[hi] - s[lo])


def make_tables():
    """fp16 logits: random, peaked enough that argmax is unambiguous. turbo3 logits: fp16's, with (a) the
    fp16 argmax pushed to -6 and a new argmax on every 4th token id (top-1 disagrees there), (b) tokens
    where fp16 has mass given almost none (KL(p‖q) large, KL(q‖p) small: the direction shows), (c) a few
    rows with a large error so p99 differs from the mean and the max."""
    rng = np.random.default_rng(7)
    f = rng.normal(0, 2.0, size=(V, V))
    q = f + rng.normal(0, 0.3, size=(V, V))
    top = f.argmax(axis=1)
    for i in range(V):
        # (b) q starves the 3 tokens p likes second to fourth best
        order = np.argsort(f[i])[::-1]
        q[i, order[1:4]] -= 6.0
        if i % 4 == 0:  # (a)
            q[i, top[i]] = f[i].min() - 6.0
            q[i, order[5]] = f[i].max() + 3.0
    for i in (11, 77, 150):  # (c)
        q[i] = rng.normal(0, 2.0, size=V)
    ids = rng.permutation(V)[: WINDOWS * CONTEXT + 1].astype(np.int32)
    return {"fp16": f, "turbo3": q}, ids


@pytest.fixture(scope="module")
def tables():
    return make_tables()


def _scored(ids: np.ndarray):
    """(input token, target) pairs of the decode-scored positions, window by window."""
    pre = CONTEXT // 2
    inp, tgt = [], []
    for w in range(WINDOWS):
        win = ids[w * CONTEXT : w * CONTEXT + CONTEXT + 1]
        inp += list(win[pre:-1])
        tgt += list(win[pre + 1 :])
    return np.array(inp), np.array(tgt)


# ------------------------------------------------------------------------------ KL, ppl, top-1
def test_kl_is_fp16_to_mode_and_matches_numpy(tables):
    t, ids = tables
    inp, _ = _scored(ids)
    p, q = _softmax64(t["fp16"][inp]), _softmax64(t["turbo3"][inp])
    kl_pq = (p * (np.log(p) - np.log(q))).sum(axis=1)
    kl_qp = (q * (np.log(q) - np.log(p))).sum(axis=1)
    # the construction makes the two directions far apart, so a swapped direction cannot pass
    assert abs(kl_pq.mean() - kl_qp.mean()) > 0.5 * kl_pq.mean()
    c, _ = ev.compare(TableModel(t), ids, KVSettings(mode="turbo3"), context=CONTEXT, max_windows=WINDOWS)
    assert c.tokens == len(inp) == WINDOWS * CONTEXT // 2
    assert c.mean_kl == pytest.approx(kl_pq.mean(), rel=REL)
    assert c.p99_kl == pytest.approx(_percentile_by_hand(kl_pq, 99), rel=REL)
    # p99 is its own number here: 2% below the max, over 4x the mean (a max or mean in its place fails)
    assert kl_pq.max() > 1.02 * c.p99_kl and c.p99_kl > 4 * c.mean_kl
    assert c.finite


def test_top1_agreement_counts_tokens(tables):
    t, ids = tables
    inp, _ = _scored(ids)
    agree = t["fp16"][inp].argmax(axis=1) == t["turbo3"][inp].argmax(axis=1)
    expected = Fraction(int(agree.sum()), len(inp))
    assert 0.5 < expected < 0.9  # the construction: every 4th token id disagrees, and the rows of (c)
    c, _ = ev.compare(TableModel(t), ids, KVSettings(mode="turbo3"), context=CONTEXT, max_windows=WINDOWS)
    assert c.top1_agreement == float(expected)


def test_perplexity_is_exp_of_mean_nll(tables):
    t, ids = tables
    inp, tgt = _scored(ids)
    for mode in ("fp16", "turbo3"):
        lp = np.log(_softmax64(t[mode][inp]))[np.arange(len(inp)), tgt]
        nll = -lp.mean()
        r = ev.perplexity(TableModel(t), ids, KVSettings(mode=mode), context=CONTEXT, max_windows=WINDOWS)
        assert r.tokens == len(tgt) and r.windows == WINDOWS
        assert r.nll == pytest.approx(nll, rel=REL)
        assert r.ppl == pytest.approx(np.exp(nll), rel=REL)
        # the wrong formulas are far from it on these tables
        assert abs(2**nll - np.exp(nll)) > 0.1 * np.exp(nll)
        assert abs(1 / np.exp(lp).mean() - np.exp(nll)) > 0.1 * np.exp(nll)


def test_comparison_ppl_and_delta(tables):
    t, ids = tables
    inp, tgt = _scored(ids)
    nll = {m: -np.log(_softmax64(t[m][inp]))[np.arange(len(inp)), tgt].mean() for m in t}
    c, _ = ev.compare(TableModel(t), ids, KVSettings(mode="turbo3"), context=CONTEXT, max_windows=WINDOWS)
    assert c.nll_ref == pytest.approx(nll["fp16"], rel=REL) and c.nll == pytest.approx(nll["turbo3"], rel=REL)
    assert c.ppl_ref == pytest.approx(np.exp(nll["fp16"]), rel=REL)
    assert c.ppl == pytest.approx(np.exp(nll["turbo3"]), rel=REL)
    expected = np.exp(nll["turbo3"]) / np.exp(nll["fp16"]) - 1
    assert abs(expected) > 0.05
    assert c.rel_delta_ppl == pytest.approx(expected, rel=REL)


def test_non_finite_logits_are_reported(tables):
    t, ids = tables
    inp, _ = _scored(ids)
    bad = dict(t)
    bad["turbo3"] = t["turbo3"].copy()
    bad["turbo3"][inp[5], 3] = np.nan
    c, _ = ev.compare(TableModel(bad), ids, KVSettings(mode="turbo3"), context=CONTEXT, max_windows=WINDOWS)
    assert c.finite is False
    good, _ = ev.compare(TableModel(t), ids, KVSettings(mode="turbo3"), context=CONTEXT, max_windows=WINDOWS)
    assert good.finite is True


# ---------------------------------------------------------------------------------------- needle
class _Tok:  # digits are single tokens 10..19; other characters 100 + ord % 50
    def encode(self, s, add_special_tokens=False):
        return [10 + int(c) if c.isdigit() else 100 + ord(c) % 50 for c in s]


class _History(_Cache):
    def __init__(self, mode: str):
        super().__init__(mode)
        self.tokens: list[int] = []


class NeedleModel:
    """Reads the needle's digits from everything fed so far and answers them, except where `misses[mode]`
    says the needle (its digits as a tuple) is missed: then the first answer digit is wrong."""

    def __init__(self, pieces: dict, misses: dict):
        self.pieces, self.misses = pieces, misses

    def make_cache(self, kv: KVSettings) -> list[_History]:
        return [_History(kv.mode)]

    def _find(self, seq: list[int], sub: np.ndarray) -> int:
        sub = list(sub)
        return max(i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub)

    def __call__(self, x: mx.array, cache: list[_History]) -> mx.array:
        h = cache[0]
        h.tokens += np.array(x)[0].tolist()
        out = np.zeros((1, x.shape[1], 160), np.float32)
        pre = self.pieces["needle_prefix"]
        try:
            at = self._find(h.tokens, pre) + len(pre)
            q_end = self._find(h.tokens, self.pieces["question"]) + len(self.pieces["question"])
        except ValueError:  # haystack still arriving
            return mx.array(out)
        answer = tuple(h.tokens[at : at + 5])
        k = len(h.tokens) - q_end  # answer digits emitted so far
        tok = answer[k] if k < 5 else 0
        if k == 0 and self.misses[h.mode](answer):
            tok = 10 + (tok - 10 + 1) % 10
        out[0, -1, tok] = 1.0
        return mx.array(out)


def _binomial_two_sided(b: int, c: int) -> float:
    """Exact two-sided binomial test (p = 1/2) of b successes in b + c, by summing the probabilities of every
    outcome no more likely than the observed one (pmf from Pascal's rule, exact fractions)."""
    n = b + c
    row = [Fraction(1)]
    for _ in range(n):
        row = [a + z for a, z in zip([Fraction(0)] + row, row + [Fraction(0)])]
    pmf = [r / 2**n for r in row]
    return float(min(Fraction(1), sum(x for x in pmf if x <= pmf[b])))


@pytest.mark.parametrize("b,c", [(0, 0), (0, 1), (0, 5), (1, 9), (9, 1), (3, 3), (2, 7), (4, 11), (12, 0), (6, 8)])
def test_mcnemar_matches_exact_binomial(b, c):
    assert ev.mcnemar_p(b, c) == pytest.approx(_binomial_two_sided(b, c), rel=1e-12, abs=0)


def test_mcnemar_hand_values():
    assert ev.mcnemar_p(0, 5) == 2 / 32          # 2 * (1/2)^5
    assert ev.mcnemar_p(1, 9) == 2 * 11 / 1024   # 2 * (C(10,0) + C(10,1)) / 2^10
    assert ev.mcnemar_p(3, 3) == 1.0 and ev.mcnemar_p(0, 0) == 1.0


def test_niah_accuracy_paired_counts_and_p():
    pieces = ev.needle_token_pieces(_Tok())
    rng = np.random.default_rng(3)
    ids = rng.integers(20, 100, size=4000).astype(np.int32)  # no digit or needle-text tokens in the haystack
    # fp16 misses needles whose digit sum is divisible by 3, turbo3 those with an even digit sum
    misses = {"fp16": lambda a: sum(t - 10 for t in a) % 3 == 0, "turbo3": lambda a: sum(t - 10 for t in a) % 2 == 0}
    lengths, depths, trials = [120, 200], [0.1, 0.5, 0.9], 5
    res = ev.niah(NeedleModel(pieces, misses), ids, pieces, [KVSettings(mode="fp16"), KVSettings(mode="turbo3")],
                  lengths=lengths, depths=depths, trials=trials, seed=2)
    hits = {m: [] for m in misses}
    for mode, miss in misses.items():
        cells = res["modes"][mode]["cells"]
        assert [(c["length"], c["depth"]) for c in cells] == [(L, d) for L in lengths for d in depths]
        for cell in cells:
            ts = ev.needle_trials(ids, pieces, length=cell["length"], depth=cell["depth"], trials=trials, seed=2)
            expect = [0 if miss(tuple(int(v) for v in t.answer)) else 1 for t in ts]
            assert cell["hits"] == expect
            assert cell["accuracy"] == sum(expect) / trials
            hits[mode] += expect
        per_cell = [sum(hits[mode][i : i + trials]) / trials for i in range(0, len(hits[mode]), trials)]
        assert res["modes"][mode]["accuracy"] == pytest.approx(np.mean(per_cell), abs=1e-12)
    r, g = np.array(hits["fp16"]), np.array(hits["turbo3"])
    assert len(r) == len(lengths) * len(depths) * trials
    lost, gained = int(((r == 1) & (g == 0)).sum()), int(((r == 0) & (g == 1)).sum())
    assert lost > 0 and gained > 0 and lost != gained  # the rules make both kinds of discordant needle
    pr = res["modes"]["turbo3"]["paired"]
    assert (pr["lost"], pr["gained"]) == (lost, gained)
    assert pr["mcnemar_p"] == pytest.approx(_binomial_two_sided(lost, gained), rel=1e-12)
    assert 0 < res["modes"]["turbo3"]["accuracy"] < res["modes"]["fp16"]["accuracy"] < 1


# ------------------------------------------------------------------------------------ repetition
@pytest.mark.parametrize("tokens,expected", [
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], Fraction(5, 9)),  # 9 4-grams, 4 distinct
    ([5] * 10, Fraction(6, 7)),                              # 7 4-grams, 1 distinct
    (list(range(10)), Fraction(0)),                          # all distinct
    ([1, 2, 3, 4, 9, 1, 2, 3, 4], Fraction(1, 6)),           # 6 4-grams, (1,2,3,4) twice
    ([1, 2, 3], Fraction(0)),                                # no 4-gram
])
def test_repeat_fraction_by_hand(tokens, expected):
    assert ev._repeat_fraction(tokens) == pytest.approx(float(expected), abs=1e-12)


# ------------------------------------------------------------------------------------------ gates
TH = ev.load_gates()["gates"]


def _passing() -> dict:
    """Measured values that pass every bundled threshold, each a clear margin inside it."""
    return {"ppl_rel_delta": TH["ppl_rel_delta"] / 2, "ppl_rel_delta_full": TH["ppl_rel_delta_full"] / 2,
            "mean_kl": TH["mean_kl"] / 2, "p99_kl": TH["p99_kl"] / 2,
            "top1_agreement": (1 + TH["top1_agreement"]) / 2, "greedy_agreement": (1 + TH["greedy_agreement"]) / 2,
            "needle_accuracy": 0.75, "needle_accuracy_fp16": 0.75, "finite": True,
            "repeat": 0.2, "repeat_fp16": 0.2, "eos_honoured": True, "deterministic": True,
            "kv_bytes_ratio": TH["kv_bytes_ratio"] / 2}


def _verdicts(**changes) -> dict:
    v = _passing()
    v.update(changes)
    gates = ev.gate_verdicts(v, TH)
    assert [g["name"] for g in gates] == list(ev.GATES)
    return {g["name"]: g["passed"] for g in gates}


def test_gates_all_pass_on_passing_values():
    assert all(_verdicts().values())


# gate, values at the threshold (pass), values just past it (fail); only that gate may change
EPS = 1e-6
_UPPER = ["ppl_rel_delta", "ppl_rel_delta_full", "mean_kl", "p99_kl", "kv_bytes_ratio"]
_LOWER = ["top1_agreement", "greedy_agreement"]
GATE_CASES = (
    [(g, {g: TH[g]}, {g: TH[g] + EPS}) for g in _UPPER]
    + [(g, {g: TH[g]}, {g: TH[g] - EPS}) for g in _LOWER]
    + [("needle_retention", {"needle_accuracy": 0.75 - TH["needle_retention"]},
        {"needle_accuracy": 0.75 - TH["needle_retention"] - 0.25}),
       ("needle_retention", {"needle_accuracy": 1.0}, {"needle_accuracy": 0.0}),
       ("no_degenerate_repetition", {"repeat": 0.2 + TH["no_degenerate_repetition"] - EPS},
        {"repeat": 0.2 + TH["no_degenerate_repetition"] + EPS}),
       ("no_degenerate_repetition", {"repeat": 0.0}, {"repeat": 0.9}),
       ("finite", {"finite": True}, {"finite": False}),
       ("eos_honoured", {"eos_honoured": True}, {"eos_honoured": False}),
       ("deterministic", {"deterministic": True}, {"deterministic": False})])


@pytest.mark.parametrize("gate,ok,bad", GATE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(GATE_CASES)])
def test_gate_passes_at_threshold_and_fails_past_it(gate, ok, bad):
    good = _verdicts(**ok)
    assert all(good.values()), {k: x for k, x in good.items() if not x}
    failed = _verdicts(**bad)
    assert [k for k, x in failed.items() if not x] == [gate]


def test_gate_values_and_rules():
    v = _passing()
    v.update(needle_accuracy=0.5, needle_accuracy_fp16=0.75, repeat=0.35, repeat_fp16=0.2, finite=False)
    g = {x["name"]: x for x in ev.gate_verdicts(v, TH)}
    assert g["needle_retention"]["value"] == -0.25 and not g["needle_retention"]["passed"]
    assert g["no_degenerate_repetition"]["value"] == pytest.approx(0.15, abs=1e-15)
    assert g["finite"]["value"] == 0.0 and g["deterministic"]["value"] == 1.0
    assert g["mean_kl"]["value"] == v["mean_kl"] and g["mean_kl"]["threshold"] == f"<= {TH['mean_kl']}"
    assert g["top1_agreement"]["threshold"] == f">= {TH['top1_agreement']}"


def _measured_errors() -> dict:
    """Relative error of each value checked with REL against its float64 computation."""
    t, ids = make_tables()
    inp, tgt = _scored(ids)
    p, q = _softmax64(t["fp16"][inp]), _softmax64(t["turbo3"][inp])
    kl = (p * (np.log(p) - np.log(q))).sum(axis=1)
    c, _ = ev.compare(TableModel(t), ids, KVSettings(mode="turbo3"), context=CONTEXT, max_windows=WINDOWS)
    nll = {m: -np.log(_softmax64(t[m][inp]))[np.arange(len(inp)), tgt].mean() for m in t}
    e = {"mean_kl": c.mean_kl / kl.mean() - 1, "p99_kl": c.p99_kl / _percentile_by_hand(kl, 99) - 1,
         "nll_ref": c.nll_ref / nll["fp16"] - 1, "nll": c.nll / nll["turbo3"] - 1,
         "ppl": c.ppl / np.exp(nll["turbo3"]) - 1, "ppl_ref": c.ppl_ref / np.exp(nll["fp16"]) - 1,
         "rel_delta_ppl": c.rel_delta_ppl / (np.exp(nll["turbo3"] - nll["fp16"]) - 1) - 1}
    for m in t:
        r = ev.perplexity(TableModel(t), ids, KVSettings(mode=m), context=CONTEXT, max_windows=WINDOWS)
        e[f"perplexity({m}).nll"], e[f"perplexity({m}).ppl"] = r.nll / nll[m] - 1, r.ppl / np.exp(nll[m]) - 1
    return {k: abs(float(x)) for k, x in e.items()}


if __name__ == "__main__":
    for k, x in _measured_errors().items():
        print(f"{k:24s} {x:.1e}")
