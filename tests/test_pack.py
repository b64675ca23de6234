"""`rq pack`: each expert's tensors contiguous and aligned (16 KiB, 4 KiB for small experts), with checksums;
atomic."""

import json
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from _tiny_models import make_tiny
from rq_core.quant import recipe
from rq_core.errors import RQError
from rq_core.paging.pack import ALIGN, SMALL_ALIGN, decode_page, load_index, pack, page_align
from rq_core.quant.quantize import quantize

RECIPE = Path(__file__).parent / "data" / "tiny-rtn.toml"


@pytest.fixture(scope="module")
def qckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    src = make_tiny("qwen3_moe", root / "src")
    quantize(src, recipe.load(RECIPE), root / "q")
    return root / "q"


def test_pages_hold_each_expert_exactly(qckpt):
    res = pack(qckpt)
    idx = load_index(qckpt)
    assert res.layers == 2 and res.experts == 16
    weights = mx.load(str(qckpt / "model.safetensors"))
    for path, meta in idx["layers"].items():
        align = page_align(meta["used_bytes"])
        assert meta["page_bytes"] % align == 0 and 0 <= meta["page_bytes"] - meta["used_bytes"] < align
        data = (qckpt / "experts" / meta["file"]).read_bytes()
        assert len(data) == meta["page_bytes"] * meta["num_experts"]
        for e in range(meta["num_experts"]):
            page = data[e * meta["page_bytes"]: e * meta["page_bytes"] + meta["used_bytes"]]
            assert zlib.crc32(page) == meta["crc32"][e]
            got = decode_page(page, meta["tensors"])
            for name, arr in got.items():
                ref = weights[f"{path}.{name}"][e]
                if ref.dtype == mx.bfloat16:
                    ref = ref.view(mx.uint16)
                assert np.array_equal(np.array(ref), arr), (path, e, name)


def test_repack_replaces_atomically_and_cli_json(qckpt):
    from rq_cli.main import app

    r = CliRunner().invoke(app, ["pack", str(qckpt), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)["pack"]
    assert d["experts"] == 16 and d["page_bytes"] % SMALL_ALIGN == 0
    assert not [p for p in qckpt.iterdir() if p.name.startswith(".experts")]


def test_pack_errors_are_one_line(tmp_path):
    from rq_cli.main import app

    r = CliRunner().invoke(app, ["pack", str(tmp_path)])
    assert r.exit_code == 2 and "no config.json" in r.output
    with pytest.raises(RQError, match="rq pack"):
        load_index(tmp_path)


def test_page_alignment_costs_at_most_a_sixteenth():
    assert page_align(16 * ALIGN) == ALIGN and page_align(16 * ALIGN - 1) == SMALL_ALIGN
    for used in (1, 4095, 4097, 55296, 16 * ALIGN, 1_300_000):
        a = page_align(used)
        page = -(-used // a) * a
        assert page - used < a and (used < 16 * ALIGN or (page - used) * 16 <= used)
