"""A downloaded checkpoint is untrusted input: the files its index names stay inside its folder, bad tensors
and config values are refused at load, broken weights stop generation with an error, and every malformed
file is one line and exit 2 (never a traceback). Built on copies of the bundled model."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rq_core import checkpoint
from rq_core.errors import RQError
from rq_core.generate import decode_steps, generate
from test_bad_input import _invoke, _one_line_error

SRC = checkpoint.DEFAULT_MODEL
ST = "model.safetensors"
INDEX = "model.safetensors.index.json"
SECRET = b"SECRET!!not a safetensors file"


def _copy(root: Path, name: str = "m") -> Path:
    return Path(shutil.copytree(SRC, root / name))


def _edit_json(path: Path, **changes) -> None:
    obj = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**obj, **changes}))


def _run(ck: Path):
    return _invoke("run", ck, "-p", "Once upon a time", "-n", "4", "--json")


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(path: Path, header, data: bytes) -> None:
    h = json.dumps(header).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(struct.pack("<Q", len(h)) + h + data)
    os.replace(tmp, path)  # a new file: arrays still mapped from the old one keep their data


def _save_tensors(ck: Path, **changes: mx.array) -> None:
    w = dict(mx.load(str(ck / ST)))
    mx.eval(list(w.values()))
    w.update(changes)
    tmp = ck / "new.safetensors"  # the name save_safetensors keeps
    mx.save_safetensors(str(tmp), w, metadata={"format": "mlx"})
    os.replace(tmp, ck / ST)


# ----------------------------------------------------------------------------- reads outside the checkpoint
def test_index_names_only_files_inside_the_checkpoint(tmp_path):
    other = _copy(tmp_path, "other")  # a valid checkpoint elsewhere: following a name there would load it
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    ck = _copy(tmp_path)
    (ck / ST).rename(ck / "shard-1.safetensors")
    for name in (str(other / ST), "../other/model.safetensors", "./../other/model.safetensors",
                 "sub/shard-1.safetensors", "..", str(secret), "/etc/passwd"):
        (ck / INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))
        _one_line_error(_run(ck), "weight_map")
    # a link the user or the hub cache made (a snapshot's ../../blobs/<sha>) is followed: names are checked
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (ck / "shard-1.safetensors").rename(blobs / "0123abcd")
    (ck / "shard-1.safetensors").symlink_to(Path("..") / "blobs" / "0123abcd")
    (ck / INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": "shard-1.safetensors"}}))
    assert _run(ck).exit_code == 0
    # a weights file that links to a file that is not safetensors: refused without quoting its bytes
    (ck / INDEX).unlink()
    (ck / "shard-1.safetensors").unlink()
    (ck / ST).symlink_to(secret)
    r = _run(ck)
    _one_line_error(r, "not a safetensors file")
    first8 = struct.unpack("<Q", SECRET[:8])[0]
    assert str(first8) not in r.output and "SECRET" not in r.output


# ------------------------------------------------------------------------------------ bad weights accepted
def test_bad_tensors_and_config_values_are_refused(tmp_path):
    ck = _copy(tmp_path)
    good = dict(mx.load(str(SRC / ST)))
    _save_tensors(ck, **{"lm_head.scales": good["lm_head.scales"].astype(mx.int32)})
    _one_line_error(_run(ck), "lm_head.scales has dtype int32")
    _save_tensors(ck, **{"lm_head.scales": good["lm_head.scales"],
                         "model.norm.weight": good["model.norm.weight"].astype(mx.int32)})
    _one_line_error(_run(ck), "model.norm.weight has dtype int32")

    ck2 = _copy(tmp_path, "k0")
    _edit_json(ck2 / "config.json", num_experts_per_tok=0)
    _one_line_error(_run(ck2), "num_experts_per_tok")


GOLDEN = Path(__file__).parent / "golden"
# model_type -> (config key of the experts chosen per token, ModelArgs field of the expert count)
TOP_K = {"qwen2_moe": ("num_experts_per_tok", "num_experts"), "qwen3_moe": ("num_experts_per_tok", "num_experts"),
         "nemotron_h": ("num_experts_per_tok", "n_routed_experts"), "gemma4": ("top_k_experts", "num_experts")}


@pytest.mark.parametrize("family", sorted(TOP_K))
def test_every_family_checks_experts_per_token_and_dtypes(tmp_path, family):
    ck = Path(shutil.copytree(GOLDEN / family / "model", tmp_path / "m"))
    cfg = json.loads((ck / "config.json").read_text())
    top_k, count = TOP_K[family]
    experts = getattr(checkpoint.build_model(cfg).args, count)
    (cfg.get("text_config") or cfg)[top_k] = experts + 1
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RQError, match=top_k):
        checkpoint.load(ck, tokenizer=False)
    shutil.copy(GOLDEN / family / "model" / "config.json", ck / "config.json")
    w = dict(mx.load(str(ck / ST)))
    norm = sorted(k for k in w if k.endswith("norm.weight"))[0]
    _save_tensors(ck, **{norm: w[norm].astype(mx.int32)})
    with pytest.raises(RQError, match=f"{norm} has dtype int32"):
        checkpoint.load(ck, tokenizer=False)


def test_non_finite_weights_stop_generation_with_an_error(tmp_path):
    ck = _copy(tmp_path)
    norm = mx.load(str(SRC / ST))["model.norm.weight"]
    for bad in (mx.nan, mx.inf):
        _save_tensors(ck, **{"model.norm.weight": mx.full(norm.shape, bad, dtype=norm.dtype)})
        _one_line_error(_run(ck), "not finite")
    with pytest.raises(RQError, match="not finite"):  # the library raises the same, when sampling too
        generate(checkpoint.load(ck, tokenizer=False).model, [5, 6, 7], max_tokens=3, temp=0.7, seed=1)


class _CountingModel:
    """Logits that pick (input + 1) mod 8; NaN logits from the call `nan_at` on; records each call."""

    def __init__(self, events: list, nan_at: int = 0):
        self.events, self.calls, self.nan_at = events, 0, nan_at

    def __call__(self, tokens: mx.array, cache=None, last: bool = False) -> mx.array:
        self.calls += 1
        self.events.append("step")
        logits = (mx.arange(8) == (tokens[..., None] + 1) % 8).astype(mx.float32)
        return logits * mx.nan if self.nan_at and self.calls >= self.nan_at else logits


class _FirstRead:
    """The read array of the prompt's token, recording when it is read."""

    def __init__(self, events: list):
        self.events = events

    def tolist(self) -> list[int]:
        self.events.append("read")
        return [0, 1]


@pytest.mark.parametrize("pipeline", [True, False])
def test_decode_queues_the_next_step_before_it_reads_a_token(pipeline):
    events: list = []
    toks = []
    for t in decode_steps(_CountingModel(events), [], mx.array([0]), _FirstRead(events), 4, temp=0.0, top_p=1.0,
                          pipeline=pipeline):
        toks.append(t)
        events.append("token")
    assert toks == [0, 1, 2, 3]
    # pipelined: step 1 is built and queued before token 0 is read; an expert pager reads first
    assert events[:3] == (["step", "read", "token"] if pipeline else ["read", "token", "step"])
    assert events.count("step") == 3  # no step past the last token
    with pytest.raises(RQError, match="not finite"):
        list(decode_steps(_CountingModel([], nan_at=2), [], mx.array([0]), _FirstRead([]), 4, temp=0.0,
                          top_p=1.0, pipeline=pipeline))


# ----------------------------------------------------------------------------------- tracebacks → one line
def _some_tensor(header: dict) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


def _last_tensor(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def _shifted(h: dict, by: int) -> dict:
    last = _last_tensor(h)
    h[last]["data_offsets"] = [o + by for o in h[last]["data_offsets"]]
    return h


# mx.load itself refuses, in one line, dtype names it does not know and offsets that do not match the
# shape; these are the cases it does not catch
HEADER_CASES = {
    "a JSON list": (lambda h: [1, 2], "not a JSON object"),
    "no data_offsets": (lambda h: {**h, _some_tensor(h): {"dtype": "F16", "shape": [2]}}, "data_offsets"),
    "overlapping": (lambda h: _shifted(h, -4), "overlap"),
    "offsets of strings": (lambda h: {**h, _some_tensor(h): {"dtype": "U8", "shape": [8], "data_offsets": ["0", "8"]}},
                           "data_offsets"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_malformed_safetensors_header_is_one_line(tmp_path, case):
    ck = _copy(tmp_path)
    edit, needle = HEADER_CASES[case]
    header, data = _header(ck / ST)
    _write_st(ck / ST, edit(header), data)
    _one_line_error(_run(ck), needle)


@pytest.mark.parametrize("file,key,value,needle", [
    ("config.json", "num_experts_per_tok", 9, "num_experts_per_tok"),
    ("config.json", "vocab_size", 10 ** 12, "vocab_size"),
    ("config.json", "hidden_size", True, "hidden_size"),
    ("config.json", "eos_token_id", "0", "eos_token_id"),
    ("config.json", "max_position_embeddings", 2048.5, "max_position_embeddings"),
    ("generation_config.json", "eos_token_id", 2.0, "eos_token_id"),
    ("generation_config.json", "eos_token_id", [[2]], "eos_token_id"),
    ("generation_config.json", "eos_token_id", True, "eos_token_id"),
    ("generation_config.json", "eos_token_id", {"id": 2}, "eos_token_id"),
    ("generation_config.json", "eos_token_id", -1, "eos_token_id"),
    ("config.json", "eos_token_id", [0, -2], "eos_token_id"),
    ("config.json", "num_key_value_heads", 3, "num_attention_heads"),
    ("config.json", "rope_scaling", {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 2.0},
     "partial_rotary_factor"),
])
def test_malformed_config_values_are_one_line(tmp_path, file, key, value, needle):
    ck = _copy(tmp_path)
    _edit_json(ck / file, **{key: value})
    _one_line_error(_run(ck), needle, file)


@pytest.mark.parametrize("where,key,value", [("", "group_size", 0), ("", "bits", 0), ("", "bits", -4),
                                             ("lm_head", "group_size", 0)])
def test_quantization_sizes_are_positive_integers(tmp_path, where, key, value):
    """config.json's quantization group_size and bits, at the top level and a layer's own: a value below 1 is one
    line (the bundled model gives every layer its own, so a bad top-level value is read by no layer: refused all the
    same)."""
    ck = _copy(tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    spec = cfg["quantization"][where] if where else cfg["quantization"]
    spec[key] = value
    (ck / "config.json").write_text(json.dumps(cfg))
    _one_line_error(_run(ck), f"quantization {key}{f' of {where}' if where else ''} must be a positive integer")


@pytest.mark.parametrize("n", [0, -1, 2.5, True, "4096"])
def test_context_length_is_a_positive_integer(n):
    """max_position_embeddings, the context generation stops at: a positive integer, or absent (no limit)."""
    with pytest.raises(RQError, match="max_position_embeddings must be a positive integer"):
        checkpoint.context_length({"max_position_embeddings": n})
    assert checkpoint.context_length({"max_position_embeddings": 1}) == 1
    assert checkpoint.context_length({}) is None


@pytest.mark.parametrize("weight_map", [[ST], ST, None, 3])
def test_weight_map_that_is_not_an_object_is_one_line(tmp_path, weight_map):
    ck = _copy(tmp_path)
    (ck / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    _one_line_error(_run(ck), "weight_map")


def test_json_file_of_binary_data_is_one_line(tmp_path):
    ck = _copy(tmp_path)
    (ck / "generation_config.json").write_bytes(b"\xff\xfe" + SECRET)
    r = _run(ck)
    _one_line_error(r, "generation_config.json")
    assert "SECRET" not in r.output


# ------------------------------------------------------------------------------------- property: the loader
_OPENED: list | None = None  # paths opened while recording (the audit hook is installed once per process)
_HOOKED = False


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


def _load_recording(ck: Path) -> tuple[object, list[str]]:
    """checkpoint.load(ck), and the paths it opened; (RQError, paths) when it refused."""
    global _OPENED, _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    _OPENED = []
    try:
        out = checkpoint.load(ck, tokenizer=False)
    except RQError as e:
        out = e
    finally:
        opened, _OPENED = _OPENED, None
    return out, opened


_scalars = (st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40) | st.integers(0, 16)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                     max_leaves=6)
_CONFIG_KEYS = ["num_experts_per_tok", "num_experts", "vocab_size", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
                "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
                "mlp_only_layers", "decoder_sparse_step", "eos_token_id", "use_sliding_window", "sliding_window",
                "layer_types", "quantization", "quantization_config"]
_TENSOR_FIELDS = st.sampled_from(["dtype", "shape", "data_offsets", None])  # None: the whole entry


@st.composite
def _checkpoint_edits(draw, outside: Path):
    """(config.json changes, generation_config.json, header edit, index) — each one left out half the time."""
    def maybe(strategy):
        return draw(strategy) if draw(st.booleans()) else None

    cfg = maybe(st.dictionaries(st.sampled_from(_CONFIG_KEYS), _json, min_size=1, max_size=2)) or {}
    gen = maybe(st.fixed_dictionaries({"eos_token_id": _json}))
    header = maybe(st.tuples(st.integers(0, 10 ** 6), _TENSOR_FIELDS,
                             _json | st.sampled_from(["F16", "U32", "I32", "F64"])
                             | st.lists(st.integers(-4, 1 << 24), min_size=2, max_size=2))
                   | _json.map(lambda v: ("whole", v)))
    names = st.sampled_from([ST, "./" + ST, "../outside/" + ST, str(outside / ST), str(outside / "secret.bin"),
                             "/etc/passwd", "sub/" + ST, "..", ".", "", ST + "\x00", "..\\outside\\" + ST]) | _json
    index = maybe(st.dictionaries(st.sampled_from(["lm_head.weight", "model.norm.weight"]), names,
                                  min_size=1, max_size=2) | _json)
    return cfg, gen, header, index


@pytest.fixture(scope="module")
def fuzz_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    outside = root / "outside"
    shutil.copytree(SRC, outside)  # a loadable checkpoint outside: following a name there would succeed
    (outside / "secret.bin").write_bytes(SECRET)
    ck = _copy(root, "ck")
    checkpoint.load(ck, tokenizer=False)  # imports done before any recording
    return ck, outside


_SRC_HEADER, _SRC_DATA = _header(SRC / ST)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_loader_refuses_or_loads_and_stays_inside(fuzz_dirs, data):
    ck, outside = fuzz_dirs
    cfg, gen, header, index = data.draw(_checkpoint_edits(outside))
    config = json.loads((SRC / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, **cfg}))
    (ck / "generation_config.json").write_text(json.dumps(gen if gen is not None else {"eos_token_id": 0}))
    h = json.loads(json.dumps(_SRC_HEADER))
    if header is not None:
        which, field, value = header if header[0] != "whole" else (None, None, header[1])
        if which is None:
            h = value
        else:
            name = sorted(k for k in h if k != "__metadata__")[which % (len(h) - 1)]
            if field is None:
                h[name] = value
            else:
                h[name][field] = value
    _write_st(ck / ST, h, _SRC_DATA)
    if index is None:
        (ck / INDEX).unlink(missing_ok=True)
    else:
        (ck / INDEX).write_text(json.dumps({"weight_map": index} if isinstance(index, dict) else index))

    out, opened = _load_recording(ck)
    inside = os.path.realpath(ck) + os.sep
    assert all(os.path.realpath(p).startswith(inside) for p in opened), opened
    if isinstance(out, RQError):
        assert str(out) and "\n" not in str(out)
        event("refused")
        return
    event("loaded")
    assert all(isinstance(t, int) for t in out.eos_token_ids)
    try:  # loaded: generation runs, or stops with an RQError (e.g. non-finite logits)
        generate(out.model, [5, 6, 7], max_tokens=2)
    except RQError as e:
        assert "\n" not in str(e)
