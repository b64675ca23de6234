"""`rq chat` at a pseudo-terminal: replies equal greedy generation on the conversation so far, /reset forgets it,
/quit and EOF exit 0."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rq_cli.main import app

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[1]
N = 10
PROMPT = ">> "


def _spawn(*args: str):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "rq_cli.main", "chat", "-n", str(N), *args], cwd=str(ROOT),
                          env=env, encoding="utf-8", timeout=60)
    child.expect_exact(PROMPT)
    return child


def _say(child, line: str) -> str:
    """Send a line; the reply printed before the next prompt (the terminal's echo of the line dropped)."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    out = child.before.replace("\r\n", "\n")
    assert out.startswith(line + "\n"), out
    return out[len(line) + 1:].removesuffix("\n")


def _greedy(messages: list[dict]) -> str:
    from rq_core.checkpoint import load
    from rq_core.generate import generate

    ck = load(None, cpu_float32=True)
    res = generate(ck.model, ck.tokenizer.encode_chat(messages), max_tokens=N, eos_token_ids=ck.eos_token_ids)
    return ck.tokenizer.decode(res.tokens)


def test_two_turns_reset_and_quit() -> None:
    u1, u2 = "Good morrow, sir.", "What news?"
    r = CliRunner().invoke(app, ["run", "--system", "Speak.", "--prompt", u1, "--temp", "0", "-n", str(N), "--json"])
    first = json.loads(r.stdout)["text"]
    second = _greedy([{"role": "system", "content": "Speak."}, {"role": "user", "content": u1},
                      {"role": "assistant", "content": first}, {"role": "user", "content": u2}])
    alone = _greedy([{"role": "system", "content": "Speak."}, {"role": "user", "content": u2}])
    assert first and second and alone != second

    child = _spawn("--system", "Speak.")
    assert _say(child, u1) == first
    assert _say(child, u2) == second  # the history is in the prompt
    assert "(conversation cleared)" in _say(child, "/reset")
    assert _say(child, u2) == alone  # forgotten: as if u2 came first
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_eof_exits_zero() -> None:
    child = _spawn()
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
