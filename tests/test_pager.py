"""The expert pager: exact tokens with a quarter of the experts resident, peak memory under the budget,
hit rate reported; the mmap policy refused in one line; prefill with more distinct experts than slots."""

import contextlib
import json
import time
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from _tiny_models import TINY, available, make_tiny
from rq_core.quant import recipe
from rq_core.cache.kv_cache import KVSettings
from rq_core.checkpoint import load
from rq_core.errors import RQError
from rq_core.generate import generate
from rq_core.paging.pack import pack
from rq_core.paging.pager import ExpertPager, budget_for_slots, slots_for_budget
from rq_core.quant.quantize import quantize

RECIPE = Path(__file__).parent / "data" / "tiny-rtn.toml"
PROMPT = list(range(3, 43))  # 40 tokens: prefill routes to every expert


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("pager")
    out = {}
    for fam in TINY:
        if available(fam):
            quantize(make_tiny(fam, root / f"{fam}-src"), recipe.load(RECIPE), root / fam)
            pack(root / fam)
            out[fam] = root / fam
    return out


@pytest.mark.parametrize("family", list(TINY))
def test_quarter_of_experts_gives_identical_tokens(packed, family, monkeypatch):
    """2 of 8 experts a layer: the all-resident tokens; a prompt chunk whose experts do not fit runs in passes, each
    computing only the rows of the experts it holds (every (token, k) row once over a call's passes)."""
    from rq_core.models.base import SwitchGLU
    from rq_core.paging.pages import expert_banks

    if family not in packed:
        pytest.skip(f"model family {family} not in this build yet")
    ck = packed[family]
    ref = generate(load(ck, tokenizer=False).model, PROMPT, max_tokens=24, seed=0, prefill_chunk=16)
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=2, verify=True)  # 2 of 8 experts per layer
    rows, calls = [], []
    grouped = SwitchGLU.compute_grouped

    def count(self, x, idx):
        rows.append(idx.size)
        return grouped(self, x, idx)

    monkeypatch.setattr(SwitchGLU, "compute_grouped", count)
    for module in expert_banks(model).values():  # each a class of its own, the pager's
        cls = type(module)
        paged_call = cls.__call__

        def wrapped(self, x, indices, _call=paged_call):
            n = len(rows)
            y = _call(self, x, indices)
            calls.append((indices.size, rows[n:]))
            return y

        monkeypatch.setattr(cls, "__call__", wrapped)
    got = generate(model, PROMPT, max_tokens=24, seed=0, prefill_chunk=16)
    st = pager.report()
    assert got.tokens == ref.tokens
    passed = [(n, r) for n, r in calls if len(r) > 1]  # calls served in passes
    assert passed and all(sum(r) == n for n, r in passed), passed
    assert st.misses > 0 and st.bytes_read > 0
    assert st.slots == 2 and st.hits > 0 and 0 < st.hit_rate < 1 and st.evictions > 0
    assert st.resident_bytes > 0
    # a layer's misses are read in one batch: fewer batches than misses
    assert 0 < st.read_batches < st.misses and st.host_syncs > 0
    pager.close()


def _paged_and_resident(ck, slots: int, speculate: str, **gen):
    """(all-resident generation, paged generation, the pager's stats) of PROMPT with the same settings."""
    ref = generate(load(ck, tokenizer=False).model, PROMPT, seed=0, prefill_chunk=16, **gen)
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=slots, speculate=speculate)
    got = generate(model, PROMPT, seed=0, prefill_chunk=16, **gen)
    st = pager.report()
    pager.close()
    return ref, got, st


def test_pages_read_in_pieces_give_identical_tokens(packed, monkeypatch):
    """Where a layer misses fewer experts than there are read threads, each page is read in pieces by several
    threads (the tiny pages are cut here as a real model's are): the all-resident tokens, every page checked."""
    from rq_core.paging import pager as pager_mod

    monkeypatch.setattr(pager_mod, "SPAN_MIN", 64)
    spans = []
    real = pager_mod._Layer._read_span
    monkeypatch.setattr(pager_mod._Layer, "_read_span",
                        lambda self, e, j, a, b, progress=None: (spans.append(b - a), real(self, e, j, a, b, progress))[1])
    ck = packed["qwen3_moe"]
    ref, got, st = _paged_and_resident(ck, 2, "off", max_tokens=16, temp=1.0)
    assert got.tokens == ref.tokens and st.misses > 0
    assert len(spans) > st.misses and sum(spans) == st.bytes_read


@pytest.mark.parametrize("family", list(TINY))
def test_layer_by_layer_steps_give_identical_tokens(packed, family):
    """speculate="off": a MoE layer's second graph is built before its routing is read, and its experts come in
    before that graph runs (at the next MoE layer's read, at an evaluation inside the step, or for the last one
    before the step is queued): the all-resident tokens, greedy and sampled. A model called a token at a time
    outside generate runs its paged layers as written, each evaluated: the all-resident logits."""
    if family not in packed:
        pytest.skip(f"model family {family} not in this build yet")
    ck = packed[family]
    for temp in (0.0, 1.0):
        ref, got, st = _paged_and_resident(ck, 2, "off", max_tokens=16, temp=temp)
        assert got.tokens == ref.tokens, temp
        assert st.speculated == 0 and st.misses > 0 and st.evictions > 0
    # an IsoQuant cache codes its fp16 window (33 tokens) in chunks of 16 here, evaluating between them in the middle of
    # a step: the pending MoE layer's experts are written in first (base.settle_step)
    kv = KVSettings(mode="isoquant3", fp16_window=32, edge_layers=1)
    ref, got, _ = _paged_and_resident(ck, 2, "off", max_tokens=40, kv=kv, temp=1.0)
    assert got.tokens == ref.tokens
    outs = []
    for paged in (False, True):
        model = load(ck, tokenizer=False).model
        pager = ExpertPager(model, ck, slots=2, speculate="off") if paged else None
        cache = model.make_cache(KVSettings(mode="fp16"))
        mx.eval(model(mx.array([PROMPT[:12]]), cache=cache))
        outs.append([model(mx.array([[t]]), cache=cache) for t in (5, 7, 9, 11)])
        mx.eval(outs[-1])
        if pager is not None:
            assert pager.report().misses > 0
            pager.close()
    for a, b in zip(*outs):
        assert mx.allclose(a, b, atol=1e-5).item()


def test_copier_writes_and_reads_through_the_copy_engine_where_the_cuda_runtime_is_found(monkeypatch):
    """transfer.Copier: numpy views off CUDA; on CUDA copies between the host and the arrays' own memory (the
    pointers and sizes asked) queued on a non-blocking stream of the copier's own (the legacy one where the runtime
    refuses a stream), their sources kept until one sync of that stream a fence after writes (none without), a read
    waited for, the numpy view where a copy is refused (the runtime's error cleared), page-locked staging memory
    (cudaHostAlloc) where the runtime gives it, and all of it freed once, by close or when the copier is dropped."""
    import ctypes
    import weakref

    import numpy as np

    from rq_core.paging import transfer

    a = mx.zeros((4, 6), mx.float32)
    raw = transfer.Copier.raw(a)
    assert raw.nbytes == a.nbytes and transfer.Copier.address(a) == raw.ctypes.data
    if not mx.cuda.is_available():
        cp = transfer.Copier()
        assert not cp.device_copies
        cp.write(raw, 24, np.arange(6, dtype=np.float32))
        cp.fence()
        assert a[1].tolist() == list(range(6))
        assert cp.read(a[1:2]).tolist() == [list(range(6))]
        with pytest.raises(ValueError):
            cp.write(raw, raw.nbytes - 4, np.zeros(2, np.float32))

    class Function:
        def __init__(self, fn):
            self.fn, self.argtypes = fn, None

        def __call__(self, *args):
            return self.fn(*args)

    class Runtime:
        """A CUDA runtime whose queued copies land when their stream is synchronized."""

        def __init__(self, rc, stream_rc):
            self.rc, self.stream_rc, self.syncs, self.cleared, self.held, self.freed = rc, stream_rc, 0, 0, [], []
            self.queued, self.pending = [], []  # cudaMemcpyAsync's calls: (dst, src, n, kind, stream); not landed
            self.streams, self.destroyed = [], []  # cudaStreamSynchronize's streams; cudaStreamDestroy's
            self.cudaMemcpyAsync = Function(self._copy_async)
            self.cudaStreamSynchronize = Function(self._sync)
            self.cudaHostAlloc = Function(self._alloc)
            self.cudaHostGetDevicePointer = Function(self._device_pointer)
            self.cudaFreeHost = Function(self.freed.append)
            self.cudaStreamCreateWithFlags = Function(self._stream)
            self.cudaStreamDestroy = Function(self.destroyed.append)

        def _stream(self, ref, flags):
            if self.stream_rc:
                return self.stream_rc
            assert flags == transfer.STREAM_NON_BLOCKING  # ordered with nothing else: not MLX's, not the legacy one
            ref._obj.value = STREAM
            return 0

        def _alloc(self, ref, n, flags):
            if self.rc:
                return self.rc
            buf = ctypes.create_string_buffer(n)
            self.held.append(buf)
            ref._obj.value = ctypes.addressof(buf)
            return 0

        def _copy_async(self, dst, src, n, kind, stream):
            self.queued.append((dst, src, n, kind, stream))
            if self.rc == 0:
                self.pending.append((dst, src, n))
            return self.rc

        def _sync(self, stream):
            self.syncs += 1
            self.streams.append(stream)
            for dst, src, n in self.pending:
                ctypes.memmove(dst, src, n)
            self.pending = []
            return 0

        def _device_pointer(self, ref, p, flags):
            ref._obj.value = p + 4096 if self.rc == 0 else None  # the device's address of mapped host memory
            return self.rc

        def cudaGetLastError(self):
            self.cleared += 1
            return 0

    STREAM = 0x5150
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    for rc, stream_rc in ((0, 0), (0, 1), (1, 1)):  # all given; no stream of its own; every call refused
        raw[:] = 0
        rt = Runtime(rc, stream_rc)
        monkeypatch.setattr(transfer, "_cudart", lambda rt=rt: rt)
        cp = transfer.Copier()
        stream = None if stream_rc else STREAM
        assert cp.device_copies and cp.own_stream == (stream_rc == 0) and rt.cleared == stream_rc
        # pointers and sizes, not Python objects: ctypes told the argument types before any call
        assert all(getattr(rt, f).argtypes for f in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaHostAlloc",
                                                     "cudaHostGetDevicePointer", "cudaFreeHost",
                                                     "cudaStreamCreateWithFlags", "cudaStreamDestroy"))
        cleared = rt.cleared
        src = np.full(6, 7.0 + rc, np.float32)
        gone = weakref.ref(src)
        cp.write(raw, 48, src)
        assert rt.queued[-1] == (raw.ctypes.data + 48, src.ctypes.data, 24, transfer.MEMCPY_DEFAULT, stream)
        del src  # a queued copy's source lives until the fence
        assert (gone() is not None) == (rc == 0) and a[2].tolist() == ([0.0] * 6 if rc == 0 else [8.0] * 6)  # not landed yet
        cp.fence()
        cp.fence()
        assert gone() is None and a[2].tolist() == [7.0 + rc] * 6  # landed (by the stand-in, else the numpy view)
        assert rt.syncs == (rc == 0) and rt.cleared == cleared + rc
        row = a[2:3]
        got = cp.read(row)  # waited for: the bytes are there when it returns
        assert got.tolist() == [[7.0 + rc] * 6]
        assert rt.queued[-1][1:3] == (transfer.Copier.address(row), 24) and rt.syncs == 2 * (rc == 0)
        assert (rt.queued[-1][0] == got.ctypes.data) == (rc == 0) and rt.cleared == cleared + 2 * rc  # np.array
        buf = cp.host_buffer(64)  # page-locked where the runtime gives it, else plain memory
        assert buf.nbytes == 64 and cp.pinned == (rc == 0) and rt.cleared == cleared + 3 * rc
        held = [ctypes.addressof(b) for b in rt.held]
        assert ([buf.ctypes.data] == held) == (rc == 0) and len(held) == (rc == 0)
        buf[24:32] = np.array([9.0, 9.5], np.float32).view(np.uint8)
        cp.copy(raw.ctypes.data + 72, buf.ctypes.data + 24, 8)  # by address, the caller keeping the source
        assert rt.queued[-1] == (raw.ctypes.data + 72, buf.ctypes.data + 24, 8, transfer.MEMCPY_DEFAULT, stream)
        cp.fence()
        assert a[3, :2].tolist() == [9.0, 9.5]  # landed at the fence (by the stand-in), at once where refused
        buf[:24] = np.full(6, 3.0, np.float32).view(np.uint8)
        syncs = rt.syncs
        cp.write(raw, 0, buf[:24])
        assert rt.queued[-1] == (raw.ctypes.data, buf.ctypes.data, 24, transfer.MEMCPY_DEFAULT, stream)
        if rc == 0:  # memory the device reads and writes in place: zeroed, and its device address
            box, dev = cp.mapped_buffer(40)
            assert box.nbytes == 40 and not box.any() and dev == box.ctypes.data + 4096
            held = [ctypes.addressof(b) for b in rt.held]
        else:
            with pytest.raises(RQError, match="page-locked"):
                cp.mapped_buffer(40)
        cp.close()  # the queued copy still reads the buffer: close waits for it before freeing it
        assert a[0].tolist() == [3.0] * 6 and rt.syncs == syncs + 1
        assert rt.freed == held and not cp.pinned and rt.destroyed == [STREAM] * (stream_rc == 0)
        assert not cp.device_copies and not cp.own_stream  # final: nothing of it is used again
        cp.close()
        del cp
        assert rt.freed == held and rt.destroyed == [STREAM] * (stream_rc == 0)  # once
        # the fence waits for the copies' stream alone: never for MLX's, where a queued step may wait on the host
        assert rt.streams == [stream] * rt.syncs
    rt = Runtime(0, 0)
    monkeypatch.setattr(transfer, "_cudart", lambda: rt)
    cp = transfer.Copier()
    cp.host_buffer(32)
    del cp  # never closed: freed when dropped, its stream destroyed
    assert len(rt.freed) == 1 and rt.destroyed == [STREAM]


def _buffer(a: mx.array) -> int:
    """Where an array's bytes are (a slot write that copied its bank would move them)."""
    import numpy as np

    return np.frombuffer(memoryview(a), np.uint8).ctypes.data


def _paged_logits(model, graphs: bool, pager=None, kv: KVSettings | None = None,
                  prompt: int = 12) -> tuple[list, int, int]:
    """Logits of 10 decode steps after a `prompt`-token prompt (with `pager`, through its decode_step; `kv`: the
    cache, fp16 by default); with `pager`: (its misses in steps 3-10, bank tensors whose buffer moved in a step that
    missed)."""
    from rq_core.models.base import layers_as_written

    cache = model.make_cache(kv or KVSettings(mode="fp16"))
    model(mx.array([PROMPT[:prompt]]), cache=cache)
    for c in cache:
        c.end_prefill()
    out, misses, moved = [], 0, 0

    def banks() -> list:
        return [_buffer(l.module[t["name"].split(".")[0]][t["name"].split(".")[1]])
                for l in pager.layers.values() for t in l.meta["tensors"]]

    def build(t: int):  # a step as generate builds it: the pager's last layer settled before it is queued
        def run(key):
            logits = model(mx.array([[t]]), cache=cache)
            pager.settle()
            return logits, logits[0, -1, :2]
        return run

    with contextlib.nullcontext() if graphs else layers_as_written(model):
        for n, t in enumerate((5, 11, 17, 23, 29, 31, 37, 41, 43, 47)):
            before = (pager.stats.misses, banks()) if pager is not None else None
            out.append(model(mx.array([[t]]), cache=cache) if pager is None else pager.decode_step(build(t), cache)[0])
            mx.eval(out[-1])
            if pager is not None and n >= 2 and pager.stats.misses > before[0]:  # the graphs are traced by now
                misses += pager.stats.misses - before[0]
                moved += sum(a != b for a, b in zip(before[1], banks()))
    return out, misses, moved


@pytest.fixture(scope="module")
def gemma_ple_packed(tmp_path_factory):
    """Gemma 4 with per-layer inputs and a KV-sharing layer (what the plain tiny config leaves out), packed."""
    import copy

    cfg = copy.deepcopy(TINY["gemma4"])
    cfg["text_config"].update({"hidden_size_per_layer_input": 32, "vocab_size_per_layer_input": 320,
                               "num_kv_shared_layers": 1, "num_hidden_layers": 4,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                               "full_attention"]})
    root = tmp_path_factory.mktemp("gemma_ple")
    quantize(make_tiny("gemma4", root / "src", config=cfg), recipe.load(RECIPE), root / "q")
    pack(root / "q")
    return root / "q"


@pytest.mark.parametrize("family", [*TINY, "gemma4-ple-shared"])
def test_paged_decode_steps_replay_graphs_that_read_the_slots_as_they_are_now(packed, gemma_ple_packed, family):
    """A paged decode step runs each MoE layer as two traced graphs with the routing read between them; the second
    reads the banks as inputs, so experts written into slots after the trace are the ones it uses: its logits equal
    those of the layers run op by op, paged, and those of the all-resident model. The slot writes stay in place (a
    copied bank would cost its whole size in memory)."""
    ck = gemma_ple_packed if family == "gemma4-ple-shared" else packed.get(family)
    if ck is None:
        pytest.skip(f"model family {family} not in this build yet")
    resident, _, _ = _paged_logits(load(ck, tokenizer=False).model, graphs=True)
    runs = {}
    for graphs in (False, True):
        model = load(ck, tokenizer=False).model
        pager = ExpertPager(model, ck, slots=2, speculate="off")
        runs[graphs], misses, moved = _paged_logits(model, graphs, pager)
        traced = [n for m in model.modules() for n, f in (m.__dict__.get("_decode_graphs") or {}).items() if f]
        assert bool(traced) == graphs
        if graphs:
            assert {"moe_output", "mlp_output"} & set(traced), traced
            assert "attention_output_and_mlp" not in traced and "feed_forward" not in traced or family == "nemotron_h"
        assert misses > 0 and moved == 0, (misses, moved)  # slots rewritten while the graphs replay, in place
        pager.close()
    for a, b, c in zip(resident, runs[False], runs[True]):
        assert mx.array_equal(a, b) and mx.array_equal(b, c), (float(mx.abs(a - b).max()), float(mx.abs(b - c).max()))


@pytest.mark.parametrize("family", list(TINY))
def test_fewer_slots_than_a_tokens_experts_and_batches_run_as_written(packed, family):
    """One slot for a top-2 router, and two sequences in one call: a decode step's experts do not fit the slots at
    once, so the layer runs as written (the pager serves them in passes): the logits of the all-resident model."""
    if family not in packed:
        pytest.skip(f"model family {family} not in this build yet")
    ck = packed[family]
    steps = ([[5], [9]], [[11], [3]], [[17], [23]])
    for slots, rows in ((1, 1), (2, 2)):
        want, got = [], []
        for out, paged in ((want, False), (got, True)):
            model = load(ck, tokenizer=False).model
            pager = ExpertPager(model, ck, slots=slots) if paged else None
            cache = model.make_cache(KVSettings(mode="fp16"))
            model(mx.array([PROMPT[:12]] * rows), cache=cache)
            for c in cache:
                c.end_prefill()
            for t in steps:
                out.append(model(mx.array(t[:rows]), cache=cache))
                mx.eval(out[-1])
            if pager is not None:
                assert pager.stats.misses > 0
                pager.close()
        for a, b in zip(want, got):
            assert mx.array_equal(a, b), (slots, rows, float(mx.abs(a - b).max()))


SPEC_SLOTS = {"nemotron_h": 6, "gemma4-ple-shared": 6}  # slots a layer at which some speculated steps hit and some miss


def _resume_starts(monkeypatch) -> list:
    """The layers the pager's speculated steps run again from, as they happen."""
    import rq_core.paging.pager as pager_mod

    starts = []

    class Seen(pager_mod.StepResume):
        def __setattr__(self, k, v):
            if k == "start" and "start" in self.__dict__:
                starts.append(v)
            super().__setattr__(k, v)

    monkeypatch.setattr(pager_mod, "StepResume", Seen)
    return starts
 # slots a layer at which some speculated steps hit and some miss


@pytest.mark.parametrize("family", [*TINY, "gemma4-ple-shared"])
def test_speculation_gives_identical_tokens(packed, gemma_ple_packed, family, monkeypatch):
    """Speculated steps, hit or missed (the layers from the first that missed run again: their caches undone
    through mark(), their input the one the run before computed; Gemma 4's KV-sharing layers read the K/V of a
    layer before it), give the all-resident tokens, greedy and sampled (the sampling key as the global sequence
    would give it)."""
    ck = gemma_ple_packed if family == "gemma4-ple-shared" else packed.get(family)
    if ck is None:
        pytest.skip(f"model family {family} not in this build yet")
    for temp in (0.0, 1.0):
        ref = generate(load(ck, tokenizer=False).model, PROMPT, max_tokens=24, seed=0, prefill_chunk=16, temp=temp)
        after_ref = mx.random.uniform(shape=(2,)).tolist()  # where the global sequence stands after the run
        model = load(ck, tokenizer=False).model
        pager = ExpertPager(model, ck, slots=SPEC_SLOTS.get(family, 3), speculate="always")
        starts = _resume_starts(monkeypatch)
        got = generate(model, PROMPT, max_tokens=24, seed=0, prefill_chunk=16, temp=temp)
        after = mx.random.uniform(shape=(2,)).tolist()
        st = pager.report()
        pager.close()
        assert got.tokens == ref.tokens, temp
        assert after == after_ref, temp
        # both ways were taken: steps served by the speculation at once, and steps that missed and ran again from
        # the layer that missed
        assert st.speculated > st.respun > 0 and st.reruns >= st.respun
        assert st.speculated == len(got.tokens) - 1  # the first token comes from the prefill
        assert len(starts) == st.reruns and any(starts), starts  # runs again from a later layer than the first
        # each layer's experts counted once a step, as a layer-by-layer run counts them
        model = load(ck, tokenizer=False).model
        off = ExpertPager(model, ck, slots=SPEC_SLOTS.get(family, 3), speculate="off")
        generate(model, PROMPT, max_tokens=24, seed=0, prefill_chunk=16, temp=temp)
        so = off.report()
        off.close()
        assert (st.hits, st.misses, st.evictions) == (so.hits, so.misses, so.evictions), (st, so)


@pytest.mark.parametrize("window", [0, 4])
def test_speculation_undoes_a_compressed_cache(packed, window):
    """A missed speculated step is undone in an IsoQuant cache too (its token leaves the fp16 window or the packed
    part again, the window's spill stays): the tokens of the same cache all resident."""
    ck = packed["qwen3_moe"]
    kv = KVSettings(mode="isoquant3", fp16_window=window, edge_layers=1)
    ref, got, st = _paged_and_resident(ck, 3, "always", max_tokens=24, kv=kv)
    assert got.tokens == ref.tokens
    assert st.speculated > st.respun > 0


@pytest.mark.parametrize("slower", [True, False])
def test_race_runs_the_faster_way_and_probes_the_slower_less_and_less(monkeypatch, slower):
    """A Race alternates until each way has two times, then runs the faster by the medians of each way's last three,
    the slower after 4, 8, 16, 16, ... picks (PROBE_STEPS 4, PROBE_MAX 16 here); where a probe finds
    the order changed, the other way is the faster and the probes start again at 4 picks."""
    from rq_core.paging import pager as pager_mod

    monkeypatch.setattr(pager_mod, "PROBE_STEPS", 4)
    monkeypatch.setattr(pager_mod, "PROBE_MAX", 16)
    race = pager_mod.Race()

    def run(picks, cost):
        ways = []
        for _ in range(picks):
            ways.append(race.pick())
            race.record(ways[-1], cost[ways[-1]])
        return ways

    ways = run(60, {slower: 2.0, not slower: 1.0})
    assert ways[:4] == [True, False, True, False]
    slow_at = [i + 1 for i, w in enumerate(ways) if w == slower]
    first = 1 if slower else 2
    # known after pick 4: picks 8, 16, 32, 48 (16 at most)
    assert slow_at == [first, first + 2, 8, 16, 32, 48], slow_at
    assert race.probe_every == 16
    # the slower way turns faster: its second probe from here (at 4 and then 20: the median takes two new times) finds
    # it so; the race runs it from then on, the other way after 4 picks, then 8
    ways = run(40, {slower: 0.5, not slower: 1.0})
    assert [i + 1 for i, w in enumerate(ways) if w != slower] == [i for i in range(1, 20) if i != 4] + [24, 32], ways


def test_auto_speculation_is_timed_both_ways(packed, monkeypatch):
    """speculate="auto" times speculated and layer-by-layer steps in turn (after the steps that trace the graphs),
    then runs as its Race says; "off" never speculates, nor does "auto" where a layer has fewer slots than a token's
    experts."""
    from rq_core.paging import pager as pager_mod

    monkeypatch.setattr(pager_mod, "MAX_MISSING_LAYERS", float("inf"))  # how often steps miss: the next test
    ck = packed["qwen3_moe"]
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=2, speculate="auto")
    generate(model, PROMPT, max_tokens=8, seed=0, prefill_chunk=16)
    st = pager.report()
    # step 1 layer by layer (how often a step misses is not known yet), 2 speculated, both untimed (graphs traced);
    # 3 and 5 speculated, 4 and 6 layer by layer, 7 the faster way, all timed
    times = pager._spec_race.times
    assert len(times[True]) >= 2 and len(times[False]) >= 2 and len(times[True]) + len(times[False]) == 5, times
    assert st.speculated == 1 + len(times[True]), (st, times)
    pager.close()
    for mode, slots in (("off", 2), ("auto", 1)):  # the tiny models take top-2
        model = load(ck, tokenizer=False).model
        pager = ExpertPager(model, ck, slots=slots, speculate=mode)
        generate(model, PROMPT, max_tokens=12, seed=0, prefill_chunk=16)
        assert pager.report().speculated == 0, mode
        pager.close()
    with pytest.raises(RQError, match="unknown speculation"):
        ExpertPager(load(ck, tokenizer=False).model, ck, slots=2, speculate="yes")


def test_auto_speculates_only_where_steps_miss_in_few_layers(packed):
    """A speculated step runs again from every layer that missed: "auto" goes layer by layer while steps miss in
    MAX_MISSING_LAYERS MoE layers or more on average (few slots: every step misses somewhere), and speculates once
    they stop missing (every expert resident after the prompt)."""
    from rq_core.paging.pager import MAX_MISSING_LAYERS

    ck = packed["qwen3_moe"]
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=2, speculate="auto")
    generate(model, PROMPT, max_tokens=12, seed=0, prefill_chunk=16)
    st = pager.report()
    assert st.speculated == 0 and pager._missing >= MAX_MISSING_LAYERS and st.misses > 0, (st, pager._missing)
    pager.close()
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=8, speculate="auto")  # all experts: no step misses after the prompt
    generate(model, PROMPT, max_tokens=12, seed=0, prefill_chunk=16)
    st = pager.report()
    assert st.speculated >= 2 and st.respun == 0 and pager._missing < MAX_MISSING_LAYERS, (st, pager._missing)
    pager.close()


def test_a_small_staging_buffer_reads_in_several_batches(packed):
    ck = packed["qwen3_moe"]
    ref = generate(load(ck, tokenizer=False).model, PROMPT, max_tokens=8, seed=0, prefill_chunk=16)
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=8, threads=2)  # all 8 experts resident, staged top-k (2) at a time
    got = generate(model, PROMPT, max_tokens=8, seed=0, prefill_chunk=16)
    st = pager.report()
    pager.close()
    used = max(l.meta["used_bytes"] for l in pager.layers.values())
    assert got.tokens == ref.tokens
    # at most 2 pages a batch: 16 misses take 8 batches or more (one a layer call would be far fewer)
    assert st.staging_bytes == 2 * used and st.misses == 16 and st.read_batches >= 8


def test_mmap_policy_is_refused_in_one_line(packed):
    ck = packed["qwen3_moe"]
    with pytest.raises(RQError, match="mmap.*gone.*use lru"):
        ExpertPager(load(ck, tokenizer=False).model, ck, slots=2, policy="mmap")
    from rq_cli.main import app

    r = CliRunner().invoke(app, ["run", str(ck), "-p", "hi", "-n", "2", "--memory-budget", "1GB", "--pager", "mmap"])
    assert r.exit_code == 2 and "gone" in r.output and "Traceback" not in r.output


def test_peak_memory_stays_under_the_budget(packed):
    import gc

    gc.collect()  # models of earlier tests must not count in this run's peak
    mx.clear_cache()
    # Arrays that other tests' fixtures still hold count in MLX's peak: measure on top of them.
    baseline = mx.get_active_memory()
    ck = packed["qwen3_moe"]
    cfg = json.loads((ck / "config.json").read_text())
    model = load(ck, tokenizer=False).model
    ctx = len(PROMPT) + 24
    probe = slots_for_budget(model, cfg, 1 << 40, context=ctx, prefill_chunk=16)
    # a budget that holds exactly a quarter of the experts
    budget = budget_for_slots(probe, 2)
    p = slots_for_budget(model, cfg, budget, context=ctx, prefill_chunk=16)
    assert p["slots_per_layer"] == 2 and p["fits"]
    pager = ExpertPager(model, ck, slots=p["slots_per_layer"])
    res = generate(model, PROMPT, max_tokens=24, seed=0, prefill_chunk=16)
    # MLX's peak and the staging buffer the pages are read into (host memory)
    measured = res.peak_memory_bytes - baseline + pager.report().staging_bytes
    assert measured <= budget, (res.peak_memory_bytes, baseline, budget)  # no slack: measured 0.68 of the budget
    full = generate(load(ck, tokenizer=False).model, PROMPT, max_tokens=24, seed=0, prefill_chunk=16)
    assert full.tokens == res.tokens
    assert pager.report().hit_rate is not None
    # a compressing cache's fp16 prompt while it prefills takes budget from the experts (the planner's count)
    from rq_core.paging.planner import prefill_fp16_bytes

    iso = slots_for_budget(model, cfg, budget, context=ctx, prefill_chunk=16, kv_mode="isoquant3")
    pre = prefill_fp16_bytes(cfg, "isoquant3", ctx, None, 16)
    assert iso["prefill_fp16_bytes"] == pre > 0 and iso["planned_peak_bytes"] >= iso["kv_bytes"] + pre
    bounded = slots_for_budget(model, cfg, budget, context=ctx, prefill_chunk=16, kv_mode="isoquant3",
                               prefill_fp16=16)
    assert bounded["prefill_fp16_bytes"] == prefill_fp16_bytes(cfg, "isoquant3", ctx, 16, 16)
    assert bounded["slots_per_layer"] <= p["slots_per_layer"] and iso["slots_per_layer"] <= p["slots_per_layer"]


def test_run_cli_memory_budget_json_and_plan(packed):
    from rq_cli.main import app

    ck = packed["qwen3_moe"]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (ck / f).is_file()
    runner = CliRunner()
    base = ["run", str(ck), "-p", "to be or not to be", "-n", "8", "--temp", "0", "--seed", "0", "--json"]
    full = json.loads(runner.invoke(app, base).stdout)
    probe = json.loads(runner.invoke(app, base + ["--memory-budget", "1GB", "--plan"]).stdout)["plan"]
    budget = budget_for_slots(probe, 2)  # room for 2 of 8 experts a layer
    import gc

    gc.collect()
    baseline = mx.get_active_memory()  # what other tests still hold counts in this process' peak
    r = runner.invoke(app, base + ["--memory-budget", str(budget)])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["tokens"] == full["tokens"]
    assert set(d["pager"]) == {"hits", "misses", "hit_rate", "bytes_read", "evictions", "resident_bytes",
                               "slots", "policy", "host_syncs", "read_batches", "read_s", "staging_bytes", "staging_host_resident",
                               "sync_s", "host_s",
                               "speculated", "respun", "reruns", "queued", "queue_fallbacks", "queue_stopped"}
    # no slack: the plan counts KV room in the caches' 256-token steps (measured 0.66 of the budget here;
    # 1.02 before, when it counted only the tokens)
    assert d["pager"]["slots"] == 2
    assert d["peak_memory_bytes"] - baseline + d["pager"]["staging_bytes"] <= budget
    r = runner.invoke(app, base + ["--memory-budget", str(budget), "--plan"])
    assert r.exit_code == 0 and json.loads(r.stdout)["plan"]["slots_per_layer"] == d["pager"]["slots"]
    r = runner.invoke(app, base[:-1] + ["--memory-budget", "10KB"])
    assert r.exit_code == 2 and "too small" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, base[:-1] + ["--memory-budget", "1GB", "--pager", "fifo"])
    assert r.exit_code == 2 and "fifo" in r.output


def test_a_memory_budget_is_mlxs_memory_limit_while_the_pager_serves(packed, monkeypatch):
    """MLX allocates a queued graph's buffers as it encodes it: a decode step queued ahead holds all its working
    memory at once unless MLX's memory limit makes its evaluation wait. `rq run --memory-budget` sets the limit to
    what the budget leaves MLX (less the reserve and the staging buffer, host memory) on top of what MLX held before;
    close() puts the old limit back."""
    from rq_cli.main import app

    ck = packed["qwen3_moe"]
    cfg = json.loads((ck / "config.json").read_text())
    model = load(ck, tokenizer=False).model
    ctx = len(PROMPT) + 8
    budget = budget_for_slots(slots_for_budget(model, cfg, 1 << 40, context=ctx, prefill_chunk=16), 2)
    p = slots_for_budget(model, cfg, budget, context=ctx, prefill_chunk=16)
    assert p["memory_limit_bytes"] == budget - p["reserve_bytes"] - p["staging_bytes"]
    assert p["planned_peak_bytes"] - p["staging_bytes"] <= p["memory_limit_bytes"]  # the plan's MLX parts fit under it
    before = mx.get_memory_limit()
    held = mx.get_active_memory()
    pager = ExpertPager(model, ck, slots=p["slots_per_layer"], memory_limit=p["memory_limit_bytes"])
    assert mx.get_memory_limit() == held + p["memory_limit_bytes"]
    res = generate(model, PROMPT, max_tokens=8, seed=0, prefill_chunk=16)
    pager.close()
    assert mx.get_memory_limit() == before
    # a budget beyond MLX's own limit (a share of the device's memory) leaves that limit as it is
    fresh = lambda: load(ck, tokenizer=False).model  # noqa: E731 (a model's banks take one pager)
    huge = ExpertPager(fresh(), ck, slots=p["slots_per_layer"], memory_limit=before + (1 << 40))
    assert mx.get_memory_limit() == before
    huge.close()
    mx.set_memory_limit(before // 2)
    big = ExpertPager(fresh(), ck, slots=p["slots_per_layer"], memory_limit=before)
    assert mx.get_memory_limit() == before // 2
    big.close()
    assert mx.get_memory_limit() == before // 2
    mx.set_memory_limit(before)
    assert res.tokens == generate(load(ck, tokenizer=False).model, PROMPT, max_tokens=8, seed=0,
                                  prefill_chunk=16).tokens
    # the CLI's pager gets the plan's limit
    limits = []
    real = mx.set_memory_limit
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: limits.append(n) or real(n))
    base = ["run", str(ck), "-p", "to be or not to be", "-n", "4", "--seed", "0", "--json"]
    budget = budget_for_slots(json.loads(CliRunner().invoke(app, base + ["--memory-budget", "1GB", "--plan"]).stdout)[
        "plan"], 2)
    plan = json.loads(CliRunner().invoke(app, base + ["--memory-budget", str(budget), "--plan"]).stdout)["plan"]
    assert not limits and plan["slots_per_layer"] == 2  # --plan alone attaches nothing
    r = CliRunner().invoke(app, base + ["--memory-budget", str(budget)])
    assert r.exit_code == 0, r.output
    assert len(limits) == 1 and limits[0] - plan["memory_limit_bytes"] >= 0
    assert limits[0] - plan["memory_limit_bytes"] <= mx.get_active_memory() + (1 << 30)  # on top of what MLX held


def test_corrupt_page_is_detected(packed, tmp_path):
    import shutil

    ck = tmp_path / "c"
    shutil.copytree(packed["qwen2_moe"], ck)
    f = next((ck / "experts").glob("*.bin"))
    data = bytearray(f.read_bytes())
    data[5] ^= 0xFF
    f.write_bytes(bytes(data))
    model = load(ck, tokenizer=False).model
    ExpertPager(model, ck, slots=8, verify=True)
    with pytest.raises(RQError, match="checksum mismatch"):
        generate(model, PROMPT, max_tokens=2)


def test_a_recipe_asking_for_mmap_gets_the_same_line(tmp_path):
    src = (Path(__file__).parents[1] / "recipes" / "qwen3-16gb.toml").read_text()
    assert 'policy = "lru"' in src
    f = tmp_path / "r.toml"
    f.write_text(src.replace('policy = "lru"', 'policy = "mmap"'))
    with pytest.raises(RQError, match="mmap.*is gone"):
        recipe.load(f)


def test_a_dropped_paged_model_frees_its_banks_without_the_cycle_collector(packed):
    """Nothing in the pager points back at the banks it serves: a dropped model's slot banks are freed at once, not when
    Python's cycle collector next runs (a server that loads a model again would hold both until then)."""
    import gc

    ck = packed["qwen3_moe"]
    gc.collect()
    base = mx.get_active_memory()
    gc.disable()
    try:
        model = load(ck, tokenizer=False).model
        pager = ExpertPager(model, ck, slots=4)
        cache = model.make_cache(KVSettings(mode="fp16"))
        for t in ([PROMPT[:12]], [[5]], [[7]], [[9]]):
            mx.eval(model(mx.array(t), cache=cache))
        assert pager.report().resident_bytes > 0
        pager.close()
        del model, pager, cache
        left = mx.get_active_memory() - base
        gc.collect()
        assert left - (mx.get_active_memory() - base) < 1024  # what only the collector would have freed
    finally:
        gc.enable()


def test_a_batch_of_pages_costs_its_own_bytes_on_the_device(packed):
    """Writing a batch of misses into the slots allocates nothing on the device: the pages are copied from the staging
    buffer (host memory) into the slots in place."""
    ck = packed["qwen3_moe"]
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=4)
    pager._ready(4)
    layer = next(iter(pager.layers.values()))
    mx.eval([layer.module[p][t] for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "scales", "biases")
             if t in layer.module[p]])
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    layer.load([0, 1, 2, 3], [0, 1, 2, 3])
    mx.eval([layer.module[p][t] for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "scales", "biases")
             if t in layer.module[p]])
    grew = mx.get_peak_memory() - base
    pager.close()
    assert grew <= 0 < layer.expert_bytes, (grew, layer.expert_bytes)


@pytest.mark.parametrize("way", ["preadv", "pread", "copy engine"])
def test_batches_that_reuse_the_staging_buffer_each_write_their_own_experts(packed, way, monkeypatch):
    """Eight experts read two at a time through one staging buffer: each slot ends up holding its own expert's
    weights, bit for bit (a slot written from rows the next batch has read into would hold that batch's bytes); also
    where the platform has no os.preadv, and with the copies made by address on a copy engine (a stand-in whose
    copies land at the fence)."""
    import ctypes
    import os

    from rq_core.paging import transfer

    if way == "pread":
        monkeypatch.delattr(os, "preadv", raising=False)
    if way == "copy engine":
        pending: list = []

        def copy(self, dst: int, src: int, n: int) -> None:
            pending.append((dst, src, n))
            self._dirty = True

        def fence(self) -> None:
            for dst, src, n in pending:
                ctypes.memmove(dst, src, n)
            pending.clear()
            self._dirty = False

        monkeypatch.setattr(transfer.Copier, "device_copies", property(lambda self: True))
        monkeypatch.setattr(transfer.Copier, "copy", copy)
        monkeypatch.setattr(transfer.Copier, "fence", fence)
    ck = packed["qwen3_moe"]
    ref = load(ck, tokenizer=False).model
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=8, threads=2)
    pager._ready(2)
    path, layer = next(iter(pager.layers.items()))
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    layer.load(order, list(range(8)))
    pager.copier.fence()  # (acquire's: the last batch's copies landed before anything reads the slots)
    mod = ref
    for part in path.split("."):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
    for t in layer.meta["tensors"]:
        proj, part = t["name"].split(".")
        got, want = layer.module[proj][part], mod[proj][part]
        for slot, e in enumerate(order):
            assert mx.array_equal(got[slot], want[e].astype(got.dtype)).item(), (t["name"], slot, e)
    pager.close()


def test_a_chunk_served_in_passes_reads_each_missing_expert_once(packed):
    """A prefill chunk that needs all 8 experts with room for 2 a layer, experts 6 and 7 resident: the passes start
    with the resident ones, so only the 6 missing experts are read (in index order the first pass evicted 6 and 7,
    and the last read them back: 8 reads), and the output equals the all-resident layer's."""
    import numpy as np

    ck = packed["qwen3_moe"]
    ref = load(ck, tokenizer=False).model
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=2)
    path, layer = next(iter(pager.layers.items()))

    def at(m):
        for part in path.split("."):
            m = m[int(part)] if part.isdigit() else getattr(m, part)
        return m

    pager._ready(2)
    layer.acquire(np.array([6, 7]))
    before = pager.stats.misses
    rng = np.random.default_rng(0)
    idx = mx.array(np.stack([rng.permutation(8)[:2] for _ in range(16)])[None].astype(np.int32))  # [1, 16, 2]
    x = mx.random.normal((1, 16, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    assert len(np.unique(np.array(idx))) == 8
    got = at(model)(x, idx)
    assert pager.stats.misses - before == 6
    want = at(ref)(x, idx)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=1e-5).item()
    pager.close()


def test_a_page_that_fails_to_read_leaves_no_expert_resident(packed, monkeypatch):
    """A read that raises (a corrupt page while `rq serve` goes on to the next request) takes back the slots it was
    given: the experts are read again next time, not served from slots that never received them."""
    import numpy as np

    from rq_core.paging import pager as pager_mod

    ck = packed["qwen3_moe"]
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=2)
    pager._ready(2)
    layer = next(iter(pager.layers.values()))
    real = pager_mod._Layer._read_span

    def broken(self, e, j, a, b, progress=None):
        if e == 1:
            raise RQError("corrupt expert page")
        return real(self, e, j, a, b, progress)

    monkeypatch.setattr(pager_mod._Layer, "_read_span", broken)
    with pytest.raises(RQError, match="corrupt"):
        layer.acquire(np.array([0, 1]))
    assert not layer.lru and sorted(layer.free) == [0, 1]
    monkeypatch.setattr(pager_mod._Layer, "_read_span", real)
    layer.acquire(np.array([0, 1]))
    assert sorted(layer.lru) == [0, 1] and pager.stats.misses == 4
    pager.close()


def test_a_page_that_fails_its_check_raises_before_the_call_returns_and_leaves_its_slot(packed):
    """Checksums run on the read threads while the device computes: a page that fails is reported when the pager joins
    them (before a step or call returns), its expert is no longer resident, and the next call reads it again."""
    import numpy as np

    ck = packed["qwen3_moe"]
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=2, threads=2)
    pager._ready(2)
    layer = next(iter(pager.layers.values()))
    crc = list(layer.meta["crc32"])
    layer.meta["crc32"] = [c ^ 1 if e == 1 else c for e, c in enumerate(crc)]
    layer.acquire(np.array([0, 1]))
    slot_of_1 = layer.lru[1]
    with pytest.raises(RQError, match="corrupt expert page: layer .* expert 1 "):
        pager.join_checks()
    assert list(layer.lru) == [0] and layer.free == [slot_of_1] and not layer.checked[1] and layer.checked[0]
    pager.join_checks()  # reported once
    layer.meta["crc32"] = crc
    layer.acquire(np.array([0, 1]))
    pager.join_checks()
    assert sorted(layer.lru) == [0, 1] and pager.stats.misses == 3 and layer.checked[1]
    pager.close()


def test_no_checksum_is_pending_when_a_decode_step_or_call_returns(packed, monkeypatch):
    """A step's token (and a paged call's output) comes back only after the checksums of the pages it read: none is
    still running when decode_step or a paged MoE call returns, whichever way the step ran."""
    from rq_core.paging.pager import ExpertPager as EP

    ck = packed["qwen3_moe"]
    for speculate in ("off", "always"):
        model = load(ck, tokenizer=False).model
        pager = ExpertPager(model, ck, slots=2, speculate=speculate)
        real_step = EP.decode_step
        returned = []

        checked = []  # experts checked so far, after each step: some steps' reads were first reads

        def step(self, *a, **k):
            out = real_step(self, *a, **k)
            returned.append(len(self._checks))
            checked.append(sum(sum(l.checked) for l in self.layers.values()))
            return out

        monkeypatch.setattr(EP, "decode_step", step)
        from rq_core.paging.pack import expert_banks

        calls = []
        for mod in expert_banks(model).values():  # each a class of its own (the pager's swap)
            def call(self, *a, real=type(mod).__call__, **k):
                out = real(self, *a, **k)
                calls.append(len(pager._checks))
                return out

            monkeypatch.setattr(type(mod), "__call__", call)
        generate(model, PROMPT[:1], max_tokens=24, seed=0)  # one prompt token: most experts first read in decode
        assert calls and set(calls) == {0}, calls
        assert returned and set(returned) == {0}, returned
        assert len(set(checked)) > 1, checked
        monkeypatch.undo()
        pager.close()


def test_a_failed_batch_raises_only_after_its_other_reads_are_done(packed, monkeypatch):
    """One read of a batch fails at once while another is still reading: the error comes out only when that read
    has finished, so nothing writes into the staging buffer after the caller goes on to the next batch."""
    import time

    import numpy as np

    from rq_core.paging import pager as pager_mod

    ck = packed["qwen3_moe"]
    model = load(ck, tokenizer=False).model
    pager = ExpertPager(model, ck, slots=4, threads=2)
    pager._ready(2)
    layer = next(iter(pager.layers.values()))
    real = pager_mod._Layer._read_span
    done = []

    def slow_or_broken(self, e, j, a, b, progress=None):
        if e == 0:
            raise RQError("corrupt expert page")
        time.sleep(0.3)
        real(self, e, j, a, b, progress)
        done.append(e)

    monkeypatch.setattr(pager_mod._Layer, "_read_span", slow_or_broken)
    with pytest.raises(RQError, match="corrupt"):
        layer.acquire(np.array([0, 1]))
    assert done == [1]
    pager.close()


def test_a_page_reads_into_its_own_row_of_the_staging_buffer(tmp_path):
    """Expert e's used bytes land in row j of the staging buffer (the other rows untouched), whole or in pieces, the
    checksum covers them, and a page whose checksum does not match is refused in one line; also without preadv. A
    lone miss is cut into pieces for the read threads, several misses are read a page a thread."""
    import os
    import types
    import zlib

    import numpy as np

    from rq_core.paging.pager import _Layer

    rng = np.random.default_rng(0)
    page_bytes, used = 4096, 3000
    pages = rng.integers(0, 256, (3, page_bytes), dtype=np.uint8)
    f = tmp_path / "layer.pages"
    f.write_bytes(pages.tobytes())
    meta = {"used_bytes": used, "page_bytes": page_bytes,
            "crc32": [zlib.crc32(pages[e, :used].tobytes()) for e in range(3)], "file": f.name}
    for preadv in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not preadv:
                mp.delattr(os, "preadv", raising=False)
            pager = types.SimpleNamespace(verify=True, dir=tmp_path, _staging_host=np.zeros(2 * used, np.uint8))
            layer = _Layer.__new__(_Layer)
            layer.pager, layer.path, layer.meta = pager, "layer", dict(meta, crc32=list(meta["crc32"]))
            layer.checked = bytearray(3)
            layer.fd = os.open(f, os.O_RDONLY)
            try:
                layer._read_span(2, 1, 0, used)
                host = pager._staging_host
                assert np.array_equal(host[used:], pages[2, :used]) and not host[:used].any()
                layer._read_span(1, 0, 1000, used)  # in two pieces, the later first
                assert not host[:1000].any()
                layer._read_span(1, 0, 0, 1000)
                assert np.array_equal(host[:used], pages[1, :used]) and np.array_equal(host[used:], pages[2, :used])
                layer._check(2, 1)
                layer._check(1, 0)
                assert layer.checked[2] and layer.checked[1] and not layer.checked[0]
                layer._read_span(0, 0, 0, used)
                layer.meta["crc32"][0] ^= 1  # a page whose checksum does not match
                with pytest.raises(RQError, match="corrupt expert page"):
                    layer._check(0, 0)
                assert not layer.checked[0]
            finally:
                os.close(layer.fd)
    from rq_core.paging.pager import SPAN_MIN

    layer = _Layer.__new__(_Layer)
    for used, threads, n, want in ((3 * 2 ** 20, 8, 1, 8), (3 * 2 ** 20, 8, 2, 4), (3 * 2 ** 20, 8, 8, 1),
                                   (SPAN_MIN + 5, 8, 1, 1), (5 * SPAN_MIN, 8, 1, 5), (3 * 2 ** 20, 1, 1, 1)):
        layer.pager, layer.meta = types.SimpleNamespace(_threads=threads), {"used_bytes": used}
        spans = layer._spans(n)
        assert len(spans) == want and spans[0][0] == 0 and spans[-1][1] == used
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(spans, spans[1:])) and all(a < b for a, b in spans)


def test_a_miss_evicts_the_least_recently_used_expert():
    """LRU over one layer's slots: a hit makes an expert the most recent, a miss with no free slot takes the slot of
    the least recent one, and after `acquire` every expert it was given is resident (in the slot its table says).
    Pages are not read here: `load` records the (experts, slots) it is asked for."""
    import types
    from collections import OrderedDict

    import numpy as np

    from rq_core.paging.pager import PagerStats, _Layer

    writes = []
    layer = _Layer.__new__(_Layer)
    layer.pager = types.SimpleNamespace(stats=PagerStats(), _checks=[], _layers_missed=0, copier=types.SimpleNamespace(
        write=lambda raw, off, src: writes.append(np.array(src)), fence=lambda: None))
    layer.path, layer.E, layer.slots = "layer", 8, 3
    layer.lru, layer.free, layer.lut = OrderedDict(), [0, 1, 2], np.zeros(8, np.int32)
    layer._lut_raw = object()
    loads = []
    layer.load = lambda experts, slots, progress=None, copies=None: loads.append((list(experts), list(slots)))

    def acquire(*experts):
        layer.acquire(np.array(experts))
        assert all(e in layer.lru for e in experts)
        assert sorted(layer.lru.values()) == sorted(set(layer.lru.values()))  # one expert a slot
        assert all(layer.lut[e] == s for e, s in layer.lru.items()) and np.array_equal(writes[-1], layer.lut)

    acquire(0, 1, 2)  # three misses fill the free slots 0, 1, 2
    assert loads == [([0, 1, 2], [0, 1, 2])] and list(layer.lru) == [0, 1, 2]
    acquire(0)  # a hit: 0 becomes the most recent, 1 the least
    assert list(layer.lru) == [1, 2, 0] and len(loads) == 1
    acquire(5)  # evicts 1 (least recent), into its slot 1
    assert loads[-1] == ([5], [1]) and list(layer.lru) == [2, 0, 5]
    acquire(0, 6)  # 0 a hit (most recent again), 6 evicts 2 (slot 2), not 0 or 5
    assert loads[-1] == ([6], [2]) and list(layer.lru) == [5, 0, 6]
    acquire(7, 3)  # two misses evict 5 then 0, the two least recent
    assert loads[-1] == ([7, 3], [1, 0]) and list(layer.lru) == [6, 7, 3]
    st = layer.pager.stats
    assert (st.hits, st.misses, st.evictions) == (2, 7, 4)


def test_decode_counters_are_counted_from_their_start():
    """PagerStats.since: every counter (hits, misses, bytes, evictions, syncs, times, batches, speculated steps) is the
    difference from the earlier report, the hit rate is theirs; sizes and settings are as now (what
    GenerationResult.pager_decode reports for the decode steps alone)."""
    from dataclasses import fields

    from rq_core.paging.pager import PagerStats

    sizes = {"hit_rate", "resident_bytes", "slots", "policy", "staging_bytes", "staging_host_resident", "queue_stopped"}
    s = PagerStats(slots=4, resident_bytes=4096, staging_bytes=512, policy="lru")
    counters = [f.name for f in fields(PagerStats) if f.name not in sizes]
    for i, name in enumerate(counters):  # the prompt's counts
        setattr(s, name, 100 * (i + 1))
    before = s.as_dict()
    for i, name in enumerate(counters):  # the decode steps add i + 1 to each
        setattr(s, name, getattr(s, name) + i + 1)
    s.slots, s.resident_bytes = 6, 6144
    d = s.since(before)
    assert {name: d[name] for name in counters} == {name: i + 1 for i, name in enumerate(counters)}
    h, m = counters.index("hits") + 1, counters.index("misses") + 1
    assert d["hit_rate"] == h / (h + m)
    assert (d["slots"], d["resident_bytes"], d["staging_bytes"], d["policy"]) == (6, 6144, 512, "lru")


DEVICE_PATIENCE_S = 10.0  # the stand-in device's wait for an answer before a test fails (a hang otherwise)


class HostMailbox:
    """rq_core.paging.mailbox.Mailbox's protocol with the device's side played by the host (on the CPU no kernel can
    wait for the host). `post` queues nothing; a launch (`launched`, the patched mx.async_eval) plays the device up to
    the last layer posted: each layer in order waits until the ones before it are answered, as the device would in
    their `wait` kernels, then its routing is evaluated (on the building thread: MLX's CPU streams are per thread) and
    it is ready. `fetch` (the answers' thread) waits until its layer is ready: a layer never launched is never fetched.
    The slots `post` hands back are read from an array that `answer` writes in place, so a graph built before the
    answer reads what the answer wrote; `answer` makes the copies the device's `load` would (host addresses: on the CPU
    the device's), before the layer's experts are computed (at the step's evaluation). `log`: what happened, in
    order."""

    def __init__(self, copier, layers: int, k: int, copies: int) -> None:
        import threading

        from rq_core.paging.transfer import Copier

        self.k, self.copies = k, copies
        self.staging: list = []
        self.copied = 0  # bytes answer copied
        self.slots = [mx.zeros((k,), mx.int32) for _ in range(layers)]
        mx.eval(self.slots)
        self.raw = [Copier.raw(a) for a in self.slots]
        self.posted: list = []  # (entry, ids) posted, not launched yet
        self.ready: dict = {}  # entry -> routing, launched
        self.unanswered: list = []  # launched or posted, in order, not answered yet
        self.released = False
        self.cv = threading.Condition()
        self.log: list = []
        self.answer_threads: set = set()
        self.beats = 0

    def open(self) -> None:
        assert not self.posted and not self.unanswered, "a step opened with a layer posted and not answered"
        self.released = False
        self.log.append("open")

    def post(self, entry: int, ids: mx.array) -> mx.array:
        with self.cv:
            assert entry not in self.unanswered
            self.posted.append((entry, ids))
            self.unanswered.append(entry)
            self.log.append(("post", entry))
        return self.slots[entry][:ids.size].reshape(ids.shape)

    def launched(self) -> None:
        import numpy as np

        with self.cv:
            self.log.append("launch")
            while self.posted:
                entry, ids = self.posted.pop(0)
                before = self.unanswered[:self.unanswered.index(entry)] if entry in self.unanswered else []
                assert self.cv.wait_for(lambda: self.released or not any(e in self.unanswered for e in before),
                                        timeout=DEVICE_PATIENCE_S), f"layer {before} never answered"
                self.ready[entry] = np.array(ids).reshape(-1).astype(np.int32)
                self.cv.notify_all()

    def fetch(self, entry: int, n: int):
        import threading

        from rq_core.paging.mailbox import Abandoned

        self.answer_threads.add(threading.current_thread())
        with self.cv:
            assert self.cv.wait_for(lambda: self.released or entry in self.ready, timeout=DEVICE_PATIENCE_S), \
                f"layer {entry} fetched and never launched"
            if self.released:
                raise Abandoned()
            self.log.append(("fetch", entry))
            return self.ready.pop(entry)[:n]

    def progress(self, entry: int) -> None:
        self.beats += 1

    def staging_buffer(self, n: int):
        import numpy as np

        self.staging.append(np.zeros(n, np.uint8))
        return self.staging[-1], self.staging[-1].ctypes.data

    def answer(self, entry: int, slots, copies) -> None:
        import ctypes

        import numpy as np

        assert len(copies) <= self.copies
        lo, hi = self.staging[0].ctypes.data, self.staging[0].ctypes.data + self.staging[0].nbytes
        for dst, src, n in copies:
            assert lo <= src and src + n <= hi  # the pages come from the staging buffer
            ctypes.memmove(dst, src, n)
            self.copied += n
        self.raw[entry][:4 * len(slots)] = np.asarray(slots, np.int32).view(np.uint8)
        with self.cv:
            self.log.append(("answer", entry))
            self.unanswered.remove(entry)
            self.cv.notify_all()

    def release_all(self) -> None:
        with self.cv:
            self.log.append("release")
            self.released = True
            self.posted.clear()
            self.ready.clear()
            self.unanswered.clear()
            self.cv.notify_all()

    def failed(self) -> bool:
        return self.released


def _queued_run(packed, family: str, monkeypatch, box_class, queue: str | None = "always", **steps) -> tuple:
    """(all-resident logits, logits of steps queued whole through box_class, misses, the pager) of _paged_logits'
    steps (`steps`: its kv and prompt), with 2 slots a layer (`queue`: the pager's; None: its default)."""
    import rq_core.paging.pager as pager_mod

    if family not in packed:
        pytest.skip(f"model family {family} not in this build yet")
    ck = packed[family]
    want = _paged_logits(load(ck, tokenizer=False).model, graphs=True, **steps)[0]
    monkeypatch.setattr(pager_mod.mailbox, "available", lambda copier: True)
    monkeypatch.setattr(pager_mod.mailbox, "Mailbox", box_class)
    model = load(ck, tokenizer=False).model

    def launch(*arrays) -> None:  # the host plays the device: nothing runs early but the posted layers' routing
        box = getattr(getattr(model, "expert_pager", None), "mailbox", None)
        if isinstance(box, HostMailbox):
            box.launched()

    monkeypatch.setattr(pager_mod.mx, "async_eval", launch)
    pager = ExpertPager(model, ck, slots=2, speculate="off",  # queued whole where a mailbox can be made
                        **({} if queue is None else {"queue": queue}))
    got, misses, _ = _paged_logits(model, True, pager, **steps)
    return want, got, misses, pager


@pytest.mark.parametrize("family", list(TINY))
def test_a_step_queued_whole_serves_each_layer_after_the_next_is_queued(packed, family, monkeypatch):
    """On CUDA a decode step is queued whole, each MoE layer's slots handed to the device through a mailbox: layers are
    answered on a thread of their own (the building thread goes on building), every posted layer
    within its step, in order; the step launched once, after its last layer is posted (never while the building thread,
    which holds the GIL the answers need, may still call into MLX); the logits are the all-resident model's, and the
    device table a call outside a decode step reads (the mailbox's steps do not write it) maps the experts as the host
    does."""
    import threading

    import numpy as np

    import rq_core.paging.pager as pager_mod
    from rq_core.paging import transfer

    writers = set()  # threads that queued copies on the copy engine
    real_write = transfer.Copier.write

    def write(self, *a) -> None:
        writers.add(threading.current_thread())
        real_write(self, *a)

    monkeypatch.setattr(transfer.Copier, "write", write)
    want, got, misses, pager = _queued_run(packed, family, monkeypatch, HostMailbox)
    box = pager.mailbox
    assert isinstance(box, HostMailbox) and misses > 0 and len(got) == len(want)
    for a, b in zip(want, got):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    for layer in pager.layers.values():  # the device table, as a call outside a decode step reads it: the host's map
        table = np.array(layer.table())
        assert all(table[e] == s for e, s in layer.lru.items()), layer.path
    steps, cur = [], None
    for ev in box.log:
        if ev == "open":
            cur = []
            steps.append(cur)
        elif cur is not None:  # (the layer-by-layer warm-up steps launch before the first)
            cur.append(ev)
    assert len(steps) == 10 - pager_mod.WARMUP_STEPS and pager.stats.queued == len(steps)  # the first as written
    assert pager.stats.queue_fallbacks == 0
    assert box.answer_threads and threading.main_thread() not in box.answer_threads
    # the queued steps' pages came in by the device's copies (mailbox `load`): the answers' thread makes no CUDA call
    assert box.copied > 0 and writers == {threading.main_thread()}
    assert box.beats >= misses  # each page read moved its layer's progress on (the device's patience restarts)
    for ev in steps:
        posts = [e for k, e in (x for x in ev if x != "launch") if k == "post"]
        answers = [e for k, e in (x for x in ev if x != "launch") if k == "answer"]
        assert len(posts) == len(pager.layers) and answers == posts  # in order: the device reaches them so
        for e in posts:
            assert ev.index(("post", e)) < ev.index(("fetch", e)) < ev.index(("answer", e))
        launches = [i for i, x in enumerate(ev) if x == "launch"]
        assert len(launches) == 1 and launches[0] > max(ev.index(("post", e)) for e in posts)  # once, built whole
    pager.close()
    assert not any(t.is_alive() for t in box.answer_threads)  # close ends the thread



def test_a_step_queued_whole_launches_what_it_posted_before_an_evaluation_inside_it(packed, monkeypatch):
    """An IsoQuant cache codes its full fp16 window in chunks inside a decode step, evaluating between them: in a step
    queued whole, settle first launches the layers posted so far and waits for their answers (nothing waits on a layer
    never launched), and the layers posted after are launched at the step's end; the logits are the all-resident
    model's with the same cache."""
    kv = KVSettings(mode="isoquant3", fp16_window=32, edge_layers=1)
    want, got, misses, pager = _queued_run(packed, "qwen3_moe", monkeypatch, HostMailbox, kv=kv, prompt=30)
    assert misses > 0 and len(got) == len(want) and pager.stats.queue_fallbacks == 0
    for a, b in zip(want, got):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    steps, cur = [], None
    for ev in pager.mailbox.log:
        if ev == "open":
            cur = []
            steps.append(cur)
        elif cur is not None:
            cur.append(ev)
    assert steps and pager.stats.queued == len(steps)
    inside = 0  # steps with an evaluation inside: a launch before their last post
    for ev in steps:
        posts = [i for i, x in enumerate(ev) if x != "launch" and x[0] == "post"]
        launches = [i for i, x in enumerate(ev) if x == "launch"]
        assert launches and launches[-1] > posts[-1]  # every posted layer launched
        inside += launches[0] < posts[-1]
        answers = [x[1] for x in ev if x != "launch" and x[0] == "answer"]
        assert answers == [ev[i][1] for i in posts]  # each answered, in order
    assert inside > 0
    pager.close()


class SlowMailbox(HostMailbox):
    """A device on which a step queued whole is slow (each launch of posted layers waits 0.15 s)."""

    def launched(self) -> None:
        if self.posted:  # (a step by stretch launches through the same patched async_eval, nothing posted)
            time.sleep(0.15)
        super().launched()


@pytest.mark.parametrize("slower", ["whole", "stretch"])
def test_auto_queuing_runs_the_faster_way_and_the_slower_less_and_less(packed, monkeypatch, slower):
    """queue="auto" (the default) times steps queued whole and by stretch in turn (two each), then runs the faster by
    the medians of each way's last steps, the slower once after PROBE_STEPS steps and twice as many steps each time
    it stays slower; the logits are the all-resident model's either way."""
    import rq_core.paging.pager as pager_mod

    monkeypatch.setattr(pager_mod, "PROBE_STEPS", 2)
    if slower == "stretch":  # a stretch-by-stretch step waits 0.15 s a MoE layer
        real = pager_mod._Layer.settle

        def settle(self, indices):
            time.sleep(0.15)
            real(self, indices)
        monkeypatch.setattr(pager_mod._Layer, "settle", settle)
    want, got, misses, pager = _queued_run(packed, "qwen3_moe", monkeypatch,  # the default: "auto"
                                           SlowMailbox if slower == "whole" else HostMailbox, queue=None)
    for a, b in zip(want, got):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    # steps 3-10 (1-2 warm up by stretch): whole at 3 and 5, stretch at 4 and 6, then the slower at 8 (probe: 2 steps
    # after the faster is known), not again before 8 + 4
    whole = {3, 5, 8} if slower == "whole" else {3, 5, 7, 9, 10}
    assert pager.stats.queued == len(whole) and pager.stats.queue_fallbacks == 0, (pager.stats, pager._queue_race.times)
    assert pager._queue_race.probe_every == 4
    pager.close()


def test_queuing_is_checked():
    with pytest.raises(RQError, match="step queuing"):
        ExpertPager(None, "x", slots=2, queue=True)


class BrokenMailbox(HostMailbox):
    """Kernels that do not build on this device (MLX raises RuntimeError as they compile)."""

    def __init__(self, *a) -> None:
        raise RuntimeError("[cuda_kernel] compile failed")


@pytest.mark.parametrize("why", ["no mark", "no kernels"])
def test_a_step_that_cannot_be_queued_whole_runs_layer_by_layer(packed, monkeypatch, why):
    """Where a cache cannot be put back (no `mark`: a step the device gave up on could not run again) or the mailbox's
    kernels do not build, decode steps run a stretch at a time: none queued whole, no error, the all-resident
    model's logits."""
    from rq_core.cache.kv_cache import FP16Cache

    if why == "no mark":
        monkeypatch.delattr(FP16Cache, "mark")
    want, got, misses, pager = _queued_run(packed, "qwen3_moe", monkeypatch,
                                           HostMailbox if why == "no mark" else BrokenMailbox)
    assert (pager.mailbox is None) == (why == "no kernels") and pager.stats.queued == 0 and misses > 0
    for a, b in zip(want, got):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    pager.close()


def test_a_step_is_queued_whole_only_where_the_copies_have_a_stream_of_their_own(monkeypatch):
    """mailbox.available: a CUDA GPU as MLX's default device, the copy engine, and a stream of the copier's own (its
    fence on the legacy default stream can wait behind a spinning `wait` until that gives up, every step)."""
    from rq_core.paging import mailbox

    class Copier:
        device_copies, own_stream = True, True

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert mailbox.available(Copier())
    Copier.own_stream = False
    assert not mailbox.available(Copier())
    Copier.own_stream, Copier.device_copies = True, False
    assert not mailbox.available(Copier())
    Copier.device_copies = True
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert not mailbox.available(Copier())


class CountingMailbox(HostMailbox):
    """A HostMailbox that counts the queued steps opened and the layers fetched in each, for steps that fail."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.opened = self.fetched = 0

    def open(self) -> None:
        self.posted.clear()  # a step abandoned or failed leaves layers posted
        self.ready.clear()
        self.unanswered.clear()
        super().open()
        self.opened += 1
        self.fetched = 0


class GivingUpMailbox(CountingMailbox):
    """A device that stops waiting for the host: in the 4th queued step at its second layer (the host sees it while it
    fetches), in the 6th only after the step ran (the host sees it at the end)."""

    def fetch(self, entry: int, n: int):
        from rq_core.paging.mailbox import Abandoned

        self.fetched += 1
        if self.opened == 4 and self.fetched == 2:
            raise Abandoned()
        return super().fetch(entry, n)

    def failed(self) -> bool:
        return self.opened == 6 or self.released


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h"])
def test_a_step_the_device_stopped_waiting_in_runs_again_layer_by_layer(packed, family, monkeypatch):
    """Where the device gave up waiting for the host in a step queued whole (its result is wrong), the caches go back
    to before the step and it runs again layer by layer: the logits are the all-resident model's."""
    import rq_core.paging.pager as pager_mod

    want, got, misses, pager = _queued_run(packed, family, monkeypatch, GivingUpMailbox)
    assert isinstance(pager.mailbox, GivingUpMailbox)
    plain = ExpertPager(model := load(packed[family], tokenizer=False).model, packed[family], slots=2, speculate="off",
                        queue="off")  # each step run once (the mailbox stand-in is still in place)
    _paged_logits(model, True, plain)
    assert plain.stats.queued == 0 and misses > 0
    # the counters a step run once counts: the run again finds the experts its first try read resident
    assert (pager.stats.hits, pager.stats.misses) == (plain.stats.hits, plain.stats.misses)
    plain.close()
    assert pager.stats.queued == 10 - pager_mod.WARMUP_STEPS and pager.stats.queue_fallbacks == 2
    for a, b in zip(want, got):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    pager.close()


class LateAnswerMailbox(CountingMailbox):
    """A device that gave up waiting in the 4th queued step just before the host answered a layer that read pages in:
    that layer's copies are never made (its `load` saw the wait fail), and the step failed."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.skipped = 0  # bytes of copies the device did not make

    def answer(self, entry: int, slots, copies) -> None:
        if self.opened == 4 and copies and not self.skipped:
            self.skipped = sum(n for _, _, n in copies)
            copies = []
        super().answer(entry, slots, copies)

    def failed(self) -> bool:
        return self.opened == 4 or self.released


def test_experts_a_failed_step_read_in_are_read_again(packed, monkeypatch):
    """The device copies a queued step's pages only where its wait saw the answer: after a step it gave up in, the
    experts that step's answers took in are no longer counted resident, and the step run again reads them again (the
    logits are the all-resident model's, not computed from slots that never received their pages)."""
    want, got, misses, pager = _queued_run(packed, "qwen3_moe", monkeypatch, LateAnswerMailbox)
    assert pager.mailbox.skipped > 0 and pager.stats.queue_fallbacks == 1
    for a, b in zip(want, got):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    pager.close()


class AlwaysGivingUpMailbox(CountingMailbox):
    """A device that stops waiting for the host in every queued step, after the step ran (as on a model whose steps all
    outwait mailbox.WAIT_S)."""

    def failed(self) -> bool:
        return True


def test_a_pager_whose_queued_steps_keep_failing_stops_queuing_them(packed, monkeypatch):
    """Steps queued whole that the device gives up waiting in cost a timeout and a second run each: after QUEUE_GIVE_UP
    of them (half or more of those queued) the pager runs its steps a stretch at a time, says so in its stats, and the
    logits are still the all-resident model's."""
    import rq_core.paging.pager as pager_mod

    want, got, misses, pager = _queued_run(packed, "qwen3_moe", monkeypatch, AlwaysGivingUpMailbox)
    assert misses > 0 and len(got) == len(want)
    st = pager.stats
    assert st.queue_stopped and st.queued == st.queue_fallbacks == pager_mod.QUEUE_GIVE_UP
    assert pager.mailbox.opened == pager_mod.QUEUE_GIVE_UP  # no step queued after the pager stopped
    for a, b in zip(want, got):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    pager.close()


class FailingMailbox(CountingMailbox):
    """A layer's answer that fails on the answers' thread (as a page that fails its check does): the first layer fetched
    in the 2nd queued step."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.fetch_calls: list = []  # queued step of each fetch called

    def fetch(self, entry: int, n: int):
        self.fetch_calls.append(self.opened)
        self.fetched += 1
        if self.opened == 2 and self.fetched == 1:
            raise RQError("expert page failed")
        return super().fetch(entry, n)


def _queued_steps(ck, monkeypatch, box_class) -> tuple:
    """(pager, caches, build) for decode steps queued whole through box_class on checkpoint ck's model (2 slots a
    layer), after a 12-token prompt: build(t) is decode_step's `build` for token t."""
    import rq_core.paging.pager as pager_mod

    monkeypatch.setattr(pager_mod.mailbox, "available", lambda copier: True)
    monkeypatch.setattr(pager_mod.mailbox, "Mailbox", box_class)
    model = load(ck, tokenizer=False).model
    monkeypatch.setattr(pager_mod.mx, "async_eval", lambda *a: pager.mailbox and pager.mailbox.launched())
    pager = ExpertPager(model, ck, slots=2, speculate="off", queue="always")
    cache = model.make_cache(KVSettings(mode="fp16"))
    model(mx.array([PROMPT[:12]]), cache=cache)
    for c in cache:
        c.end_prefill()

    def build(t: int):
        def run(key):
            logits = model(mx.array([[t]]), cache=cache)
            pager.settle()
            return logits, logits[0, -1, :2]
        return run

    return pager, cache, build


def test_an_answer_that_fails_on_its_thread_is_raised_by_the_step(packed, monkeypatch):
    """An error in a queued step's answers (on their own thread) comes out of decode_step on the calling thread, the
    step's mailbox released and its other answers skipped, not a hang; the next steps are queued whole again."""
    pager, cache, build = _queued_steps(packed["qwen3_moe"], monkeypatch, FailingMailbox)
    raised = []
    for t in (5, 11, 17, 23, 29, 31):  # the first WARMUP_STEPS run a stretch at a time
        before = [c.offset for c in cache]
        try:
            mx.eval(pager.decode_step(build(t), cache)[0])
        except RQError as e:
            raised.append((t, str(e)))
            assert [c.offset for c in cache] == before  # the caches as before the step
    box = pager.mailbox
    assert raised == [(23, "expert page failed")] and pager.stats.queued == 4 and box.opened == 4
    failed = ",".join(str(x[0] if isinstance(x, tuple) else x) for x in box.log).split("open")[2]
    # the 2nd queued step: its first layer failed, the others' answers skipped, the mailbox released
    assert box.fetch_calls.count(2) == 1 and "answer" not in failed and "release" in failed
    assert box.fetch_calls.count(3) == len(pager.layers)  # the next step answered every layer again
    pager.close()


class LateThenFailingMailbox(CountingMailbox):
    """In the 2nd queued step the device gives up waiting for the first layer that reads pages in just before the host
    answers it (its copies never made), then the next layer's answer fails (as a page that fails its check does)."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.skipped = 0

    def answer(self, entry: int, slots, copies) -> None:
        if self.opened == 2 and copies and not self.skipped:
            self.skipped = sum(n for _, _, n in copies)
            copies = []
        super().answer(entry, slots, copies)

    def fetch(self, entry: int, n: int):
        if self.opened == 2 and self.skipped:
            raise RQError("expert page failed")
        return super().fetch(entry, n)

    def failed(self) -> bool:  # (where no layer came after the skipped one)
        return (self.opened == 2 and self.skipped > 0) or self.released


def test_experts_a_step_that_raised_read_in_are_read_again(packed, monkeypatch):
    """A queued step whose answer raised after another layer's copies were never made: the error comes out, and the
    experts that step took in are not taken as resident later (the steps after compute the all-resident logits)."""
    ck = packed["qwen3_moe"]
    pager, cache, build = _queued_steps(ck, monkeypatch, LateThenFailingMailbox)
    tokens, got, raised = (5, 11, 17, 23, 29, 31), [], 0
    for t in tokens:  # the first WARMUP_STEPS run a stretch at a time
        try:
            got.append(pager.decode_step(build(t), cache)[0])
        except RQError:  # the step again, as a caller would: its layers route to the same experts
            raised += 1
            got.append(pager.decode_step(build(t), cache)[0])
    assert pager.mailbox.skipped > 0 and raised == 1
    ref = load(ck, tokenizer=False).model
    rcache = ref.make_cache(KVSettings(mode="fp16"))
    ref(mx.array([PROMPT[:12]]), cache=rcache)
    for c in rcache:
        c.end_prefill()
    for t, g in zip(tokens, got):
        want = ref(mx.array([[t]]), cache=rcache)
        assert mx.array_equal(want, g), (t, float(mx.abs(want - g).max()))
    pager.close()


def test_answers_run_in_order_on_their_thread_and_raise_on_the_callers():
    """mailbox.Answers: the answers run one after another in the order submitted, on a thread that is not the caller's;
    after an error the step's other answers are skipped and its mailbox released; join waits for all and raises the
    error once (check likewise); stop ends the thread; a dropped owner's answers keep nothing of it alive."""
    import gc
    import threading
    import weakref

    from rq_core.paging.mailbox import Answers

    class Box:
        released = 0

        def release_all(self):
            self.released += 1

    ran, box, answers = [], Box(), Answers()
    for i in range(20):
        answers.submit(lambda i=i: ran.append((i, threading.current_thread())), box)
    answers.join()
    assert [i for i, _ in ran] == list(range(20)) and {t for _, t in ran} != {threading.main_thread()}

    def fail():
        raise RQError("page failed")

    ran.clear()
    answers.submit(lambda: ran.append(0), box)
    answers.submit(fail, box)
    answers.submit(lambda: ran.append(2), box)
    with pytest.raises(RQError, match="page failed"):
        answers.join()
    assert ran == [0] and box.released == 1
    answers.join()  # raised once
    answers.check()
    answers.submit(fail, box)
    answers.join(raise_error=False)  # dropped: the caller is raising an error of its own
    answers.check()

    class Owner:
        pass

    owner = Owner()
    answers.submit(lambda o=owner: None, box)
    answers.join()
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None  # the thread, waiting for the next answer, holds nothing of the last
    thread = answers._thread
    answers.stop()
    assert not thread.is_alive()


@pytest.mark.parametrize("fault", [None, "ids not posted", "a copy left out", "slots not handed back", "wait gave up"])
def test_a_mailbox_whose_device_side_does_not_check_out_is_refused(monkeypatch, fault):
    """A Mailbox launches its kernels once through a spare entry, as a step's layer runs (ids posted, the host fetches
    and answers them with slots and two copies, 16-byte and 1-byte loads, while the kernels run), and checks what came
    back: a device that does not follow the protocol is refused with RQError (the pager then queues by stretch), not
    used to compute on the wrong experts. The device here is played by the host (on the CPU a host address is the
    device's)."""
    import ctypes

    import numpy as np

    from rq_core.paging import mailbox

    class MappedMemory:  # Copier.mapped_buffer's contract, host memory
        def __init__(self):
            self.held = []

        def mapped_buffer(self, n):
            b = np.zeros(n, np.uint8)
            self.held.append(b)
            return b, b.ctypes.data

    class Running:  # the wait and load kernels of a posted entry, run when their result is read
        def __init__(self, box, entry, n):
            self.box, self.entry, self.n = box, entry, n

        def __array__(self, dtype=None, copy=None):
            box, row, n = self.box, self.box.box[self.entry], self.n
            if fault == "wait gave up" or row[mailbox.GO] == 0:
                row[mailbox.FAILED] = 1
                return np.zeros(n, np.int32)
            listed = row[mailbox.NCOPY] - (fault == "a copy left out")
            for d, src, nb in row[box.desc:box.desc + 6 * listed].view(np.int64).reshape(-1, 3):
                ctypes.memmove(int(d), int(src), int(nb))
            slots = row[mailbox.HEAD + n:mailbox.HEAD + 2 * n].copy()
            return np.zeros_like(slots) if fault == "slots not handed back" else slots

    def post(self, entry, ids):
        row = self.box[entry]
        ids = np.array(ids).reshape(-1)
        row[mailbox.HEAD:mailbox.HEAD + ids.size] = ids + (fault == "ids not posted")
        if fault == "wait gave up":
            row[mailbox.FAILED] = 1
        row[mailbox.READY] = 1
        return Running(self, entry, ids.size)

    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: None, raising=False)
    monkeypatch.setattr(mailbox.Mailbox, "post", post)
    monkeypatch.setattr(mailbox.mx, "async_eval", lambda *a: None)
    if fault is None:
        box = mailbox.Mailbox(MappedMemory(), 3, 4, 8)
        assert not box.box.any()  # the check leaves no trace in the entries
    else:
        with pytest.raises(RQError, match="did not check out"):
            mailbox.Mailbox(MappedMemory(), 3, 4, 8)


def test_a_fetch_gives_up_when_the_step_is_released_or_its_wait_gave_up():
    """Mailbox.fetch (on page-locked memory, here a numpy array): a layer the device never posts is given up when the
    step is released from another thread (a layer not launched), ids posted are taken with progress moved on, and a
    posted layer whose wait has given up is not answered."""
    import threading

    import numpy as np

    from rq_core.paging import mailbox

    box = object.__new__(mailbox.Mailbox)
    box.k, box.box, box._released = 4, np.zeros((3, 16), np.int32), False
    box.box[0, mailbox.HEAD:mailbox.HEAD + 3] = [7, 8, 9]
    box.box[0, mailbox.READY] = 1
    assert box.fetch(0, 3).tolist() == [7, 8, 9] and box.box[0, mailbox.PROGRESS] == 1
    box.progress(0)
    assert box.box[0, mailbox.PROGRESS] == 2 and not box.failed()
    box.box[1, mailbox.READY] = box.box[1, mailbox.FAILED] = 1
    with pytest.raises(mailbox.Abandoned):
        box.fetch(1, 3)
    box.open()
    release = threading.Timer(0.2, box.release_all)
    release.start()
    with pytest.raises(mailbox.Abandoned):
        box.fetch(2, 3)
    release.join()  # the fetch gives up as the release begins, before it has raised every entry's flag
    assert box.failed() and (box.box[:, mailbox.GO] == 1).all()
    box.open()
    assert not box.failed()


def test_an_answer_lays_out_its_slots_and_copies_where_the_load_kernel_reads_them():
    """Mailbox.answer (here on a numpy array): the slots after the ids, the number of copies, the copies as int64
    (destination, source, bytes) triples from int32 word `desc` (8-byte aligned, past the slots), then `go`; the
    `load` kernel reads that layout. release_all lets an entry not answered run with no copies, never one answered."""
    import numpy as np

    from rq_core.paging import mailbox

    k, copies = 3, 4
    box = object.__new__(mailbox.Mailbox)
    box.k, box.copies, box._released = k, copies, False
    box.desc = -(-(mailbox.HEAD + 2 * k) // 2) * 2
    assert box.desc % 2 == 0 and box.desc >= mailbox.HEAD + 2 * k
    box.box = np.zeros((3, box.desc + 6 * copies), np.int32)
    box.box[:, mailbox.NCOPY] = 9  # what an earlier step left
    cps = [(1 << 40, (1 << 33) + 16, 688128), (5, 6, 86016)]
    box.answer(0, np.array([2, 0, 1], np.int32), cps)
    row = box.box[0]
    assert row[mailbox.HEAD + k:mailbox.HEAD + 2 * k].tolist() == [2, 0, 1] and row[mailbox.GO] == 1
    assert row[mailbox.NCOPY] == 2
    assert row[box.desc:box.desc + 6 * 2].view(np.int64).reshape(2, 3).tolist() == [list(c) for c in cps]
    with pytest.raises(RQError, match="internal"):
        box.answer(1, np.zeros(k, np.int32), [(0, 0, 1)] * (copies + 1))
    box.release_all()
    assert box.box[:, mailbox.NCOPY].tolist() == [2, 0, 0] and (box.box[:, mailbox.GO] == 1).all()
    before = box.box.copy()
    with pytest.raises(mailbox.Abandoned):  # an answer after the release writes nothing (the device may be copying)
        box.answer(2, np.array([1, 1, 1], np.int32), cps)
    assert (box.box == before).all()
