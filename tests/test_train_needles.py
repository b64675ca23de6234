"""The training script's needle rows use exactly `rq_core.tools.eval`'s needle format, and the answer-digit
loss weights sit on the answer targets (target t is predicted at position t - 1)."""

import re
from pathlib import Path

import numpy as np

from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _load():
    return load_script("scripts/train_reference.py")


def test_needle_rows_match_eval_format():
    from tokenizers import Tokenizer

    from rq_core.tools.eval import QUESTION, needle_token_pieces, needle_trials

    tok = Tokenizer.from_file(str(ROOT / "rq_core" / "assets" / "default_model" / "tokenizer.json"))
    pieces = needle_token_pieces(tok)
    ids = np.asarray(tok.encode("To be, or not to be, that is the question. " * 300).ids, dtype=np.int32)
    rng = np.random.default_rng(0)
    T, B = 512, 6
    rows = np.stack([ids[s : s + T + 1] for s in rng.integers(0, ids.size - T - 1, size=B)])
    w = np.ones((B, T), np.float32)
    _load().needle_batch_rows(rng, rows, pieces, w, 10.0, 4)
    pairs = 0
    for b in range(B):
        text = tok.decode(rows[b].tolist())
        needles = re.findall(r"\nThe secret number is (\d{5})\.\n", text)
        answers = re.findall(re.escape(QUESTION) + r"(\d{5})", text)
        assert needles and needles == answers  # each question answers the needle just before it
        weighted = rows[b, 1:][w[b] != 1.0]
        assert tok.decode(weighted.tolist()) == "".join(answers)
        pairs += len(answers)
    assert pairs > B  # several pairs per row
    # eval's prompt ends with the same question tokens the training rows carry before the answer
    t = needle_trials(ids, pieces, length=256, depth=0.5, trials=1)[0]
    assert np.array_equal(t.prompt[-t.question_len :], pieces["question"])


def test_copy_rows_alphabet_and_varying_offsets():
    """Copy rows: a span of 16..max_span tokens from ids 1..vocab-1, tiled, so each row repeats at its own
    offset (a fixed offset would be solved by a positional head, not an induction head)."""
    rng = np.random.default_rng(0)
    rows = np.zeros((32, 257), np.int32)
    _load().copy_rows(rng, rows, 512, max_span=64)
    assert rows.min() >= 1 and rows.max() < 512
    periods = set()
    for r in rows:
        n = next(p for p in range(16, 65) if np.array_equal(r[p:], r[:-p]))
        periods.add(n)
    assert len(periods) > 8  # the offset varies between rows
