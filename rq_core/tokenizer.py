"""Tokenizer (the `tokenizers` library, from tokenizer.json) and the checkpoint's chat template (jinja2)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from rq_core.errors import RQError


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
        """Render the checkpoint's chat template the way transformers does (sandboxed jinja2)."""
        if not self.chat_template:
            raise RQError("this checkpoint has no chat template (tokenizer_config.json / chat_template.jinja); "
                          "drop --chat")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover - a declared dependency
            raise RQError("--chat needs jinja2 (pip install jinja2)")

        def raise_exception(msg: str) -> None:
            raise jinja2.exceptions.TemplateError(msg)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise RQError(f"chat template failed: {e}")


def _chat_template(path: Path, cfg: dict) -> Optional[str]:
    jinja = path / "chat_template.jinja"  # transformers 5 saves the template as its own file
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    ct_json = path / "chat_template.json"
    if ct_json.is_file():
        try:
            ct = json.loads(ct_json.read_text(encoding="utf-8"))
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
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise RQError(f"{cfg_path} is not valid JSON: {e}")
    return Tokenizer(tok, cfg, _chat_template(path, cfg))


class StreamDecoder:
    """Turn a growing list of token ids into text pieces, holding back incomplete UTF-8 sequences.

    Only the ids since the last completed line are re-decoded, so streaming stays O(1) per token
    on long outputs (decoding a whole segment keeps BPE merges and spaces right)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # the current segment
        self.emitted = 0  # characters of the segment's decode already handed out

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[self.emitted:]
        self.emitted = len(text)
        if text.endswith("\n") and len(self.ids) > 1:  # a line is complete: start a new segment
            self.ids, self.emitted = [], 0
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece = text[self.emitted:]
        self.ids, self.emitted = [], 0
        return piece
