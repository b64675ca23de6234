"""Recipes: per-role weight precision, KV-cache settings, pager and calibration, as versioned TOML.

A recipe is read with tomllib and written (resolved, every default filled in) with tomli_w.
Every problem is one RQError line naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from rq_core.errors import RQError
from rq_core.cache.auto import AUTO
from rq_core.cache.kv_cache import DEFAULT_EDGE_LAYERS, DEFAULT_FP16_WINDOW, KVSettings, check_edges, prefill_fp16_value
from rq_core.quant.roles import FAMILIES, ROLES
from rq_core.textio import read_utf8

VERSION = 1
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
METHODS = ("rtn", "gptq")
# Roles whose tensors are plain Linear weights: the calibrated method (GPTQ) applies to them.
GPTQ_ROLES = ("attention", "dense_mlp", "mamba", "shared_expert", "lm_head")
KV_MODES = ("fp16", "isoquant3", "turbo3")
# kv.mode of a recipe: a mode, or auto (also what a recipe without kv.mode gets): the run picks one
# (rq_core.cache.auto); the recipe's own mode wins over auto
KV_CHOICES = KV_MODES + (AUTO,)
ROTATIONS = ("wht_so4", "wht", "so4", "so3", "dense", "rwht_so4")
POLICIES = ("lru",)  # the pager's policies
# Policies that existed once, with why they are gone (a recipe or --pager naming one gets this line).
GONE_POLICIES = {"mmap": "pager policy 'mmap' is gone: it copied every expert a step uses on every step, so it "
                          "never read or held less than lru, which reads only the misses; use lru"}
KV_KEYS = tuple(f.name for f in dataclasses.fields(KVSettings) if f.metadata.get("recipe", True))  # less run-only ones
# recipes/ at the repo root; an installed wheel carries it as rq_core/_recipes (pyproject.toml).
_HERE = Path(__file__).resolve().parents[1]  # rq_core/
RECIPES_DIR = _HERE / "_recipes" if (_HERE / "_recipes").is_dir() else _HERE.parent / "recipes"


@dataclass
class RoleSpec:
    bits: int | None = 4  # None: keep in full precision
    group_size: int = 64
    method: str = "rtn"

    def as_quant(self) -> dict | bool:
        """mlx-lm's per-path quantization entry."""
        return False if self.bits is None else {"group_size": self.group_size, "bits": self.bits}


@dataclass
class PagerSettings:
    memory_budget: str | None = None  # e.g. "16GB"; None: everything resident
    policy: str = "lru"
    context: int = 4096  # tokens of context the planner reserves KV cache for


@dataclass
class CalibrationSettings:
    text: str = "default"  # "default" (bundled) or a path
    tokens: int = 2048
    seq_len: int = 256
    damp: float = 0.01  # GPTQ: fraction of the mean Hessian diagonal added to it


@dataclass
class Promotion:
    kurtosis_threshold: float | None = None  # None: no promotion
    bits: int = 8
    group_size: int = 32


@dataclass
class Recipe:
    name: str
    family: str | None  # model_type it targets; None: any
    roles: dict[str, RoleSpec]
    kv: KVSettings = field(default_factory=KVSettings)
    pager: PagerSettings = field(default_factory=PagerSettings)
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    promote: Promotion = field(default_factory=Promotion)
    description: str = ""
    version: int = VERSION
    source: str = "<recipe>"

    @property
    def calibrated(self) -> bool:
        return any(r.method != "rtn" for r in self.roles.values())

    def to_dict(self) -> dict:
        """The resolved recipe (every default filled in), as written to `recipe.toml`."""
        d: dict[str, Any] = {"version": self.version, "name": self.name}
        if self.family:
            d["family"] = self.family
        if self.description:
            d["description"] = self.description
        d["roles"] = {}
        for role, spec in self.roles.items():
            if spec.bits is None:
                d["roles"][role] = {"quantize": False}
            else:
                d["roles"][role] = {"bits": spec.bits, "group_size": spec.group_size, "method": spec.method}
        # TOML has no null: an unset kv.pair_points (isoquant3's default codebooks) is left out; [] is scalar
        d["kv"] = kv_table(self.kv)
        d["pager"] = {k: v for k, v in dataclasses.asdict(self.pager).items() if v is not None}
        d["calibration"] = dataclasses.asdict(self.calibration)
        if self.promote.kurtosis_threshold is not None:
            d["promote"] = dataclasses.asdict(self.promote)
        return d

    def dumps(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        import os

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.dumps())
        os.replace(tmp, path)


_DEFAULT_ROLES = {
    "attention": RoleSpec(4, 64),
    "dense_mlp": RoleSpec(4, 64),
    "mamba": RoleSpec(4, 64),
    "routed_expert": RoleSpec(2, 64),
    "shared_expert": RoleSpec(8, 32),
    "router": RoleSpec(8, 64),
    "embeddings": RoleSpec(6, 64),
    "lm_head": RoleSpec(6, 64),
}


def _check_keys(where: str, table: Any, allowed: tuple[str, ...], src: str) -> dict:
    if not isinstance(table, dict):
        raise RQError(f"{src}: '{where}' must be a table")
    for k in table:
        if k not in allowed:
            at = f"{where}.{k}" if where else k
            raise RQError(f"{src}: unknown key '{at}' (expected one of: {', '.join(allowed)})")
    return table


def _typed(src: str, key: str, v: Any, typ: type | tuple) -> Any:
    if isinstance(v, bool) and typ is not bool and bool not in (typ if isinstance(typ, tuple) else (typ,)):
        raise RQError(f"{src}: '{key}' must be {getattr(typ, '__name__', typ)}, got {v!r}")
    if not isinstance(v, typ):
        name = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise RQError(f"{src}: '{key}' must be {name}, got {v!r}")
    return v


# Every numeric setting outside the enumerated ones (bits, group sizes): (table, key) -> (type, min, max), checked
# by _check_numbers in one place. float accepts TOML integers too.
_NUMBERS: dict[tuple[str, str], tuple[type, float | None, float | None]] = {
    ("kv", "bits"): (int, 1, 8),
    ("kv", "key_bits"): (int, 1, 4),
    ("kv", "fp16_window"): (int, 0, None),
    ("kv", "seed"): (int, 0, 2**63 - 1),
    ("pager", "context"): (int, 1, None),
    ("calibration", "tokens"): (int, 1, None),
    ("calibration", "seq_len"): (int, 1, None),
    ("calibration", "damp"): (float, 0, None),
    ("promote", "kurtosis_threshold"): (float, None, None),
}


def _non_finite(v: Any, at: str) -> tuple[str, float] | None:
    """The first NaN or infinity anywhere in a TOML value (TOML has `nan` and `inf`)."""
    if isinstance(v, float) and not math.isfinite(v):
        return at, v
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        found = _non_finite(x, f"{at}.{k}" if at else str(k))
        if found:
            return found
    return None


def _check_numbers(src: str, data: dict) -> None:
    """No NaN or infinity anywhere; every _NUMBERS key of its type and inside its range."""
    bad = _non_finite(data, "")
    if bad:
        raise RQError(f"{src}: '{bad[0]}' = {bad[1]} is not a finite number")
    for (table, key), (typ, lo, hi) in _NUMBERS.items():
        t = data.get(table)
        v = t.get(key) if isinstance(t, dict) else None
        if v is None:
            continue
        ok_type = (int,) if typ is int else (int, float)
        if isinstance(v, bool) or not isinstance(v, ok_type):
            raise RQError(f"{src}: '{table}.{key}' must be {'an integer' if typ is int else 'a number'}, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"between {lo} and {hi}" if lo is not None else f"<= {hi}"
            raise RQError(f"{src}: {table}.{key} = {v} must be {rng}")


def _role_spec(src: str, role: str, t: Any, base: RoleSpec) -> RoleSpec:
    t = _check_keys(f"roles.{role}", t, ("bits", "group_size", "method", "quantize"), src)
    if t.get("quantize", True) is False:
        return RoleSpec(None, base.group_size, "rtn")
    bits = _typed(src, f"roles.{role}.bits", t.get("bits", base.bits if base.bits else 4), int)
    if bits not in BITS:
        raise RQError(f"{src}: roles.{role}.bits = {bits} is not one of {', '.join(map(str, BITS))}")
    gs = _typed(src, f"roles.{role}.group_size", t.get("group_size", base.group_size), int)
    if gs not in GROUP_SIZES:
        raise RQError(f"{src}: roles.{role}.group_size = {gs} is not one of {', '.join(map(str, GROUP_SIZES))}")
    method = _typed(src, f"roles.{role}.method", t.get("method", "rtn"), str)
    if method not in METHODS:
        raise RQError(f"{src}: roles.{role}.method = {method!r} is not one of {', '.join(METHODS)}")
    if method == "gptq" and role not in GPTQ_ROLES:
        raise RQError(f"{src}: roles.{role}.method = 'gptq' applies only to {', '.join(GPTQ_ROLES)}")
    return RoleSpec(bits, gs, method)


def _parse_kv(src: str, table: Any) -> KVSettings:
    """The [kv] table (numbers already checked by _check_numbers) as KVSettings; every problem one RQError line."""
    kv_t = _check_keys("kv", table, KV_KEYS, src)
    kv = KVSettings(**{"mode": AUTO, "fp16_window": DEFAULT_FP16_WINDOW, "edge_layers": DEFAULT_EDGE_LAYERS, **kv_t})
    if kv.mode not in KV_CHOICES:
        raise RQError(f"{src}: kv.mode = {kv.mode!r} is not one of {', '.join(KV_CHOICES)}")
    if kv.rotation not in ROTATIONS:
        raise RQError(f"{src}: kv.rotation = {kv.rotation!r} is not one of {', '.join(ROTATIONS)}")
    if kv.pair_points is not None:
        pp = kv.pair_points
        if pp == []:  # scalar codebooks
            kv.pair_points = ()
        elif not isinstance(pp, list) or len(pp) != 2 or not all(isinstance(p, int) and not isinstance(p, bool)
                                                                  for p in pp):
            raise RQError(f"{src}: kv.pair_points must be two integers, keys' and values' points, or [] for "
                          f"scalar codebooks (got {pp!r})")
        else:
            from rq_core.codec.codebook import PAIR_POINTS

            if any(p not in PAIR_POINTS for p in pp):
                raise RQError(f"{src}: kv.pair_points = {pp} must each be one of {', '.join(map(str, PAIR_POINTS))}")
            if kv.key_bits is not None:
                raise RQError(f"{src}: kv.key_bits and kv.pair_points cannot both be set")
            kv.pair_points = (pp[0], pp[1])
    check_edges(kv.edge_layers, kv.edge_bits, f"{src}: kv")
    kv.prefill_fp16 = prefill_fp16_value(kv.prefill_fp16, f"{src}: kv.prefill_fp16")
    _typed(src, "kv.norm_correction", kv.norm_correction, bool)
    _typed(src, "kv.value_gain", kv.value_gain, bool)
    _typed(src, "kv.codebook", kv.codebook, str)
    return kv


def kv_table(kv: KVSettings) -> dict:
    """KVSettings as a recipe's [kv] table (TOML has no null: an unset pair_points is left out; "all" for an
    unbounded prefill_fp16; [] for scalar codebooks)."""
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(kv).items()
         if v is not None and k in KV_KEYS}
    if kv.prefill_fp16 is None:
        d["prefill_fp16"] = "all"  # absent would read back as the default bound
    return d


_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def _config_value(src: str, key: str, text: str) -> Any:
    """A --kv-config VALUE as the TOML value the recipe would hold: `off` / `128,32` for pair_points, on/off for
    switches, a TOML literal (numbers) or else the bare text (names such as so3)."""
    t = text.strip()
    if key == "pair_points":
        if t.lower() in ("off", "[]", "scalar"):
            return []
        try:
            return [int(x) for x in t.strip("[]()").split(",")]
        except ValueError:
            raise RQError(f"{src}: kv.pair_points must be two integers, keys' and values' points (e.g. 128,32), or "
                          f"off for scalar codebooks (got {text!r})") from None
    if isinstance(getattr(KVSettings, key, None), bool):
        if t.lower() in _TRUE + _FALSE:
            return t.lower() in _TRUE
        raise RQError(f"{src}: kv.{key} must be on or off (got {text!r})")
    try:
        return tomllib.loads(f"v = {t}")["v"]
    except tomllib.TOMLDecodeError:
        return t


def apply_kv_config(kv: KVSettings, items: list[str] | tuple[str, ...], src: str = "--kv-config") -> KVSettings:
    """`kv` with KEY=VALUE settings of the recipe's [kv] table applied in order (KEY with or without `kv.`;
    `default` unsets pair_points or key_bits), checked as the recipe checks them: one RQError line naming `src`
    and the key."""
    if not items:
        return kv
    table = kv_table(kv)
    for item in items:
        key, eq, value = str(item).partition("=")
        key = key.strip().removeprefix("kv.").replace("-", "_")
        if not eq or not key:
            raise RQError(f"{src} takes KEY=VALUE, e.g. pair_points=off (got {item!r})")
        if key == "mode":
            raise RQError(f"{src}: the KV mode is set with --kv")
        _check_keys("kv", {key: None}, KV_KEYS, src)
        if key in ("pair_points", "key_bits") and value.strip().lower() == "default":
            table.pop(key, None)  # the settings' default (unset in a recipe)
        else:
            table[key] = _config_value(src, key, value)
    _check_numbers(src, {"kv": table})
    return _parse_kv(src, table)


def parse(data: dict, source: str = "<recipe>") -> Recipe:
    """Validate a recipe dict (as read from TOML) into a Recipe."""
    src = source
    _check_keys("", data, ("version", "name", "family", "description", "roles", "kv", "pager",
                           "calibration", "promote"), src)
    version = data.get("version")
    if version != VERSION:
        raise RQError(f"{src}: 'version' must be {VERSION} (got {version!r})")
    _check_numbers(src, data)
    name = _typed(src, "name", data.get("name", Path(source).stem), str)
    family = data.get("family")
    if family is not None:
        _typed(src, "family", family, str)
        if family not in FAMILIES:
            raise RQError(f"{src}: family {family!r} is not one of {', '.join(FAMILIES)}")
    roles_t = _check_keys("roles", data.get("roles", {}), ROLES, src)
    roles: dict[str, RoleSpec] = {}
    for role in ROLES:
        base = _DEFAULT_ROLES[role]  # a role the recipe leaves out keeps its default
        roles[role] = _role_spec(src, role, roles_t.get(role, {}), base)

    kv = _parse_kv(src, data.get("kv", {}))

    pg_t = _check_keys("pager", data.get("pager", {}), tuple(f.name for f in dataclasses.fields(PagerSettings)), src)
    pager = PagerSettings(**pg_t)
    if pager.memory_budget is not None:
        parse_size(str(pager.memory_budget), f"{src}: pager.memory_budget")
    if pager.policy == "mmap":
        raise RQError(f"{src}: {GONE_POLICIES['mmap']}")
    if pager.policy not in POLICIES:
        raise RQError(f"{src}: pager.policy = {pager.policy!r} is not one of {', '.join(POLICIES)}")

    cal_t = _check_keys("calibration", data.get("calibration", {}),
                        tuple(f.name for f in dataclasses.fields(CalibrationSettings)), src)
    cal = CalibrationSettings(**cal_t)

    pr_t = _check_keys("promote", data.get("promote", {}), ("kurtosis_threshold", "bits", "group_size"), src)
    promote = Promotion(**pr_t)
    if promote.kurtosis_threshold is not None:
        if promote.bits not in BITS:
            raise RQError(f"{src}: promote.bits = {promote.bits} is not one of {', '.join(map(str, BITS))}")
        if promote.group_size not in GROUP_SIZES:
            raise RQError(f"{src}: promote.group_size = {promote.group_size} is not one of "
                          f"{', '.join(map(str, GROUP_SIZES))}")
    desc = _typed(src, "description", data.get("description", ""), str)
    return Recipe(name=name, family=family, roles=roles, kv=kv, pager=pager, calibration=cal,
                  promote=promote, description=desc, source=src)


def loads(text: str, source: str = "<recipe>") -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RQError(f"{source}: not valid TOML ({e})") from None
    return parse(data, source)


def load(name_or_path: str | Path) -> Recipe:
    """A recipe by bundled name (`qwen3-16gb`) or by path to a TOML file."""
    p = Path(name_or_path)
    if not p.exists() and p.suffix != ".toml":
        bundled = RECIPES_DIR / f"{name_or_path}.toml"
        if bundled.exists():
            p = bundled
        else:
            names = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.toml")))
            raise RQError(f"no recipe {str(name_or_path)!r} (a path to a .toml, or one of: {names})")
    if not p.exists():
        raise RQError(f"recipe file not found: {p}")
    return loads(read_utf8(p), str(p))


def bundled() -> list[str]:
    return sorted(x.stem for x in RECIPES_DIR.glob("*.toml"))


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)?\s*$", re.I)


def parse_size(text: str, what: str = "size") -> int:
    """'16GB' / '512MiB' / '1.5G' / '1000000' -> bytes (GB = 1e9, GiB = 2**30)."""
    m = _SIZE.match(str(text))
    if not m:
        raise RQError(f"{what}: cannot read {text!r} as a size (examples: 16GB, 512MiB, 2.5G)")
    num, unit, suffix = float(m.group(1)), m.group(2).upper(), (m.group(3) or "").lower()
    base = 1024 if suffix.startswith("i") else 1000
    n = num * base ** " KMGT".index(unit or " ")
    if not math.isfinite(n) or n < 1:  # a long run of digits reads as inf; a budget or shard of 0 bytes holds nothing
        raise RQError(f"{what}: {text!r} must be a positive size (examples: 16GB, 512MiB, 2.5G)")
    return int(n)


def check_against(recipe: Recipe, config: dict, dims: dict[str, list[tuple[str, tuple[int, ...]]]]) -> None:
    """Validate a recipe against a model: its family, and that each role's group size divides the
    input dimension of every tensor of that role. `dims`: role -> [(name, shape)]."""
    from rq_core.quant.roles import family_of

    fam = family_of(config)
    if recipe.family and recipe.family != fam:
        raise RQError(f"{recipe.source}: recipe {recipe.name!r} is for {recipe.family} models, "
                      f"this model is {fam}")
    for role, items in dims.items():
        spec = recipe.roles.get(role)
        if spec is None or spec.bits is None:
            continue
        for name, shape in items:
            if shape[-1] % spec.group_size:
                raise RQError(f"{recipe.source}: roles.{role}.group_size = {spec.group_size} does not divide "
                              f"dimension {shape[-1]} of {name}")
