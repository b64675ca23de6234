"""rq eval: perplexity through the decode path, needle retrieval, gates (tiny models, short contexts)."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from typer.testing import CliRunner

from rq_cli.main import app
from rq_core.tools import eval as ev
from rq_core.errors import RQError
from rq_core.cache.kv_cache import KVSettings
from rq_core.models import qwen2_moe

runner = CliRunner()

# Values pinned below were measured on the CPU, where load_eval_model runs activations in float32:
# `PYTHONPATH=. python3 tests/test_eval.py` prints each of them. Repeat runs gave identical values. The tolerance
# is 40x below the closest gap between two pinned perplexities that must differ (edge layers off against fp16:
# 182.769 vs 182.841, 3.9e-4 relative). Other devices compute in float16 and are not pinned.
ON_CPU = mx.default_device() == mx.cpu
PIN_REL, PIN_ABS = 1e-5, 1e-6
MEASURED = {
    # tiny model (fixture below), 2 windows of 128
    "tiny_nll_fp16": 6.4159791469573975, "tiny_nll_isoquant3": 6.446439027786255, "tiny_kl_turbo3": 1.0991544723510742,
    # bundled model, `rq eval ppl --context 64 --windows 1`, with --kv isoquant3 --kv-config fp16_window=4 unless fp16
    "ppl_fp16": 182.84113978455974, "ppl_iso": 216.56269643339155, "ppl_iso_nogain": 212.73319125903805,
    "ppl_iso_edge0": 182.76931308594908, "ppl_iso_k4": 216.11674102677327, "ppl_iso_scalar": 214.17933105163112,
    "ppl_iso_prefill8": 223.46973893124957,
    # `rq eval ppl --kv isoquant3 --kv-config rotation=so4 --context 64 --windows 1` (its default fp16 window, 32)
    "ppl_iso_so4": 192.07857432194243,
}


def pinned(got: float, key: str) -> None:
    """`got` is the value measured for `key` (on the CPU; elsewhere nothing is pinned)."""
    if ON_CPU:
        assert got == pytest.approx(MEASURED[key], rel=PIN_REL, abs=PIN_ABS), (key, got)


def _tiny_model():
    mx.random.seed(0)
    args = qwen2_moe.ModelArgs(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=64, vocab_size=64,
                               max_position_embeddings=256, rope_theta=10000.0)
    m = qwen2_moe.Model(args)
    # Larger weights than the default init so attention is peaked and compression error shows.
    m.update(tree_map(lambda p: p * 4 if p.ndim >= 2 else p, m.parameters()))
    mx.eval(m.parameters())
    ids = np.random.default_rng(0).integers(1, 64, size=600).astype(np.int32)
    return m, ids


@pytest.fixture(scope="module")
def tiny():
    return _tiny_model()


def test_windows_split_and_errors():
    ids = np.arange(101)
    w = ev.windows(ids, 25)
    assert len(w) == 4 and all(len(x) == 26 for x in w)
    assert w[1][0] == 25 and w[1][-1] == 50
    assert len(ev.windows(ids, 25, max_windows=2)) == 2
    with pytest.raises(RQError):
        ev.windows(np.arange(10), 25)


def test_decode_steps_match_token_by_token(tiny):
    m, ids = tiny
    w = ids[:97]
    kv = KVSettings(mode="isoquant3")
    a = ev.window_logprobs(m, w, kv, prefill=48, step=1)
    b = ev.window_logprobs(m, w, kv, prefill=48, step=7)
    assert a.shape == (48, 64)
    # measured 0.0 on the CPU (|log-probs| up to 15); 1e-5 is ~10 float32 ulps there, for another summation order
    assert mx.allclose(a, b, atol=1e-5).item()


def test_fp16_path_equals_one_full_forward(tiny):
    m, ids = tiny
    w = ids[:65]
    lp = ev.window_logprobs(m, w, KVSettings(mode="fp16"), prefill=32, step=8)
    full = m(mx.array(w[None, :-1]))[0].astype(mx.float32)
    full = full - mx.logsumexp(full, axis=-1, keepdims=True)
    assert mx.allclose(lp, full[32:], atol=1e-5).item()  # measured 0.0 (|log-probs| up to 14)


def test_compressed_path_is_measured(tiny):
    m, ids = tiny
    r16 = ev.perplexity(m, ids, KVSettings(mode="fp16"), context=128, max_windows=2)
    r3 = ev.perplexity(m, ids, KVSettings(mode="isoquant3"), context=128, max_windows=2)
    assert r16.tokens == r3.tokens == 2 * 64  # context - prefill targets per window
    assert r3.kv_mode == "isoquant3" and r3.rotation == "wht_so4" and r16.rotation is None
    # the compressed cache changes what decode steps read: +0.0305 nats per token on this model
    pinned(r16.nll, "tiny_nll_fp16")
    pinned(r3.nll, "tiny_nll_isoquant3")
    assert math.isclose(r16.ppl, math.exp(r16.nll))


def test_compare_against_itself_and_turbo(tiny):
    m, ids = tiny
    same, ref = ev.compare(m, ids, KVSettings(mode="fp16"), context=64, max_windows=2)
    assert same.mean_kl == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    assert same.rel_delta_ppl == pytest.approx(0.0, abs=1e-6) and same.finite
    t, _ = ev.compare(m, ids, ev.kv_settings("turbo3"), context=64, max_windows=2, ref=ref)
    assert t.nll_ref == pytest.approx(same.nll_ref, rel=1e-12) and t.tokens == same.tokens == 2 * 32
    pinned(t.mean_kl, "tiny_kl_turbo3")


def test_needle_trials_place_needle_at_depth():
    class Tok:  # digits are single tokens 10..19; other text: one token per character
        def encode(self, s, add_special_tokens=False):
            return [10 + int(c) if c.isdigit() else 100 + ord(c) % 50 for c in s]

    pieces = ev.needle_token_pieces(Tok())
    ids = np.full(5000, 7, np.int32)
    for depth in (0.0, 0.5, 1.0):
        (t,) = ev.needle_trials(ids, pieces, length=400, depth=depth, trials=1, seed=1)
        assert len(t.prompt) == 400 and t.question_len == len(pieces["question"])
        hay = t.prompt[: -t.question_len]
        n = len(pieces["needle_prefix"]) + 5 + len(pieces["needle_suffix"])
        pos = int(round(depth * (len(hay) - n)))
        assert np.array_equal(hay[pos + len(pieces["needle_prefix"]) : pos + len(pieces["needle_prefix"]) + 5], t.answer)
        assert set(t.answer) <= set(range(10, 20))


def test_niah_structure(tiny):
    m, ids = tiny

    class Tok:
        def encode(self, s, add_special_tokens=False):
            return [1 + int(c) if c.isdigit() else 20 + ord(c) % 40 for c in s]

    res = ev.niah(m, ids, ev.needle_token_pieces(Tok()), [KVSettings(mode="fp16"), ev.kv_settings("isoquant3", "so3")],
                  lengths=[100], depths=[0.2, 0.8], trials=1)
    assert set(res["modes"]) == {"fp16", "isoquant3/so3+p128x32"}  # isoquant3's default codebooks
    for r in res["modes"].values():
        assert len(r["cells"]) == 2 and all(0 <= c["accuracy"] <= 1 for c in r["cells"])
        assert all(c["accuracy"] == sum(c["hits"]) / 1 and set(c["hits"]) <= {0, 1} for c in r["cells"])
    ref = [h for c in res["modes"]["fp16"]["cells"] for h in c["hits"]]
    got = [h for c in res["modes"]["isoquant3/so3+p128x32"]["cells"] for h in c["hits"]]
    pr = res["modes"]["isoquant3/so3+p128x32"]["paired"]
    assert "paired" not in res["modes"]["fp16"]
    assert pr["lost"] == sum(r and not g for r, g in zip(ref, got)) and pr["gained"] == sum(g and not r for r, g in zip(ref, got))


def test_mcnemar_exact():
    assert ev.mcnemar_p(0, 0) == 1.0 and ev.mcnemar_p(3, 3) == 1.0
    assert abs(ev.mcnemar_p(0, 5) - 2 / 32) < 1e-12  # all 5 discordant pairs one way: 2 * (1/2)^5
    assert abs(ev.mcnemar_p(1, 9) - 2 * 11 / 1024) < 1e-12
    assert ev.mcnemar_p(9, 1) == ev.mcnemar_p(1, 9)


def test_gates_file_validation(tmp_path):
    cfg = ev.load_gates()
    assert set(ev.GATES) <= set(cfg["gates"]) and len(ev.GATES) == 12
    bad = tmp_path / "g.toml"
    bad.write_text("[gates]\nppl_rel_delta = 0.01\n")
    with pytest.raises(RQError, match="missing"):
        ev.load_gates(bad)


def test_cli_ppl_json_on_bundled_model():
    r = runner.invoke(app, ["eval", "ppl", "--kv", "isoquant3", "--kv-config", "rotation=so4", "--context", "64",
                            "--windows", "1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {"ppl", "tokens", "kv_mode", "rotation", "context"} <= set(d)
    assert d["kv_mode"] == "isoquant3" and d["rotation"] == "so4" and d["context"] == 64 and d["tokens"] == 32
    pinned(d["ppl"], "ppl_iso_so4")


def test_cli_ppl_fp16_window():
    """A window as long as the context keeps every token unquantized: exactly the fp16 perplexity; a short
    one is measured (a different number) and reported."""
    def ppl(*extra):
        r = runner.invoke(app, ["eval", "ppl", "--context", "64", "--windows", "1", "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    ref = ppl()
    full = ppl("--kv", "isoquant3", "--kv-config", "fp16_window=64")
    short = ppl("--kv", "isoquant3", "--kv-config", "fp16_window=4")
    assert full["fp16_window"] == 64 and ref["fp16_window"] == 0 and short["fp16_window"] == 4
    assert ppl("--kv", "isoquant3")["fp16_window"] == 32  # the default, as `rq run`'s
    assert full["ppl"] == ref["ppl"]  # every token in the window: the fp16 computation itself
    pinned(ref["ppl"], "ppl_fp16")
    pinned(short["ppl"], "ppl_iso")  # +18.4% over fp16
    assert ev.label(ev.kv_settings("isoquant3", fp16_window=32)) == "isoquant3/wht_so4+w32+p128x32"
    assert ev.label(ev.kv_settings("isoquant3", fp16_window=32, pair_points=())) == "isoquant3/wht_so4+w32"
    assert ev.label(ev.kv_settings("turbo3", fp16_window=32, value_gain=False)) == "turbo3+w32+nogain"
    # kv.value_gain changes what decode reads, and the JSON says which was measured
    gain, plain = _iso_ppl(), _iso_ppl("--kv-config", "value_gain=off")
    assert gain["value_gain"] is True and plain["value_gain"] is False
    assert gain["ppl"] == short["ppl"]  # on by default
    pinned(plain["ppl"], "ppl_iso_nogain")
    # kv.edge_layers: on by default (one layer at each end at 4 bits), measured, reported and labelled
    none = _iso_ppl("--kv-config", "edge_layers=0")
    assert (gain["edge_layers"], gain["edge_bits"]) == (1, 4) and (none["edge_layers"], none["edge_bits"]) == (0, None)
    pinned(none["ppl"], "ppl_iso_edge0")
    assert ev.label(ev.kv_settings("isoquant3", fp16_window=32, edge_layers=1)) == "isoquant3/wht_so4+w32+p128x32+e1"


def _iso_ppl(*extra) -> dict:
    """`rq eval ppl --kv isoquant3` on one short window, JSON."""
    r = runner.invoke(app, ["eval", "ppl", "--kv", "isoquant3", "--context", "64", "--windows", "1",
                            "--kv-config", "fp16_window=4", "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_cli_ppl_key_bits():
    """kv.key_bits: keys at their own width, reported; 4-bit keys change the perplexity measured."""
    base, k4 = _iso_ppl(), _iso_ppl("--kv-config", "key_bits=4")
    assert base["key_bits"] is None and k4["key_bits"] == 4
    pinned(base["ppl"], "ppl_iso")
    pinned(k4["ppl"], "ppl_iso_k4")
    assert ev.label(ev.kv_settings("isoquant3", fp16_window=32, key_bits=4)) == "isoquant3/wht_so4+w32+k4"
    assert ev.label(ev.kv_settings("isoquant3", key_bits=3)) == "isoquant3/wht_so4"  # the mode's own width


def test_cli_ppl_pair_points():
    """isoquant3's default is the pair codebooks (128, 32), reported in the JSON; pair_points sets them and 'off'
    gives the scalar codebooks; the codebooks change the perplexity."""
    base, pp, scalar = _iso_ppl(), _iso_ppl("--kv-config", "pair_points=128,32"), _iso_ppl("--kv-config", "pair_points=off")
    assert base["pair_points"] == [128, 32] and base["ppl"] == pp["ppl"] and scalar["pair_points"] is None
    pinned(base["ppl"], "ppl_iso")
    pinned(scalar["ppl"], "ppl_iso_scalar")
    assert ev.label(ev.kv_settings("isoquant3", fp16_window=32, pair_points=(128, 32))) == \
        "isoquant3/wht_so4+w32+p128x32"


def test_cli_ppl_prefill_fp16():
    """prefill_fp16=N with --prefill-chunk: the window's prefill is compressed as its chunks arrive, which changes
    what the scored half reads (a different perplexity), reported in the JSON; a bound as long as the prefill changes
    nothing."""
    base = _iso_ppl("--prefill-chunk", "8", "--kv-config", "prefill_fp16=all")
    bounded = _iso_ppl("--prefill-chunk", "8", "--kv-config", "prefill_fp16=8")
    whole = _iso_ppl("--prefill-chunk", "8", "--kv-config", "prefill_fp16=32")
    default = _iso_ppl("--prefill-chunk", "8")  # the default bound (4,096) is longer than this prefill
    assert base["prefill_fp16"] is None and bounded["prefill_fp16"] == 8 and bounded["prefill_chunk"] == 8
    assert default["prefill_fp16"] == 4096 and default["ppl"] == pytest.approx(base["ppl"], rel=1e-6)
    assert whole["ppl"] == base["ppl"]  # a bound as long as the prefill: the same computation
    pinned(base["ppl"], "ppl_iso")
    pinned(bounded["ppl"], "ppl_iso_prefill8")


@pytest.mark.parametrize("argv", [["eval", "ppl", "--kv", "int2"], ["eval", "ppl", "--kv-config", "fp16_window=-1"],
                                  ["eval", "ppl", "--kv-config", "prefill_fp16=-1"], ["eval", "ppl", "--prefill-chunk", "0"], ["eval", "ppl", "--kv", "turbo3", "--kv-config", "rotation=so9"],
                                  ["eval", "ppl", "--kv", "isoquant3", "--kv-config", "key_bits=9"],
                                  ["eval", "ppl", "--kv", "isoquant3", "--kv-config", "pair_points=128,33"],
                                  ["eval", "ppl", "--kv", "isoquant3", "--kv-config", "pair_points=128"],
                                  ["eval", "niah", "--kv-config", "pair_points=128,32", "--kv-config", "key_bits=4"],
                                  ["eval", "ppl", "--context", "100000"], ["eval", "niah", "--depths", "1.5"],
                                  ["eval", "gates", "--kv-config", "rotation=bogus"]])
def test_cli_bad_input_is_one_line(argv):
    r = runner.invoke(app, argv)
    assert r.exit_code == 2
    assert "Traceback" not in r.output and "error:" in r.output


TINY_GATES = ("[settings]\ncontext = 64\nfull_context = 96\nwindows = 1\nfull_windows = 1\nstep = 16\nprompts = 1\n"
              "prompt_len = 32\ngen_tokens = 8\nniah_lengths = [64]\nniah_depths = [0.5]\nniah_trials = 1\nseed = 0\n")


def _gates(tmp_path, argv, **thresholds) -> tuple[int, dict, dict]:
    """`rq eval gates --json` with TINY_GATES' settings and the bundled thresholds (some replaced):
    exit code, report, thresholds used."""
    cfg = ev.load_gates()["gates"]
    cfg.update(thresholds)
    g = tmp_path / "gates.toml"
    g.write_text(TINY_GATES + "[gates]\n" + "".join(f"{k} = {str(v).lower()}\n" for k, v in cfg.items()))
    r = runner.invoke(app, ["eval", "gates", *argv, "--gates", str(g), "--json"])
    d = json.loads(r.stdout)
    assert [x["name"] for x in d["gates"]] == list(ev.GATES) and d["total"] == 12
    assert d["passed"] == sum(x["passed"] for x in d["gates"])
    return r.exit_code, d, cfg


# isoquant3/so4 against fp16 at TINY_GATES' settings on the bundled model (CPU; see MEASURED): gate values as
# measured, and whether each passes
GATES_MEASURED = {
    "ppl_rel_delta": (-3.719260667756075e-05, True), "ppl_rel_delta_full": (0.10047220462594875, False),
    "mean_kl": (0.16755658388137817, False), "p99_kl": (0.9003509283065796, False), "top1_agreement": (0.78125, False),
    "greedy_agreement": (0.5, False), "needle_retention": (-1.0, False), "finite": (1.0, True),
    "no_degenerate_repetition": (0.0, True), "eos_honoured": (1.0, True), "deterministic": (1.0, True),
    "kv_bytes_ratio": (0.21614583333333334, True)}


def test_cli_gates_tiny_settings(tmp_path):
    """A compressed cache on 64-token windows of a tiny model fails seven gates: each verdict follows from its
    value and threshold (compared here), the failures are the measured ones, and the command exits 1."""
    code, d, th = _gates(tmp_path, ["--kv", "isoquant3", "--kv-config", "rotation=so4", "--kv-config", "fp16_window=0"])
    got = {x["name"]: x for x in d["gates"]}
    for name in ("ppl_rel_delta", "ppl_rel_delta_full", "mean_kl", "p99_kl", "kv_bytes_ratio"):
        assert got[name]["passed"] == (got[name]["value"] <= th[name]), name
    for name in ("top1_agreement", "greedy_agreement"):
        assert got[name]["passed"] == (got[name]["value"] >= th[name]), name
    assert got["needle_retention"]["value"] == d["details"]["needle_accuracy"] - d["details"]["needle_accuracy_fp16"]
    assert got["needle_retention"]["passed"] == (got["needle_retention"]["value"] >= -th["needle_retention"])
    # 32 scored tokens: top-1 agreement is a count of them; 8 greedy tokens from one prompt: greedy agreement too
    t1, ga = got["top1_agreement"]["value"], got["greedy_agreement"]["value"]
    assert d["details"]["tokens"] == 32 and t1 * 32 == round(t1 * 32) and ga * 8 == round(ga * 8)
    assert got["ppl_rel_delta"]["value"] == pytest.approx(d["details"]["ppl"] / d["details"]["ppl_fp16"] - 1, rel=1e-12)
    assert 0 < got["kv_bytes_ratio"]["value"] < 0.25
    assert got["deterministic"]["passed"] and got["eos_honoured"]["passed"] and got["finite"]["passed"]
    if ON_CPU:
        assert {k: x["passed"] for k, x in got.items()} == {k: ok for k, (_, ok) in GATES_MEASURED.items()}
        for k, (value, _) in GATES_MEASURED.items():
            assert got[k]["value"] == pytest.approx(value, rel=PIN_REL, abs=PIN_ABS), k
    assert d["passed"] < 12 and code == 1


def test_cli_gates_fp16_against_itself_passes(tmp_path):
    """fp16 gated against fp16: every quality value is exact (no change, full agreement) and the command exits 0.
    The bytes gate is given 2.0: on the CPU the reference cache holds float32 (load_eval_model's activations),
    measured 2.0 times fp16's bytes."""
    code, d, _ = _gates(tmp_path, ["--kv", "fp16"], kv_bytes_ratio=2.0)
    got = {x["name"]: x["value"] for x in d["gates"]}
    assert got == {"ppl_rel_delta": 0.0, "ppl_rel_delta_full": 0.0, "mean_kl": 0.0, "p99_kl": 0.0,
                   "top1_agreement": 1.0, "greedy_agreement": 1.0, "needle_retention": 0.0, "finite": 1.0,
                   "no_degenerate_repetition": 0.0, "eos_honoured": 1.0, "deterministic": 1.0,
                   "kv_bytes_ratio": 2.0 if ON_CPU else 1.0}
    assert d["passed"] == 12 and code == 0


def test_cli_gates_exit_code_follows_the_gates(monkeypatch):
    """The command exits 1 when any gate fails and 0 when all pass, whatever the report's other fields (a
    constructed report; no model runs)."""
    calls = []

    class Runner:
        def __init__(self, em, cfg, ids, **kw):  # kw: full, progress, note
            pass

        def run(self, kv):
            rep = ev.GateReport("constructed")
            rep.gates = [{"name": n, "value": 0.0, "threshold": "-", "passed": n not in calls[-1]} for n in ev.GATES]
            return rep

    class Tok:
        def encode(self, s, add_special_tokens=False):
            return [1, 2, 3]

    monkeypatch.setattr(ev, "GateRunner", Runner)
    monkeypatch.setattr(ev, "load_eval_model", lambda model=None: ev.EvalModel(None, Tok(), {}, ev.ASSETS, 64))
    for failing, code in [((), 0), (("mean_kl",), 1), (("kv_bytes_ratio",), 1), (tuple(ev.GATES), 1)]:
        calls.append(failing)
        for extra in ([], ["--json"]):
            r = runner.invoke(app, ["eval", "gates", "--kv", "fp16", *extra])
            assert r.exit_code == code, (failing, extra, r.output)
            if extra:
                assert json.loads(r.stdout)["passed"] == 12 - len(failing)
            else:
                assert f"{12 - len(failing)}/12 passed" in r.output and r.output.count("FAIL") == len(failing)


class _TextTok:
    """Three characters a token (ids 0..6); a digit alone is one token, as the needle needs."""

    def encode(self, s, add_special_tokens=False):
        return [int(s)] if len(s) == 1 and s.isdigit() else [i % 7 for i in range(len(s) // 3)]


def _help(*argv) -> str:
    """A command's help as one line of words (rich's boxes and wrapping removed)."""
    r = runner.invoke(app, [*argv, "--help"])
    assert r.exit_code == 0, r.output
    return " ".join(r.output.replace("│", " ").split())


@pytest.fixture
def stub_model(monkeypatch):
    """`rq eval` on a model that costs nothing: no weights; windows and needles are counted, not computed."""
    monkeypatch.setattr(ev, "load_eval_model", lambda model=None: ev.EvalModel(None, _TextTok(), {}, ev.ASSETS, 2048))
    monkeypatch.setattr(ev, "window_logprobs", lambda m, w, kv, *, prefill, step=32, prefill_chunk=512:
                        mx.zeros((len(w) - prefill - 1, 8)))
    monkeypatch.setattr(ev, "answer_needle", lambda m, t, kv, prefill_chunk=512: t.answer)
    return ev.encode_ids(_TextTok(), ev.load_heldout_text())


def test_cli_default_samples_are_the_helps_and_full_is_every_window(stub_model):
    """`rq eval ppl` scores the windows its help names, --full every window of the text; `rq eval niah` the grid
    its help names, --full the larger one; `rq eval gates --full` every window at both contexts (counted)."""
    from rq_cli import eval as cli

    ids = stub_model
    h = _help("eval", "ppl")
    assert f"--windows N Score at most this many windows (default: {cli.PPL_WINDOWS})." in h
    assert "--full Score every window of the text." in h
    d = json.loads(runner.invoke(app, ["eval", "ppl", "--json"]).stdout)
    assert (d["windows"], d["context"]) == (cli.PPL_WINDOWS, 2048)
    d = json.loads(runner.invoke(app, ["eval", "ppl", "--full", "--json"]).stdout)
    n = (len(ids) - 1) // 2048  # every window of the text
    assert n > cli.PPL_WINDOWS and d["windows"] == n and d["tokens"] == n * 1024
    assert json.loads(runner.invoke(app, ["eval", "ppl", "--windows", "3", "--json"]).stdout)["windows"] == 3

    h = _help("eval", "niah")
    q, f = cli.NIAH_QUICK, cli.NIAH_FULL
    assert f"(default: {q['lengths']}; --full: {f['lengths']})" in h
    assert f"(default: {q['depths']}; --full: {f['depths']})" in h
    assert f"Needles per cell (default: {q['trials']}; --full: {f['trials']})" in h
    for extra, grid in (([], q), (["--full"], f)):
        d = json.loads(runner.invoke(app, ["eval", "niah", "--kv", "isoquant3", "--json", *extra]).stdout)
        assert d["lengths"] == [int(x) for x in grid["lengths"].split(",")]
        assert d["depths"] == [float(x) for x in grid["depths"].split(",")] and d["trials"] == grid["trials"]
        cells = d["modes"]["fp16"]["cells"]
        assert len(cells) == len(d["lengths"]) * len(d["depths"]) and all(len(c["hits"]) == d["trials"] for c in cells)
    # a flag given explicitly wins over --full's grid
    d = json.loads(runner.invoke(app, ["eval", "niah", "--full", "--trials", "2", "--json"]).stdout)
    assert d["trials"] == 2 and d["lengths"] == [512, 1024, 2048]

    assert "Score every window of the held-out text for the perplexity and KL gates" in _help("eval", "gates")
    cfg = ev.load_gates()
    em = ev.load_eval_model()
    quick, full = ev.GateRunner(em, cfg, ids), ev.GateRunner(em, cfg, ids, full=True)
    s = cfg["settings"]
    assert quick.window_counts() == (s["windows"], s["full_windows"])
    assert full.window_counts() == ((len(ids) - 1) // 1024, (len(ids) - 1) // 2048)
    assert (full.prompts, full.niah_trials) == (cfg["full"]["prompts"], cfg["full"]["niah_trials"])


def test_cli_ppl_full_with_windows_is_one_line():
    r = runner.invoke(app, ["eval", "ppl", "--full", "--windows", "2"])
    assert r.exit_code == 2 and "Traceback" not in r.output and r.output.count("\n") == 1 and "--full" in r.output


def test_cli_progress_and_partial_results_stay_off_json(stub_model):
    """Without --json the partial results are printed as they come (on stderr, as all human output); with it, stdout
    is the one JSON object and stderr is empty."""
    r = runner.invoke(app, ["eval", "ppl", "--windows", "2"])
    assert r.exit_code == 0, r.output
    assert "window 1/2: ppl 1.000, so far 1.000" in r.stderr and "window 2/2:" in r.stderr and r.stdout == ""
    r = runner.invoke(app, ["eval", "ppl", "--windows", "2", "--json"])
    assert json.loads(r.stdout)["windows"] == 2 and r.stderr == ""


def test_bundled_model_runs_offline(monkeypatch):
    """`rq run --prompt "ROMEO:"` with no model argument and no network generates text."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = runner.invoke(app, ["run", "--prompt", "ROMEO:", "-n", "4", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["generated_tokens"] >= 1 and d["model_type"] == "qwen2_moe"
    assert d["model"].endswith("default_model")


def test_bundled_model_size_and_heldout():
    from rq_core.checkpoint import DEFAULT_MODEL

    total = sum(f.stat().st_size for f in DEFAULT_MODEL.iterdir())
    assert total <= 30e6
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_moe" and cfg["head_dim"] == 128 and cfg["max_position_embeddings"] >= 2048
    text = ev.load_heldout_text()
    assert 100_000 < len(text) < 1_000_000


def _measure() -> dict:
    """The values MEASURED pins, measured again."""
    m, ids = _tiny_model()
    out = {"tiny_nll_fp16": ev.perplexity(m, ids, KVSettings(mode="fp16"), context=128, max_windows=2).nll,
           "tiny_nll_isoquant3": ev.perplexity(m, ids, KVSettings(mode="isoquant3"), context=128, max_windows=2).nll}
    _, ref = ev.compare(m, ids, KVSettings(mode="fp16"), context=64, max_windows=2)
    out["tiny_kl_turbo3"] = ev.compare(m, ids, ev.kv_settings("turbo3"), context=64, max_windows=2, ref=ref)[0].mean_kl
    r = runner.invoke(app, ["eval", "ppl", "--context", "64", "--windows", "1", "--json"])
    out["ppl_fp16"] = json.loads(r.stdout)["ppl"]
    for key, extra in [("ppl_iso", ()), ("ppl_iso_nogain", ("--kv-config", "value_gain=off")),
                       ("ppl_iso_edge0", ("--kv-config", "edge_layers=0")), ("ppl_iso_k4", ("--kv-config", "key_bits=4")),
                       ("ppl_iso_scalar", ("--kv-config", "pair_points=off")),
                       ("ppl_iso_prefill8", ("--prefill-chunk", "8", "--kv-config", "prefill_fp16=8"))]:
        out[key] = _iso_ppl(*extra)["ppl"]
    r = runner.invoke(app, ["eval", "ppl", "--kv", "isoquant3", "--kv-config", "rotation=so4", "--context", "64",
                            "--windows", "1", "--json"])
    out["ppl_iso_so4"] = json.loads(r.stdout)["ppl"]
    return out


if __name__ == "__main__":
    print("device:", mx.default_device())
    for k, x in _measure().items():
        print(f"{k:20s} {x!r}")
