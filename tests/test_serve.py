"""`rq serve`: the official openai client gets rq run's greedy text (streamed and not), two clients at once
each their own answer, stop strings and seeds honoured; bad requests get OpenAI-style JSON errors."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rq_cli.main import app

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
N = 12  # max tokens: a few steps of the bundled model
SYSTEM, USER = "You are a player.", "What news from the court?"


def _rq_run(*args: str) -> dict:
    r = CliRunner().invoke(app, ["run", *args, "--max-tokens", str(N), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def server():
    """One `rq serve` (the bundled model) on a free port (--port 0: it prints the address it got)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "rq_cli.main", "serve", "--port", "0"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                pytest.fail(f"rq serve exited ({p.wait()}) before listening")
            m = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
        assert url is not None, "rq serve did not say where it listens"
        threading.Thread(target=p.stderr.read, daemon=True).start()  # keep its request log from filling the pipe
        host, port = url[len("http://"):].split(":")
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
        yield url, host, int(port)
    finally:
        p.terminate()
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat(client, user: str = USER, **kw):
    return client.chat.completions.create(model="rq", messages=[{"role": "system", "content": SYSTEM},
                                                                {"role": "user", "content": user}],
                                          max_tokens=N, temperature=0, **kw)


def test_chat_completion_equals_rq_run(client) -> None:
    want = _rq_run("--system", SYSTEM, "--prompt", USER, "--temp", "0")
    r = _chat(client)
    assert r.choices[0].message.content == want["text"] and want["text"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if want["stop_reason"] == "length" else "stop")
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    assert r.usage.completion_tokens == want["generated_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_completion_equals_rq_run(client) -> None:
    want = _rq_run("--system", SYSTEM, "--prompt", USER, "--temp", "0")["text"]
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1  # streamed, not one piece at the end
    assert "".join(pieces) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completion_and_stop_strings(client) -> None:
    want = _rq_run("--prompt", "ROMEO:", "--temp", "0")["text"]
    r = client.completions.create(model="rq", prompt="ROMEO:", max_tokens=N, temperature=0)
    assert r.choices[0].text == want
    stop = want.strip().split()[2]  # a word inside the greedy text
    cut = want[:want.index(stop)]
    r = client.completions.create(model="rq", prompt="ROMEO:", max_tokens=N, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="rq", prompt="ROMEO:", max_tokens=N, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_seed_and_sampling_fields(client) -> None:
    """temperature + seed sample as rq run does with the same seed; top_k=1 is greedy at any temperature."""
    want = _rq_run("--prompt", "ROMEO:", "--temp", "1.5", "--seed", "7")["text"]
    kw = dict(model="rq", prompt="ROMEO:", max_tokens=N, temperature=1.5, seed=7)
    assert client.completions.create(**kw).choices[0].text == want
    greedy = _rq_run("--prompt", "ROMEO:", "--temp", "0")["text"]
    r = client.completions.create(**kw, extra_body={"top_k": 1, "min_p": 0.5})
    assert r.choices[0].text == greedy


def test_two_clients_at_once_get_their_own_answers(client) -> None:
    users = ["What news from the court?", "Where is the king?"]
    want = [_rq_run("--system", SYSTEM, "--prompt", u, "--temp", "0")["text"] for u in users]
    assert want[0] != want[1]
    got: dict[int, str] = {}
    go = threading.Barrier(2)

    def ask(i: int) -> None:
        go.wait()
        got[i] = "".join(c.choices[0].delta.content or "" for c in _chat(client, users[i], stream=True) if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {0: want[0], 1: want[1]}


def test_models_lists_the_served_model(client) -> None:
    assert [m.id for m in client.models.list().data] == ["default_model"]


def _post(server, path: str, body: bytes) -> tuple[int, dict]:
    c = http.client.HTTPConnection(server[1], server[2], timeout=30)
    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.getheader("Content-Type") == "application/json"
    return r.status, json.loads(r.read())


@pytest.mark.parametrize("body,param", [
    (b'{"messages": [{"role": "user", "content": "hi"}', None),  # malformed JSON
    (b'{"max_tokens": 3}', "messages"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": 1}', "stream"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}', "stop"),
    (b'[1, 2]', None),
])
def test_bad_requests_get_json_errors(server, body: bytes, param) -> None:
    status, out = _post(server, "/v1/chat/completions", body)
    assert status == 400
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["message"]
    assert out["error"]["param"] == param


def test_prompt_longer_than_the_context_is_400(server) -> None:
    status, out = _post(server, "/v1/completions", json.dumps({"prompt": [1] * 5000, "max_tokens": 2}).encode())
    assert status == 400 and out["error"]["code"] == "context_length_exceeded" and out["error"]["param"] == "prompt"


def test_unknown_path_is_404_json(server) -> None:
    status, out = _post(server, "/v1/nothing", b"{}")
    assert status == 404 and out["error"]["message"]
    # the server still answers afterwards
    status, out = _post(server, "/v1/completions", json.dumps({"prompt": "ROMEO:", "max_tokens": 2}).encode())
    assert status == 200 and out["usage"]["completion_tokens"] == 2
