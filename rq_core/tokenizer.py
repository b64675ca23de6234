"""Tokenizer (the `tokenizers` library, from tokenizer.json) and the checkpoint's chat template (jinja2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rq_core.errors import RQError
from rq_core.textio import read_utf8


def _token_str(t: Any) -> Optional[str]:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(t, dict):
        return t.get("content")
    return t if isinstance(t, str) else None


class Tokenizer:
    def __init__(self, tok: Any, config: Optional[dict] = None, chat_template: Optional[str] = None):
        self._tok = tok
        self.config = config or {}
        self.chat_template = chat_template
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        ids = set()
        if self.eos_token is not None and tok.token_to_id(self.eos_token) is not None:
            ids.add(tok.token_to_id(self.eos_token))
        self.eos_token_ids: set[int] = ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the checkpoint's chat template the way transformers does (sandboxed jinja2, in a child
        process with a time, memory and output limit: the template is untrusted)."""
        if not self.chat_template:
            raise RQError("this checkpoint has no chat template (tokenizer_config.json / chat_template.jinja); "
                          "drop --chat")
        return render_chat_template(self.chat_template, dict(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation: the chat template's rendering (which writes its own special tokens), or,
        for a checkpoint without one, a plain transcript (`plain_transcript`)."""
        if self.chat_template:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
        return self.encode(plain_transcript(messages, add_generation_prompt))


def plain_transcript(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """A conversation as a script, for a model without a chat template: "ROLE:\ncontent\n\n" a message, then
    "ASSISTANT:\n" for the reply (the layout of a play, which a base model continues as dialogue)."""
    text = "".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in messages)
    return text + ("ASSISTANT:\n" if add_generation_prompt else "")


TEMPLATE_SECONDS = 10.0  # a real chat template renders in milliseconds; the child's start-up is most of this
TEMPLATE_MEMORY = 1 << 30
TEMPLATE_MAX_CHARS = 1 << 24  # plus 4x the messages: a template may repeat what it is given, not much more
_RENDERER = Path(__file__).with_name("_render_template.py")


def render_chat_template(template: str, context: dict) -> str:
    """A chat template rendered by rq_core/_render_template.py in a child process. A process, not a thread:
    a template stuck in a loop (or in one long C call) can only be stopped for sure by killing it."""
    import subprocess
    import sys

    given = json.dumps(context)
    req = json.dumps({"template": template, "context": context, "max_bytes": TEMPLATE_MEMORY,
                      "max_chars": TEMPLATE_MAX_CHARS + 4 * len(given)})
    try:
        p = subprocess.run([sys.executable, str(_RENDERER)], input=req.encode("utf-8"), capture_output=True,
                           timeout=TEMPLATE_SECONDS)
    except subprocess.TimeoutExpired:
        raise RQError(f"chat template failed: it did not finish in {TEMPLATE_SECONDS:g} s (a loop that does not "
                      "end?)") from None
    try:
        out = json.loads(p.stdout.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        out = None
    if not isinstance(out, dict) or not isinstance(out.get("text", out.get("error")), str):
        why = (p.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        raise RQError(f"chat template failed: the renderer stopped ({why})")
    if "error" in out:
        raise RQError(f"chat template failed: {out['error']}")
    return out["text"]


def _chat_template(path: Path, cfg: dict) -> Optional[str]:
    jinja = path / "chat_template.jinja"  # transformers 5 saves the template as its own file
    if jinja.is_file():
        return read_utf8(jinja)
    ct_json = path / "chat_template.json"
    if ct_json.is_file():
        try:
            ct = json.loads(read_utf8(ct_json))
        except json.JSONDecodeError as e:
            raise RQError(f"{ct_json} is not valid JSON: {e}")
        ct = ct.get("chat_template") if isinstance(ct, dict) else None
        if ct:
            return ct
    ct = cfg.get("chat_template")
    if isinstance(ct, list):  # named templates: prefer "default"
        named = {t.get("name"): t.get("template") for t in ct if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return ct


def load_tokenizer(path: str | Path) -> Optional[Tokenizer]:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json."""
    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        return None
    from tokenizers import Tokenizer as _HFTokenizer

    try:
        tok = _HFTokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise RQError(f"cannot read {tj}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    cfg_path = path / "tokenizer_config.json"
    cfg = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(read_utf8(cfg_path))
        except json.JSONDecodeError as e:
            raise RQError(f"{cfg_path} is not valid JSON: {e}")
    return Tokenizer(tok, cfg, _chat_template(path, cfg))


class StreamDecoder:
    """Incremental detokenizer: text pieces as tokens arrive, never a broken character.

    Each piece is decoded in the context of the piece before it (its tokens start at a character boundary, so
    they decode alone as they do in the whole), so a decoder that treats a sequence's first token apart
    (SentencePiece drops its leading space) or fuses byte tokens gives what decoding all the tokens at once gives:
    the pieces concatenate to `decode(all ids)`. A trailing U+FFFD (a character whose UTF-8 bytes are split across
    tokens) is held back until a later token completes it (or `flush`). Only the context and the pending tokens
    are decoded, so streaming stays O(1) per token on long outputs."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._ids: list[int] = []  # the window: the context tokens, then the pending ones (from self._start)
        self._start = 0
        self._sent = 0  # characters of the window's decode already handed out (the context's included)

    def add(self, token: int) -> str:
        """The new text that `token` completes ("" while a character is still incomplete)."""
        self._ids.append(int(token))
        text = self.tokenizer.decode(self._ids)
        done = text.rstrip("\ufffd")
        piece = done[self._sent:]
        self._sent = max(self._sent, len(done))
        if len(done) == len(text):  # a clean boundary: the pending tokens become the next piece's context
            group = self._ids[self._start:]
            alone = self.tokenizer.decode(group)
            if alone:  # (tokens that decode to nothing, special ones, keep the context before them too)
                self._ids, self._sent = group, len(alone)
            self._start = len(self._ids)
        return piece

    def flush(self) -> str:
        """What is still held back (an incomplete character decodes to U+FFFD, as the full decode has it)."""
        piece = self.tokenizer.decode(self._ids)[self._sent:]
        self._ids, self._start, self._sent = [], 0, 0
        return piece
