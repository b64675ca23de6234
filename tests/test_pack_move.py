"""`rq pack --move`: the routed experts are stored once (in the pages), the checkpoint still runs all-resident
(reading its banks from the pages) and paged, with the tokens of the unpacked model; errors are one line."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rq_core.checkpoint import DEFAULT_MODEL, load
from rq_core.errors import RQError
from rq_core.generate import generate
from rq_core.paging.pack import moved_experts, pack
from rq_core.paging.pager import ExpertPager

PROMPT = list(range(3, 43))


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _tokens(ck, slots=None):
    model = load(ck, tokenizer=False, cpu_float32=True).model
    pager = ExpertPager(model, ck, slots=slots) if slots else None
    try:
        return generate(model, PROMPT, max_tokens=16, prefill_chunk=16).tokens
    finally:
        if pager:
            pager.close()


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    root = tmp_path_factory.mktemp("move")
    ck = root / "m"
    shutil.copytree(DEFAULT_MODEL, ck, ignore=shutil.ignore_patterns("experts", ".experts*"))
    before = _size(ck)
    ref = _tokens(ck)
    r = CliRunner().invoke(__import__("rq_cli.main", fromlist=["app"]).app, ["pack", str(ck), "--move", "--json"])
    assert r.exit_code == 0, r.output
    return ck, before, ref


def test_experts_are_stored_once(moved):
    ck, before, _ = moved
    assert moved_experts(ck) and (ck / "experts" / "index.json").is_file()
    assert _size(ck) <= 1.05 * before, (_size(ck), before)
    names = json.loads((ck / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (ck / "model.safetensors").read_bytes()[:8], "little")])
    assert not [k for k in names if ".switch_mlp." in k]


def test_moved_checkpoint_runs_all_resident_and_paged_with_the_same_tokens(moved):
    ck, _, ref = moved
    assert _tokens(ck) == ref
    assert _tokens(ck, slots=2) == ref
    from rq_cli.main import app

    r = CliRunner().invoke(app, ["run", str(ck), "-p", "to be or not", "-n", "6", "--temp", "0", "--json"])
    assert r.exit_code == 0, r.output


def test_pack_again_and_move_with_out_are_one_line(moved, tmp_path):
    ck, _, _ = moved
    with pytest.raises(RQError, match="live only in its pages"):
        pack(ck)
    res = pack(ck, move=True)  # nothing left to move: the pages are kept as they are
    assert res.bytes_written == 0 and res.experts == 48
    with pytest.raises(RQError, match="cannot be combined with --out"):
        pack(ck, move=True, out=tmp_path / "p")


def test_a_corrupt_or_foreign_page_of_a_moved_checkpoint_is_one_line(moved, tmp_path):
    ck, _, _ = moved
    c = tmp_path / "c"
    shutil.copytree(ck, c)
    f = sorted((c / "experts").glob("*.bin"))[0]
    data = bytearray(f.read_bytes())
    data[10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(RQError, match="corrupt expert page"):
        _tokens(c)
    idx = json.loads((c / "experts" / "index.json").read_text())
    for meta in idx["layers"].values():
        meta["source"] = "tensors:" + "0" * 64  # pages of other weights
    (c / "experts" / "index.json").write_text(json.dumps(idx))
    with pytest.raises(RQError, match="only copy"):
        _tokens(c)


def test_malformed_moved_metadata_is_one_line(moved, tmp_path):
    import mlx.core as mx

    ck, _, _ = moved
    c = tmp_path / "c"
    shutil.copytree(ck, c)
    w = mx.load(str(c / "model.safetensors"))
    mx.eval(w)  # read before the file is rewritten
    for bad in ("{not json", json.dumps({"model.layers.0.mlp.switch_mlp": {"fingerprint": 1, "tensors": {}}}),
                json.dumps({"model.layers.0.mlp.switch_mlp": {"fingerprint": "x", "tensors": {
                    "elsewhere.weight": {"shape": [1], "dtype": "U32"}}}})):
        mx.save_safetensors(str(c / "model.safetensors"), w, metadata={"rq_moved_experts": bad})
        with pytest.raises(RQError, match="rq_moved_experts metadata is malformed"):
            load(c, tokenizer=False)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_moe"])
def test_move_takes_banks_stored_under_mlx_lm_names(tmp_path, family):
    """rq quantize stores Nemotron-H's banks under mlx-lm's names (`switch_mlp.fc1` / `fc2`, loaded as up_proj /
    down_proj): --move finds and takes them by the name they load under, and the checkpoint runs as before."""
    from _tiny_models import make_tiny
    from rq_core.quant import recipe
    from rq_core.quant.quantize import quantize

    ck = tmp_path / "q"
    quantize(make_tiny(family, tmp_path / "src"), recipe.load(Path(__file__).parent / "data" / "tiny-rtn.toml"), ck)
    ref = generate(load(ck, tokenizer=False).model, PROMPT, max_tokens=8, prefill_chunk=16).tokens
    pack(ck, move=True)
    assert moved_experts(ck)
    for f in ck.glob("*.safetensors"):
        hdr = json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")])
        assert not [k for k in hdr if ".switch_mlp." in k], f
    assert generate(load(ck, tokenizer=False).model, PROMPT, max_tokens=8, prefill_chunk=16).tokens == ref


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_move_of_a_hub_layout_is_one_line(tmp_path, family):
    """A per-expert hub layout is not stacked banks: --move refuses in one line (the names are mapped through the
    model's sanitize, which must not turn that into a crash)."""
    from _tiny_models import make_tiny

    src = make_tiny(family, tmp_path / "src")
    with pytest.raises(RQError, match="not stored as stacked banks"):
        pack(src, move=True)
