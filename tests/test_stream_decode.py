"""The streaming detokenizer: pieces never hold a broken character and concatenate to the full decode."""

from __future__ import annotations

import json
import random

from typer.testing import CliRunner

from rq_cli.main import app
from rq_core.checkpoint import DEFAULT_MODEL
from rq_core.tokenizer import StreamDecoder, Tokenizer, load_tokenizer

TEXT = "héllo — 日本語 🎉 naïve café\nROMEO:\n  x"


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    s = StreamDecoder(tok)
    return [s.add(i) for i in ids] + [s.flush()]


def test_multibyte_characters_are_held_until_complete() -> None:
    tok = load_tokenizer(DEFAULT_MODEL)
    ids = tok.encode(TEXT)
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)  # per-token decoding splits characters here
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_random_token_sequences_stream_to_the_full_decode() -> None:
    """Arbitrary ids (byte fragments that never complete included): the stream equals the full decode, U+FFFD
    and all, and no piece carries a U+FFFD the full decode does not have at that place."""
    tok = load_tokenizer(DEFAULT_MODEL)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids


def _sentencepiece_like() -> Tokenizer:
    """A Llama-style decoder (▁ for spaces, byte fallback, the first leading space stripped), which a decoder
    restarting mid-text gets wrong."""
    from tokenizers import Tokenizer as HF, decoders, models

    vocab = {"<unk>": 0, "▁a": 1, "▁b": 2, "<0x0A>": 3, "<0xC3>": 4, "<0xA9>": 5, "c": 6}
    tok = HF(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok)


def test_sentencepiece_decoder_keeps_spaces_and_bytes() -> None:
    tok = _sentencepiece_like()
    # made of whole characters (é as its two byte tokens): byte fallback turns a run of byte tokens that is not
    # UTF-8 into one U+FFFD a byte, valid bytes before it too, which no stream could know in advance
    units = [[0], [1], [2], [3], [6], [4, 5]]
    rng = random.Random(0)
    for _ in range(300):
        ids = [t for _ in range(rng.randrange(1, 10)) for t in rng.choice(units)]
        pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids), (ids, pieces)
    assert _stream(tok, [1, 3, 2])[:3] == ["a", "\n", " b"]
    assert _stream(tok, [1, 4, 5]) == ["a", "", "é", ""]  # the two bytes of é, held until both are in
    assert _stream(tok, [1, 4, 2]) == ["a", "", "\ufffd b", ""]  # a byte that never completes: as decode has it


def test_rq_run_streams_what_it_decodes() -> None:
    """rq run's streamed stdout is the --json text (the full decode of the generated ids)."""
    args = ["run", "--prompt", "Café — naïve:", "--temp", "0", "--max-tokens", "48"]
    streamed = CliRunner().invoke(app, args)
    full = CliRunner().invoke(app, args + ["--json"])
    assert streamed.exit_code == 0 and full.exit_code == 0, streamed.output + full.output
    assert streamed.stdout == json.loads(full.stdout)["text"] + "\n"
