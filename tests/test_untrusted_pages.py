"""Expert pages are untrusted input (they come from the hub with a checkpoint): names outside the pack,
corrupt pages, stale pages, a re-pack killed mid-swap, malformed indexes, and `rq pack --out`.
Each case ends in one clear line and exit 2, or in exactly the tokens of the resident model."""

import itertools
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from rq_cli.main import app
from rq_core.checkpoint import DEFAULT_MODEL, load
from rq_core.errors import RQError
from rq_core.generate import generate
from rq_core.paging.pack import pack
from rq_core.paging.pager import ExpertPager, budget_for_slots

PROMPT = "to be or not to be, that is the question: whether 'tis nobler in the mind to suffer"
BANK = "model.layers.0.mlp.switch_mlp"


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_error(r, *needles: str) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    for n in needles:
        assert n in lines[0], r.output
    return lines[0]


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """A packed copy of the bundled model, its resident greedy tokens, and a budget of 2 of 8 experts."""
    ck = tmp_path_factory.mktemp("untrusted") / "m"
    shutil.copytree(DEFAULT_MODEL, ck)
    pack(ck)
    base = ["run", ck, "-p", PROMPT, "-n", "8", "--temp", "0", "--json"]
    full = json.loads(_invoke(*base).stdout)["tokens"]
    plan = json.loads(_invoke(*base, "--memory-budget", "1GB", "--plan").stdout)["plan"]
    budget = budget_for_slots(plan, 2)
    r = _invoke(*base, "--memory-budget", budget)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["pager"]["slots"] == 2 and d["tokens"] == full
    return ck, full, budget


def _copy(bundled, tmp_path) -> Path:
    ck = tmp_path / "m"
    shutil.copytree(bundled[0], ck)
    return ck


def _run(ck, budget, *extra):
    return _invoke("run", ck, "-p", PROMPT, "-n", "8", "--temp", "0", "--json", "--memory-budget", budget, *extra)


def _edit_index(ck: Path, fn) -> None:
    p = ck / "experts" / "index.json"
    idx = json.loads(p.read_text())
    fn(idx)
    p.write_text(json.dumps(idx))


# 1 ------------------------------------------------------------------------------------ reads outside
@pytest.mark.parametrize("kind", ["dotdot", "absolute", "subdir"])
def test_page_names_outside_the_pack_are_refused(bundled, tmp_path, kind):
    ck = _copy(bundled, tmp_path)
    # symlinks the user made stay fine: the pack folder and a page file both links to elsewhere
    moved = tmp_path / "elsewhere"
    shutil.move(ck / "experts", moved)
    (ck / "experts").symlink_to(moved)
    link = moved / "model.layers.1.mlp.switch_mlp.bin"
    shutil.move(link, tmp_path / "p1.bin")
    link.symlink_to(tmp_path / "p1.bin")
    r = _run(ck, bundled[2])
    assert r.exit_code == 0 and json.loads(r.stdout)["tokens"] == bundled[1], r.output
    (ck / "experts").unlink()
    shutil.move(moved, ck / "experts")
    page = ck / "experts" / f"{BANK}.bin"
    # a valid page file planted outside the pack: reading it would "work", which is the bug
    outside = {"dotdot": ck / "outside.bin", "absolute": tmp_path / "abs.bin",
               "subdir": ck / "experts" / "sub" / "p.bin"}[kind]
    outside.parent.mkdir(exist_ok=True)
    shutil.copy(page, outside)
    name = {"dotdot": "../outside.bin", "absolute": str(outside), "subdir": "sub/p.bin"}[kind]
    _edit_index(ck, lambda idx: idx["layers"][BANK].update(file=name))
    _one_line_error(_run(ck, bundled[2]), "plain file name inside the pack folder")


def test_error_never_echoes_the_bytes_of_a_file(bundled, tmp_path):
    ck = _copy(bundled, tmp_path)
    secret = ck / "secret.txt"
    size = (ck / "experts" / f"{BANK}.bin").stat().st_size  # the size a page file of this layer has
    secret.write_text(("TOPSECRET-" * (size // 10 + 1))[:size])
    _edit_index(ck, lambda idx: idx["layers"][BANK].update(file="../secret.txt"))
    line = _one_line_error(_run(ck, bundled[2]))
    assert "TOPSECRET" not in line


# 2 ------------------------------------------------------------------------------------ checksums
@pytest.mark.parametrize("damage", ["one byte", "256 bytes of each expert"])
def test_corrupt_pages_are_reported_not_used(bundled, tmp_path, damage):
    ck = _copy(bundled, tmp_path)
    idx = json.loads((ck / "experts" / "index.json").read_text())
    meta = idx["layers"][BANK]
    f = ck / "experts" / meta["file"]
    data = bytearray(f.read_bytes())
    if damage == "one byte":
        experts = [3]
        data[3 * meta["page_bytes"] + 100] ^= 0x01
    else:
        experts = list(range(meta["num_experts"]))
        for e in experts:
            o = e * meta["page_bytes"] + 1000
            data[o:o + 256] = bytes(256)
    f.write_bytes(bytes(data))
    line = _one_line_error(_run(ck, bundled[2], "--pager", "lru"), f"layer {BANK} expert", "corrupt")
    assert any(f"expert {e} " in line for e in experts), line


def test_verification_can_be_switched_off_in_the_same_process(bundled, tmp_path):
    ck = _copy(bundled, tmp_path)
    meta = json.loads((ck / "experts" / "index.json").read_text())["layers"][BANK]
    f = ck / "experts" / meta["file"]
    data = bytearray(f.read_bytes())
    for e in range(meta["num_experts"]):
        data[e * meta["page_bytes"] + meta["used_bytes"] - 1] ^= 0x80
    f.write_bytes(bytes(data))
    ids = list(range(3, 43))
    m = load(ck, tokenizer=False).model
    ExpertPager(m, ck, slots=2)  # verify is the default
    with pytest.raises(RQError, match=f"corrupt expert page: layer {BANK} expert"):
        generate(m, ids, max_tokens=2)
    m = load(ck, tokenizer=False).model
    p = ExpertPager(m, ck, slots=2, verify=False)  # to measure what checking costs
    assert len(generate(m, ids, max_tokens=2).tokens) == 2 and p.stats.misses > 0


def _offsets(ck: Path) -> dict:
    import struct

    with open(ck / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return {k: v["data_offsets"] for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


# 3 ------------------------------------------------------------------------------------ stale packs
def test_stale_pages_are_refused(bundled, tmp_path):
    ck = _copy(bundled, tmp_path)
    before = _offsets(ck)
    w = mx.load(str(ck / "model.safetensors"))
    # other tensors change (and the banks move inside the file): the pages stay valid
    w["model.embed_tokens.scales"] = w["model.embed_tokens.scales"].astype(mx.float32) * 1.5
    mx.save_safetensors(str(ck / "model.safetensors"), w, metadata={"format": "mlx"})
    after = _offsets(ck)
    assert any(before[k] != after[k] for k in before if ".switch_mlp." in k)
    r = _run(ck, bundled[2])
    assert r.exit_code == 0, r.output
    # a bank's weights change (as a re-quantization does): its old pages must not be used
    w = mx.load(str(ck / "model.safetensors"))
    k = "model.layers.2.mlp.switch_mlp.down_proj.scales"
    w[k] = w[k] * 1.01
    mx.save_safetensors(str(ck / "model.safetensors"), w, metadata={"format": "mlx"})
    _one_line_error(_run(ck, bundled[2]), "stale", "model.layers.2.mlp.switch_mlp", "rq pack")
    assert _invoke("pack", ck).exit_code == 0
    assert _run(ck, bundled[2]).exit_code == 0


# 4 ------------------------------------------------------------------------------------ killed re-pack
_DEAD_PIDS = itertools.count(4_194_305)  # above Linux's largest pid_max (2^22) and macOS's 99,998: never a live process


def _dead_pid() -> int:
    """A PID no process has (a reaped child's can be handed out again while other tests spawn processes)."""
    return next(_DEAD_PIDS)


def test_pack_stranded_by_a_kill_between_the_renames_is_recovered(bundled, tmp_path):
    ck = _copy(bundled, tmp_path)
    pid = _dead_pid()
    # what a re-pack killed between its two renames leaves: the old pack moved aside, the new one complete
    shutil.copytree(ck / "experts", ck / f".experts.tmp-{pid}")
    (ck / "experts").rename(ck / f".experts.old-{pid}")
    other = _dead_pid()
    (ck / f".experts.tmp-{other}").mkdir()  # a writer killed early: an empty temp folder
    (ck / f".experts.tmp-{other}" / f"{BANK}.bin").write_bytes(b"\0" * 10)
    keep = ck / f".experts.old-{other}"  # not the tool's (a foreign file inside): never deleted
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    r = _run(ck, bundled[2])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == bundled[1]
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith(".experts")) == [keep.name]
    assert (keep / "notes.txt").read_text() == "mine"


def test_repack_keeps_what_the_tool_did_not_write(bundled, tmp_path):
    ck = _copy(bundled, tmp_path)
    (ck / "experts" / "README").write_text("mine")
    _one_line_error(_invoke("pack", ck), "did not write")
    assert (ck / "experts" / "README").read_text() == "mine"
    (ck / "experts" / "README").unlink()
    # the user's symlink to another disk stays a symlink: the new pack is swapped in at its target
    moved = tmp_path / "disk2" / "pages"
    moved.parent.mkdir()
    shutil.move(ck / "experts", moved)
    (ck / "experts").symlink_to(moved)
    (moved / "index.json").write_bytes((moved / "index.json").read_bytes().replace(b'"crc32": [', b'"crc32": [ '))
    assert _invoke("pack", ck).exit_code == 0
    assert (ck / "experts").is_symlink() and b'"crc32": [ ' not in (moved / "index.json").read_bytes()
    assert not [p for p in (*ck.iterdir(), *moved.parent.iterdir()) if p.name.startswith(".")]
    r = _run(ck, bundled[2])
    assert r.exit_code == 0 and json.loads(r.stdout)["tokens"] == bundled[1], r.output


# 5 ------------------------------------------------------------------------------------ malformed index
def _set(layer_key, value):
    return lambda idx: idx["layers"][BANK].update({layer_key: value})


def _tensor0(key, value):
    return lambda idx: idx["layers"][BANK]["tensors"][0].update({key: value})


@pytest.mark.parametrize("edit,needle", [
    (_set("num_experts", 4), "crc32"),
    (lambda idx: idx["layers"][BANK].update(num_experts=4, crc32=idx["layers"][BANK]["crc32"][:4]), "shape"),
    (_set("num_experts", "8"), "num_experts"),
    (_set("file", 5), "plain file name"),
    (_set("tensors", "x"), "tensors"),
    (_tensor0("dtype", "float8"), "unknown dtype"),
    (_tensor0("shape", [192, 8]), "nbytes"),
    (lambda idx: [idx["layers"][BANK]["tensors"][0].update(shape=[96, 32])], "shape"),
    (lambda idx: idx.update(layers=None), "no layers"),
    (lambda idx: idx["layers"].update({BANK: [1]}), "not an object"),
    (lambda idx: idx["layers"][BANK]["tensors"][1].update(offset=idx["layers"][BANK]["tensors"][0]["offset"]),
     "overlap"),
], ids=["count", "count-and-crc", "type-count", "type-file", "type-tensors", "dtype", "shape-nbytes",
        "shape-model", "no-layers", "layer-list", "overlap"])
def test_malformed_index_is_one_line(bundled, tmp_path, edit, needle):
    ck = _copy(bundled, tmp_path)
    _edit_index(ck, edit)
    _one_line_error(_run(ck, bundled[2]), needle)


def test_truncated_page_file_is_one_line(bundled, tmp_path):
    ck = _copy(bundled, tmp_path)
    page = ck / "experts" / f"{BANK}.bin"
    full = page.read_bytes()
    for size in (0, len(full) // 2 + 7, len(full) - 1):
        page.write_bytes(full[:size])
        _one_line_error(_run(ck, bundled[2], "--pager", "lru"), "truncated", BANK)


# 6 ------------------------------------------------------------------------------------ rq pack --out
def test_pack_out_leaves_the_bundled_model_untouched(bundled, tmp_path):
    before = sorted(p.name for p in DEFAULT_MODEL.iterdir())
    out = tmp_path / "pages"
    r = _invoke("pack", "--out", out, "--json")  # no MODEL: the bundled one, inside the installed package
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["pack"]["out"] == str(out) and (out / "index.json").is_file()
    assert sorted(p.name for p in DEFAULT_MODEL.iterdir()) == before
    base = ["run", "-p", PROMPT, "-n", "8", "--temp", "0", "--json", "--memory-budget", bundled[2]]
    r = _invoke(*base, "--pages", out)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["tokens"] == bundled[1] and d["pager"]["slots"] == 2
    _one_line_error(_invoke(*base, "--pages", tmp_path / "none"), "no expert pages")
    # the pages belong to the bundled model: another checkpoint's weights make them stale
    ck = _copy(bundled, tmp_path)
    w = mx.load(str(ck / "model.safetensors"))
    w[f"{BANK}.up_proj.scales"] = w[f"{BANK}.up_proj.scales"] * 2
    mx.save_safetensors(str(ck / "model.safetensors"), w, metadata={"format": "mlx"})
    _one_line_error(_invoke("run", ck, *base[1:], "--pages", out), "stale", "--out")


def test_a_live_writer_between_its_renames_is_read_not_disturbed(bundled, tmp_path):
    import os

    ck = _copy(bundled, tmp_path)
    live = ck / f".experts.old-{os.getpid()}"  # a writer that is alive (this process), mid-swap
    (ck / "experts").rename(live)
    r = _run(ck, bundled[2])
    assert r.exit_code == 0 and json.loads(r.stdout)["tokens"] == bundled[1], r.output
    assert live.is_dir() and not (ck / "experts").exists()  # its folders are its own to move


def test_a_refused_pack_leaves_the_model_as_it_was(bundled, tmp_path):
    ck = _copy(bundled, tmp_path)
    last = sorted((ck / "experts").glob("*.bin"))[-1]  # one layer's file cut short: found before any bank changes
    last.write_bytes(last.read_bytes()[:-1])
    ids = list(range(3, 43))
    ref = generate(load(ck, tokenizer=False).model, ids, max_tokens=4).tokens
    m = load(ck, tokenizer=False).model
    with pytest.raises(RQError, match="truncated"):
        ExpertPager(m, ck, slots=2)
    assert generate(m, ids, max_tokens=4).tokens == ref


def test_too_small_budget_names_the_smallest_that_runs(tmp_path):
    """A budget that does not fit says the least one that does, in bytes; that budget runs with top-k slots, one
    byte less does not."""
    import re

    out = tmp_path / "pages"
    assert _invoke("pack", "--out", out).exit_code == 0
    base = ["run", "-p", PROMPT, "-n", "4", "--temp", "0", "--json", "--pages", out]
    msg = _one_line_error(_invoke(*base, "--memory-budget", "1MB"), "smallest budget that runs is")
    least = int(re.search(r"smallest budget that runs is ([\d,]+) bytes", msg).group(1).replace(",", ""))
    r = _invoke(*base, "--memory-budget", least)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["pager"]["slots"] == 2  # the bundled model's top-k
    _one_line_error(_invoke(*base, "--memory-budget", least - 1), "too small")
