"""Pipeline parallelism over `mx.distributed` (the ring backend over TCP, started by `mlx.launch`).

Each rank holds a contiguous slice of the layers, balanced by bytes; as in mlx-lm's pipelined DeepSeek, the
last rank holds the first layers and rank 0 the last ones. Every rank embeds the tokens (cheap) and holds the
norm and the head, so every rank runs the same generation loop: rank r receives the hidden states from rank
r + 1, runs its layers with its own caches (a Mamba state or a sliding window stays where its layer is) and
sends them to rank r - 1; an all_gather then hands rank 0's final states to every rank, so all sample the same
token. Only rank 0 prints. The layers a rank does not hold are `Remote` placeholders: their lazily loaded
weights are dropped before anything is evaluated, so a rank never reads another rank's tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

import mlx.core as mx
import mlx.nn as nn

from rq_core.errors import RQError
from rq_core.models import text_config
from rq_core.models.base import Remote, decode_layer

T = TypeVar("T")
TIMEOUT_ENV = "RQ_PEER_TIMEOUT"  # seconds without progress before a rank gives up (default DEFAULT_TIMEOUT)
DEFAULT_TIMEOUT = 300.0
_MSG = 480  # bytes of an error message a rank shares with the others
_DIGEST = 32


def launched() -> bool:
    """True when started by `mlx.launch` (or its environment by hand): the ring backend's MLX_RANK is set."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ


# ------------------------------------------------------------------------------------------- watchdog
class Watchdog:
    """Exits the process with one error line when `beat()` was not called for `timeout` seconds: a peer that
    stopped without closing its connection would otherwise leave the others waiting forever."""

    def __init__(self, timeout: float, err: Any):
        self.timeout, self._err = timeout, err
        self._last = time.monotonic()
        threading.Thread(target=self._watch, daemon=True, name="rq-watchdog").start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        while True:  # a daemon thread: it ends with the process
            time.sleep(min(0.5, self.timeout / 4))
            if time.monotonic() - self._last > self.timeout:
                self._err.write(f"error: no progress from the other ranks for {self.timeout:g} s (a peer stopped "
                                f"or the network is down; {TIMEOUT_ENV} sets the limit)\n")
                self._err.flush()
                os._exit(1)


@dataclasses.dataclass(frozen=True)
class Rank:
    """This process' place in the group, and its watchdog."""

    group: Any
    rank: int
    size: int
    watchdog: Watchdog


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        t = float(raw)
    except ValueError:
        t = -1.0
    if not t > 0 or t != t or t == float("inf"):
        raise RQError(f"{TIMEOUT_ENV}={raw!r}: give a number of seconds > 0")
    return t


def start() -> Optional[Rank]:
    """Join the group (`mx.distributed.init`); None when there is one process. Other ranks than 0 are silenced
    (their output would repeat rank 0's); the ring backend's own messages go nowhere, ours to the saved stderr."""
    timeout = _timeout()
    try:
        group = mx.distributed.init(strict=True)
    except (RuntimeError, ValueError) as e:
        raise RQError(f"cannot join the distributed group: {str(e).splitlines()[0] if str(e) else e}")
    if group.size() == 1:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    if group.rank() != 0:
        os.dup2(devnull, 1)
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(os.devnull, "w")
    else:
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    os.dup2(devnull, 2)
    return Rank(group, group.rank(), group.size(), Watchdog(timeout, sys.stderr))


# ---------------------------------------------------------------------------------------------- split
def layer_bytes(model: nn.Module) -> list[int]:
    """Bytes of each layer's parameters (lazy arrays: nothing is read)."""
    from mlx.utils import tree_flatten

    return [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in model.layers]


def kept_together(model: nn.Module) -> set[int]:
    """Cut positions c (between layer c-1 and c) a split may not use: Gemma 4's KV-sharing layers reuse the K/V
    their source layer computes in the same forward pass, so a source and its sharers stay on one rank."""
    src = getattr(getattr(model, "args", None), "kv_source", None) or []
    return {c for i, s in enumerate(src) if s is not None for c in range(s + 1, i + 1)}


def split(sizes: Sequence[int], ranks: int, forbidden: set[int] = frozenset()) -> list[tuple[int, int]]:
    """Contiguous slices of the layers, one per rank, the largest slice's bytes as small as it can be (no cut
    at a `forbidden` position); element r is rank r's [start, end): the last rank holds the first layers."""
    n = len(sizes)
    cuts = [c for c in range(1, n) if c not in forbidden]
    if ranks > len(cuts) + 1:
        why = " (Gemma 4's KV-sharing layers stay on their source layer's rank)" if forbidden else ""
        raise RQError(f"{ranks} ranks: this model's {n} layers split into at most {len(cuts) + 1} slices{why}")
    pre = [0]
    for s in sizes:
        pre.append(pre[-1] + s)
    ends = cuts + [n]
    # best[k][j]: the least largest slice over k slices covering layers [0, j), j in ends; how[k][j]: its last cut
    best: dict[int, int] = {j: pre[j] for j in ends}
    how: list[dict[int, int]] = [{j: 0 for j in ends}]
    for _ in range(1, ranks):
        nxt: dict[int, int] = {}
        back: dict[int, int] = {}
        for j in ends:
            for i in cuts:
                if i >= j or i not in best:
                    continue
                v = max(best[i], pre[j] - pre[i])
                if j not in nxt or v < nxt[j]:
                    nxt[j], back[j] = v, i
        best = nxt
        how.append(back)
    bounds, j = [n], n
    for k in range(ranks - 1, 0, -1):
        j = how[k][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    slices = [(bounds[i], bounds[i + 1]) for i in range(ranks)]
    return slices[::-1]


def shared_bytes(model: nn.Module) -> int:
    """Bytes every rank holds besides its layers: embeddings, final norm, head."""
    from mlx.utils import tree_flatten

    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return total - sum(layer_bytes(model))


def plan_split(model: nn.Module, ranks: int) -> list[dict[str, Any]]:
    """Per rank: its layers [start, end), their bytes, and the bytes every rank holds besides (no weight read)."""
    sizes = layer_bytes(model)
    shared = shared_bytes(model)
    return [{"rank": r, "layers": [a, b], "layer_bytes": sum(sizes[a:b]), "shared_bytes": shared,
             "total_bytes": sum(sizes[a:b]) + shared}
            for r, (a, b) in enumerate(split(sizes, ranks, kept_together(model)))]


def render_split(rows: list[dict[str, Any]]) -> str:
    from rq_core.paging.planner import fmt_bytes

    lines = [f"{'rank':>4}  {'layers':>9}  {'their bytes':>11}  {'+ embed/head':>12}  {'total':>9}"]
    for r in rows:
        a, b = r["layers"]
        lines.append(f"{r['rank']:>4}  {f'{a}-{b - 1}':>9}  {fmt_bytes(r['layer_bytes']):>11}  "
                     f"{fmt_bytes(r['shared_bytes']):>12}  {fmt_bytes(r['total_bytes']):>9}")
    lines.append("rank 0 holds the last layers and prints; the last rank embeds the prompt first")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- pipeline
class _Link:
    """Stands in the cache slot of a layer another rank holds: its `state` is this slice's output (after the
    send), so a prefill chunk evaluated for its caches alone (generate) still receives and hands on its hidden
    states, also on a rank whose layers keep no state (MLP / MoE blocks). It has no `mark()`: a step that
    crossed ranks cannot be taken back, so an expert pager here never speculates."""

    nbytes = fp16_nbytes = offset = 0

    def __init__(self, out: mx.array):
        self.state = [out]

    def end_prefill(self) -> None:
        pass

    def trim(self, n: int) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """This rank's slice [start, end) of `layers` and how the hidden states reach it and leave it."""

    group: Any
    rank: int
    size: int
    start: int
    end: int
    watchdog: Optional[Watchdog] = None

    def run(self, layers: list, h: mx.array, cache: Optional[list], call: Optional[Callable]) -> mx.array:
        if self.watchdog is not None:
            self.watchdog.beat()  # a forward pass is built only after the previous step was read
        if self.start > 0:  # the earlier layers are on rank + 1
            h = mx.distributed.recv_like(h, self.rank + 1, group=self.group)
        for i in range(self.start, self.end):
            c = cache[i] if cache is not None else None
            if call is not None:
                h = call(i, layers[i], h, c)
            else:
                out = decode_layer(layers[i], h, c)
                h = layers[i](h, c) if out is None else out
        if self.end < len(layers):  # the later layers are on rank - 1
            h = mx.distributed.send(h, self.rank - 1, group=self.group)
        if cache is not None:  # a slot of a layer held elsewhere: this slice's output, so its recv/send run
            cache[self.start - 1 if self.start > 0 else self.end] = _Link(h)
        # rank 0's states (the last layers') to every rank, kept in the graph
        return mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]


def _empty(layer: nn.Module) -> None:
    """Drop a layer's (lazy, never evaluated) weights: nothing of it is read or kept."""
    from mlx.utils import tree_map

    layer.update(tree_map(lambda _: mx.zeros((0,)), layer.parameters()))


def shard(model: nn.Module, rank: Rank) -> Pipeline:
    """Keep this rank's slice of `model`'s layers; the others become `Remote` (weights dropped)."""
    sizes = layer_bytes(model)
    start, end = split(sizes, rank.size, kept_together(model))[rank.rank]
    pipe = Pipeline(rank.group, rank.rank, rank.size, start, end, rank.watchdog)
    layers = model.layers
    for i, layer in enumerate(layers):
        if not start <= i < end:
            _empty(layer)
            layers[i] = Remote(layer, pipe)
    return pipe


def pipeline_of(model: nn.Module) -> Optional[Pipeline]:
    """The Pipeline a sharded model runs (None: all layers here)."""
    from rq_core.models.base import _pipeline

    return _pipeline(model.layers)


def slice_config(config: dict, model: nn.Module, start: int, end: int) -> dict:
    """The config as the memory planner should see one rank: its layers only (KV bytes, MoE layers)."""
    tc = dict(text_config(config))
    args = getattr(model, "args", None)
    n = end - start
    if "hybrid_override_pattern" in tc:
        tc["hybrid_override_pattern"] = tc["hybrid_override_pattern"][start:end]
    types = getattr(args, "layer_types", None) or tc.get("layer_types")
    if types:
        tc["layer_types"] = list(types)[start:end]
    if "mlp_only_layers" in tc or "decoder_sparse_step" in tc:  # Qwen: which layers are dense, as indices here
        step = tc.get("decoder_sparse_step", 1) or 1
        only = set(tc.get("mlp_only_layers") or [])
        tc["mlp_only_layers"] = [i - start for i in range(start, end) if i in only or (i + 1) % step]
        tc["decoder_sparse_step"] = 1
    tc["num_hidden_layers"] = n
    tc["model_type"] = config.get("model_type")  # the checkpoint's (a multimodal Gemma 4 says gemma4)
    tc.pop("text_config", None)
    return tc


def shard_checkpoint(ckpt: Any, rank: Rank) -> Any:
    """`shard` the checkpoint's model; a copy of the checkpoint whose config is this rank's (slice_config)."""
    pipe = shard(ckpt.model, rank)
    return dataclasses.replace(ckpt, config=slice_config(ckpt.config, ckpt.model, pipe.start, pipe.end))


# ------------------------------------------------------------------------------------------ agreement
def fingerprint(ckpt: Any, *extra: Any) -> bytes:
    """A hash of what every rank must share: rq's and MLX's versions, config.json, the weight files' headers and
    sizes, the tokenizer's size, and `extra` (the prompt's ids and the run's flags)."""
    from rq_core import __version__
    from rq_core.shards import read_header, weight_files

    h = hashlib.sha256(f"rq {__version__} mlx {mx.__version__}".encode())
    h.update(json.dumps(ckpt.config, sort_keys=True, default=str).encode())
    for f in weight_files(ckpt.path):
        hdr, _ = read_header(f)
        h.update(json.dumps([f.name, f.stat().st_size, hdr], sort_keys=True).encode())
    tok = ckpt.path / "tokenizer.json"
    h.update(str(tok.stat().st_size if tok.is_file() else -1).encode())
    h.update(repr(extra).encode())
    return h.digest()


def _exchange(rank: Rank, digest: bytes, error: Optional[str]) -> list[tuple[bytes, Optional[str]]]:
    """Every rank's (digest, error or None), by one all_gather."""
    msg = (error or "").encode()[:_MSG]
    row = bytes([0 if error is None else 1]) + hashlib.sha256(digest).digest() + msg.ljust(_MSG, b"\0")
    mine = mx.array(list(row), dtype=mx.int32)  # int32: what every backend gathers
    rows = mx.distributed.all_gather(mine, group=rank.group)
    mx.eval(rows)
    _barrier(rank)
    flat = bytes(rows.tolist())
    width = len(row)
    out = []
    for r in range(rank.size):
        b = flat[r * width:(r + 1) * width]
        err = b[1 + _DIGEST:].rstrip(b"\0").decode(errors="replace") if b[0] else None
        out.append((b[1:1 + _DIGEST], err))
    return out


def agree(rank: Optional[Rank], fn: Callable[[], T], digest: Optional[Callable[[T], bytes]] = None) -> T:
    """fn() on every rank, then one exchange: when any rank failed, every rank raises RQError (rank 0's line
    names the first that failed), and when the `digest`s of the results differ, every rank refuses."""
    if rank is None:
        return fn()
    rank.watchdog.beat()
    out: Any = None
    error = None
    try:
        out = fn()
        d = digest(out) if digest is not None else b""
    except RQError as e:
        error, d = str(e), b""
    except OSError as e:
        error, d = f"{e.strerror or e}: {e.filename}" if e.filename else str(e), b""
    except Exception as e:  # a bug on one rank must not leave the others waiting for the watchdog
        error, d = f"internal error: {type(e).__name__}: {e}", b""
    rows = _exchange(rank, d, error)
    rank.watchdog.beat()
    failed = next((f"{err}" if r == rank.rank == 0 else f"rank {r}: {err}" for r, (_, err) in enumerate(rows)
                   if err is not None), None)
    if failed is None:
        r = next((r for r, (dr, _) in enumerate(rows) if dr != rows[0][0]), None)
        if r is not None:
            failed = (f"rank {r} has another checkpoint, flags or version than rank 0 (config, weights, tokenizer, "
                      "prompt, sampling, or the rq / MLX version differ): every rank must run the same model and "
                      "command with the same install")
    if failed is not None:
        raise RQError(failed)
    return out


def _barrier(rank: Rank) -> None:
    """Wait until every rank reached here, so none exits while its last collective is still in flight to a peer;
    a peer gone after that collective ended is no error (what this rank needed from it has arrived)."""
    try:
        mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=rank.group))
    except RuntimeError:
        pass


def guard(rank: Optional[Rank], fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` (generate) with a lost peer as one RQError line, and every rank waiting for the others at the end."""
    if rank is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> T:
        try:
            out = fn(*args, **kwargs)
            mx.synchronize()  # a step queued before an EOS still runs its send/recv on every rank
        except RuntimeError as e:
            raise RQError(f"a peer stopped mid-run ({str(e).splitlines()[0] if str(e) else 'connection lost'})")
        finally:
            rank.watchdog.beat()
        _barrier(rank)
        return out

    return run
