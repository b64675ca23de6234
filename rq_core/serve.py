"""An OpenAI-compatible HTTP server (`rq serve`) and the engine it shares with `rq chat`.

The standard library's ThreadingHTTPServer, as mlx-lm's server: nothing to install, and one model serving one
request at a time needs no event loop. Requests are parsed and checked on their own threads; generation runs
one request at a time on one thread, each request in a fresh KV cache (two requests never share a cache)."""

from __future__ import annotations

import json
import math
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from rq_core.errors import RQError

MAX_BODY = 16 << 20  # a request body larger than this is refused (413)


@dataclass(frozen=True)
class Sampling:
    """How one request generates: the server's defaults (`rq serve`'s flags), then the request's fields."""

    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"


def _stop_at(text: str, start: int, stops: tuple[str, ...]) -> int:
    """The first index >= start where a stop string begins in `text`, else -1."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def _held(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may be the start of a stop string (held back while streaming)."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)


class Engine:
    """A loaded checkpoint and its KV settings; `complete` generates for one prompt at a time."""

    def __init__(self, ckpt: Any, settings: Any, *, prefill_chunk: int = 512, name: Optional[str] = None):
        from rq_core.checkpoint import context_length

        if ckpt.tokenizer is None:
            raise RQError(f"{ckpt.path} has no tokenizer.json; serving text needs one")
        self.ckpt = ckpt
        self.tokenizer = ckpt.tokenizer
        self.settings = settings
        self.prefill_chunk = prefill_chunk
        self.name = name or ckpt.path.name
        self.context = context_length(ckpt.config)
        self.lock = threading.Lock()

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise RQError("the prompt is empty (it encodes to zero tokens)")
        if self.context is not None and len(ids) >= self.context:
            raise RQError(f"the prompt is {len(ids)} tokens; the model's context is {self.context}")

    def complete(self, ids: list[int], s: Sampling,
                 on_text: Optional[Callable[[str], Optional[bool]]] = None) -> Completion:
        """Generate after `ids`; `on_text(piece)` gets the text as it completes (never a broken character nor
        a piece of a stop string); a true return from it stops generation (a client that went away)."""
        from rq_core.generate import generate
        from rq_core.tokenizer import StreamDecoder

        self.check_prompt(ids)
        stream = StreamDecoder(self.tokenizer)
        text, sent, stopped = "", 0, False

        def emit(end: int) -> bool:
            nonlocal sent
            if end <= sent:
                return False
            piece, sent = text[sent:end], end
            return bool(on_text(piece)) if on_text is not None else False

        def on_token(t: int) -> bool:
            nonlocal text, stopped
            text += stream.add(t)
            hit = _stop_at(text, sent, s.stop) if s.stop else -1
            if hit >= 0:
                text, stopped = text[:hit], True
                emit(hit)
                return True
            return emit(len(text) - _held(text, s.stop))

        with self.lock:
            model = self.ckpt.model
            res = generate(model, ids, max_tokens=s.max_tokens, temp=s.temp, top_p=s.top_p, top_k=s.top_k,
                           min_p=s.min_p, seed=s.seed, kv=self.settings, eos_token_ids=self.ckpt.eos_token_ids,
                           prefill_chunk=self.prefill_chunk, context_length=self.context, on_token=on_token,
                           cache=model.make_cache(self.settings))
        if not stopped:
            text += stream.flush()
            hit = _stop_at(text, sent, s.stop) if s.stop else -1
            stopped = hit >= 0
            if stopped:
                text = text[:hit]
            emit(len(text))
        finish = "stop" if stopped or res.stop_reason == "eos" else "length"
        return Completion(text=text, prompt_tokens=len(ids), completion_tokens=res.generated_tokens,
                          finish_reason=finish)


# ------------------------------------------------------------------------------------------------ request checks
class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def _field(body: dict, name: str, kind: type | tuple, default: Any = None, check: Optional[Callable] = None,
           what: str = "") -> Any:
    """body[name] when it is of `kind` (bool is not a number here) and passes `check`; `default` when absent/null."""
    v = body.get(name)
    if v is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    number = float in kinds and isinstance(v, int) and not isinstance(v, bool)
    if isinstance(v, bool) and bool not in kinds or not (isinstance(v, kinds) or number):
        raise BadRequest(f"'{name}' must be {what or ' or '.join(k.__name__ for k in kinds)} (got {json.dumps(v)})",
                         param=name, code="invalid_type")
    if isinstance(v, float) and not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a finite number", param=name)
    if check is not None and not check(v):
        raise BadRequest(f"'{name}' must be {what} (got {json.dumps(v)})", param=name, code="invalid_value")
    return float(v) if number else v


def _text(v: Any, param: str) -> str:
    if not isinstance(v, str):
        raise BadRequest(f"'{param}' must be a string", param=param, code="invalid_type")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{param}' is not valid UTF-8 text (a lone surrogate)", param=param) from None
    return v


def sampling_of(body: dict, base: Sampling) -> Sampling:
    """The request's sampling fields over the server's defaults, each checked (BadRequest names the field)."""
    _field(body, "n", int, 1, lambda x: x == 1, "1 (one choice per request)")
    max_tokens = _field(body, "max_completion_tokens", int, None, lambda x: x >= 1, "an integer >= 1")
    max_tokens = _field(body, "max_tokens", int, max_tokens, lambda x: x >= 1, "an integer >= 1")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    stops = tuple(_text(x, "stop") for x in stops if x)
    return Sampling(
        max_tokens=max_tokens if max_tokens is not None else base.max_tokens,
        temp=_field(body, "temperature", float, base.temp, lambda x: 0 <= x <= 100, "a number >= 0"),
        top_p=_field(body, "top_p", float, base.top_p, lambda x: 0 < x <= 1, "a number in (0, 1]"),
        top_k=_field(body, "top_k", int, base.top_k, lambda x: x >= 0, "an integer >= 0"),
        min_p=_field(body, "min_p", float, base.min_p, lambda x: 0 <= x <= 1, "a number in [0, 1]"),
        seed=_field(body, "seed", int, base.seed, lambda x: 0 <= x < 2**63, "an integer in [0, 2^63)"),
        stop=stops)


def messages_of(body: dict) -> list[dict]:
    """`messages`, checked: a non-empty list of {role, content}, content a string or a list of text parts."""
    msgs = body.get("messages")
    if msgs is None:
        raise BadRequest("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", param="messages", code="invalid_type")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"'{where}' must be an object with a string 'role'", param=where, code="invalid_type")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: only text is understood here
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text":
                    raise BadRequest(f"'{where}.content': only text parts are supported", param=f"{where}.content")
                parts.append(_text(p.get("text"), f"{where}.content"))
            content = "".join(parts)
        out.append({"role": _text(m["role"], f"{where}.role"), "content": _text(content, f"{where}.content")})
    return out


def prompt_ids_of(body: dict, tokenizer: Any) -> list[int]:
    """/v1/completions' `prompt`: a string, a list of one string, or a list of token ids."""
    p = body.get("prompt")
    if p is None:
        raise BadRequest("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        return tokenizer.encode(_text(p, "prompt"))
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < tokenizer.vocab_size for t in p):
            raise BadRequest(f"'prompt' token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        return list(p)
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt",
                     code="invalid_type")


# ------------------------------------------------------------------------------------------------ the server
class Handler(BaseHTTPRequestHandler):
    server: "Server"
    protocol_version = "HTTP/1.1"  # keep-alive for the openai client; a streamed reply closes its connection
    timeout = 60  # seconds a socket read or write may block: a client that stops reading cannot stall the queue

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (http.server's name)
        if not self.server.quiet:
            sys.stderr.write(f"rq serve: {self.address_string()} {format % args}\n")

    # -- replies
    def _send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: BadRequest) -> None:
        kind = {404: "not_found_error", 500: "server_error"}.get(e.status, "invalid_request_error")
        self._send_json(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}})

    def _guard(self, fn: Callable[[], None]) -> None:
        """Every failure a JSON error reply: a bad request 4xx, a model error 400, anything else 500."""
        try:
            fn()
        except BadRequest as e:
            self._send_error(e)
        except RQError as e:
            self._send_error(BadRequest(str(e)))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug: one line on the server's stderr, a 500 to the client, the server lives
            sys.stderr.write(f"rq serve: internal error: {type(e).__name__}: {e}\n")
            self._send_error(BadRequest(f"internal error: {type(e).__name__}", status=500))

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")

        def go() -> None:
            if path == "/health":
                self._send_json(200, {"status": "ok"})
            elif path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [
                    {"id": self.server.engine.name, "object": "model", "created": self.server.started,
                     "owned_by": "rq"}]})
            else:
                raise BadRequest(f"no such path: GET {path or '/'}", status=404)

        self._guard(go)

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")

        def go() -> None:
            chat = path == "/v1/chat/completions"
            body = self._body()  # read before any error reply, so the connection stays in step
            if not chat and path != "/v1/completions":
                raise BadRequest(f"no such path: POST {path or '/'}", status=404)
            self._complete(body, chat)

        self._guard(go)

    def _body(self) -> dict:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if n < 0 or n > MAX_BODY:
            self.close_connection = True
            raise BadRequest(f"the request body must have a Content-Length of at most {MAX_BODY} bytes",
                             status=413 if n > MAX_BODY else 400)
        raw = self.rfile.read(n)
        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object", code="invalid_json")
        return body

    # -- completions
    def _complete(self, body: dict, chat: bool) -> None:
        eng = self.server.engine
        if "model" in body and not isinstance(body["model"], str):
            raise BadRequest("'model' must be a string", param="model", code="invalid_type")
        stream = _field(body, "stream", bool, False)
        opts = _field(body, "stream_options", dict, {})
        usage_in_stream = bool(opts.get("include_usage"))
        s = sampling_of(body, self.server.defaults)
        ids = eng.chat_ids(messages_of(body)) if chat else prompt_ids_of(body, eng.tokenizer)
        try:
            eng.check_prompt(ids)
        except RQError as e:
            raise BadRequest(str(e), param="messages" if chat else "prompt", code="context_length_exceeded") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": eng.name}
        if not stream:
            c = self.server.complete(ids, s)
            choice = ({"index": 0, "message": {"role": "assistant", "content": c.text}} if chat
                      else {"index": 0, "text": c.text})
            self._send_json(200, {**head, "choices": [{**choice, "logprobs": None, "finish_reason": c.finish_reason}],
                                  "usage": _usage(c)})
            return

        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def event(obj: Any) -> None:
            self.wfile.write(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8"))
            self.wfile.flush()

        def chunk(text: Optional[str], finish: Optional[str] = None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            return {**head, "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        def on_text(piece: str) -> bool:
            try:
                event(chunk(piece))
            except OSError:  # the client went away: stop generating for it
                return True
            return False

        if chat:
            event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}]})
        try:
            c = self.server.complete(ids, s, on_text)
        except Exception as e:  # the reply has begun: the error goes as an event
            if not isinstance(e, RQError):
                sys.stderr.write(f"rq serve: internal error: {type(e).__name__}: {e}\n")
            msg, kind = (str(e), "invalid_request_error") if isinstance(e, RQError) else (
                f"internal error: {type(e).__name__}", "server_error")
            event({"error": {"message": msg, "type": kind, "param": None, "code": None}})
        else:
            event(chunk(None, c.finish_reason))
            if usage_in_stream:
                event({**head, "choices": [], "usage": _usage(c)})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def _no_constant(name: str) -> None:
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number", code="invalid_json")


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


@dataclass
class _Job:
    ids: list[int]
    sampling: Sampling
    on_text: Optional[Callable[[str], Optional[bool]]]
    done: threading.Event
    result: Optional[Completion] = None
    error: Optional[BaseException] = None


class Server(ThreadingHTTPServer):
    """Requests are read on their own threads; their generation runs on the thread that calls `run_jobs` (the one
    that loaded the model: MLX's streams belong to a thread), one job at a time, in arrival order."""

    daemon_threads = True

    def __init__(self, engine: Engine, host: str, port: int, defaults: Sampling, quiet: bool = False):
        self.engine, self.defaults, self.quiet = engine, defaults, quiet
        self.started = int(time.time())
        self.jobs: "queue.Queue[_Job]" = queue.Queue()
        super().__init__((host, port), Handler)

    def complete(self, ids: list[int], s: Sampling,
                 on_text: Optional[Callable[[str], Optional[bool]]] = None) -> Completion:
        """Engine.complete on the generation thread; waits for it (called from a request's thread)."""
        job = _Job(ids, s, on_text, threading.Event())
        self.jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def run_jobs(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                job = self.jobs.get(timeout=0.2)  # a timeout: Ctrl-C reaches this thread between jobs
            except queue.Empty:
                continue
            try:
                job.result = self.engine.complete(job.ids, job.sampling, job.on_text)
            except BaseException as e:  # handed to the request's thread, which answers with it
                job.error = e
                if not isinstance(e, Exception):
                    raise
            finally:
                job.done.set()


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8080, defaults: Sampling = Sampling(),
          on_ready: Optional[Callable[[str], None]] = None, quiet: bool = False) -> None:
    """Serve until interrupted (KeyboardInterrupt propagates); generation runs on the calling thread.
    `on_ready(url)` once the socket is listening."""
    try:
        srv = Server(engine, host, port, defaults, quiet)
    except OSError as e:
        raise RQError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    stop = threading.Event()
    http = threading.Thread(target=srv.serve_forever, name="rq-serve-http", daemon=True)
    with srv:
        http.start()
        if on_ready is not None:
            h, p = srv.server_address[:2]
            on_ready(f"http://{h}:{p}")
        try:
            srv.run_jobs(stop)
        finally:
            stop.set()
            srv.shutdown()
