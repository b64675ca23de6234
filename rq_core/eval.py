"""Quality measurements on a model: perplexity, needle retrieval, quality gates (`rq eval`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rq_core.errors import RQError

ASSETS = Path(__file__).resolve().parent / "assets"
HELDOUT_PATH = ASSETS / "heldout.txt"

# The needle: a secret number stated once in the haystack and asked for at the end. The training
# script mixes the same pieces into a share of its sequences (scripts/train_reference.py).
NEEDLE_PREFIX = "\nThe secret number is "
NEEDLE_SUFFIX = ".\n"
QUESTION = "\nWhat is the secret number? The secret number is "
N_DIGITS = 5


def load_heldout_text(path: str | Path | None = None) -> str:
    """The held-out plays shipped with rq (never seen in training), or a given text file."""
    p = Path(path) if path else HELDOUT_PATH
    if not p.is_file():
        raise RQError(f"held-out text not found: {p}")
    return p.read_text(encoding="utf-8")


def needle_token_pieces(tokenizer) -> dict:
    """Token ids of the needle's pieces; `tokenizer` is a `tokenizers.Tokenizer` (or has .encode)."""

    def enc(s: str) -> np.ndarray:
        e = tokenizer.encode(s, add_special_tokens=False)
        return np.asarray(getattr(e, "ids", e), dtype=np.int32)

    digits = [enc(str(i)) for i in range(10)]
    if any(d.size != 1 for d in digits):
        raise RQError("the tokenizer does not encode each digit as one token; needle tests need that")
    return {
        "needle_prefix": enc(NEEDLE_PREFIX),
        "needle_suffix": enc(NEEDLE_SUFFIX),
        "question": enc(QUESTION),
        "digits": np.concatenate(digits),
        "n_digits": N_DIGITS,
    }
