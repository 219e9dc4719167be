"""Property-based tests (hypothesis) of the two parsers that read what users and disks hand us.

- The config parser: any TOML-ish document or override list gives a valid Config or a ConfigError whose message
  starts with the key at fault (or names the config file), never another exception; a valid config survives a
  round trip through its TOML dump.
- The checkpoint loader: whatever bytes of a saved checkpoint are flipped, cut or added, it loads the identical
  state or raises CheckpointError (and the folder falls back to the previous checkpoint), never another exception
  and never a silently different state.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import typing
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.config import Config, ConfigError, dump_config, load_config, split_overrides
from p2p_diloco.training import CheckpointError, load_latest_checkpoint, read_checkpoint, save_checkpoint

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
SECTION_TYPES = typing.get_type_hints(Config)
KNOWN_KEYS = [f"{section}.{name}" for section, cls in SECTION_TYPES.items() for name in typing.get_type_hints(cls)]
NAMES_A_KEY = re.compile(r"^(config file |[^\s:]+: \S)")


# ---- the config parser ----------------------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True)
scalars = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.text(max_size=20), st.sampled_from(["none", "", "0", "1", "true", "1e-3", "/ip4/127.0.0.1/tcp/0", "a,b"]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=2),
                      max_leaves=6)


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_value(key)


def toml_value(value) -> str:
    """A TOML rendering of a Python value (the test's own, independent of the dump under test)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, str):
        return '"' + "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c
                             for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


@st.composite
def documents(draw) -> str:
    """A TOML document of known and unknown sections and keys with values of any type, sometimes damaged."""
    lines = []
    for section in draw(st.lists(st.sampled_from(list(SECTIONS)) | names, max_size=4, unique=True)):
        known = list(typing.get_type_hints(SECTION_TYPES[section])) if section in SECTION_TYPES else []
        keys = draw(st.lists(st.sampled_from(known) | names if known else names, max_size=4, unique=True))
        if draw(st.booleans()) and not keys:
            lines.append(f"{section} = {toml_value(draw(scalars))}")  # a bare value where a table belongs
            continue
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(draw(values))}" for key in keys)
    text = "\n".join(lines) + "\n"
    if draw(st.booleans()):  # TOML-ish: a character inserted or removed somewhere
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["", "[", "=", '"', "\n", ".", "x", "]", "\x00"])) + text[at + 1:]
    return text


def check_outcome(load) -> Config | None:
    """``load()`` gives a Config, or a ConfigError naming the key; anything else fails the test."""
    try:
        return load()
    except ConfigError as e:
        assert NAMES_A_KEY.match(str(e)), f"the error does not start with a key: {e}"
        return None


def assert_round_trip(config: Config, folder: Path) -> None:
    path = folder / "dumped.toml"
    path.write_text(dump_config(config), encoding="utf-8")
    assert load_config(path) == config


@FAST
@given(documents())
def test_any_config_document_gives_a_config_or_an_error_naming_the_key(text):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "peer.toml"
        path.write_text(text, encoding="utf-8")
        config = check_outcome(lambda: load_config(path))
        if config is not None:
            assert_round_trip(config, Path(folder))


raw_values = st.one_of(
    st.text(max_size=24), st.integers(-10**20, 10**20).map(str), st.floats().map(repr),
    st.sampled_from(["none", "true", "off", "0", "-1", "1e400", "nan", "4,4", ",", "/ip4/127.0.0.1/tcp/0"]),
)


@FAST
@given(st.lists(st.tuples(st.sampled_from(KNOWN_KEYS) | names.map(lambda n: f"{n}.x") | names, raw_values),
                max_size=5))
def test_any_override_list_gives_a_config_or_an_error_naming_the_key(overrides):
    config = check_outcome(lambda: load_config(None, overrides))
    if config is not None:
        with tempfile.TemporaryDirectory() as folder:
            assert_round_trip(config, Path(folder))


@FAST
@given(st.lists(st.text(max_size=12) | st.sampled_from(["--inner.lr", "--x", "--a.b=1", "-v", "--"]), max_size=6))
def test_any_argument_list_splits_or_says_which_argument(argv):
    try:
        pairs = split_overrides(argv)
    except ConfigError as e:
        assert "unrecognized argument" in str(e) or "missing value" in str(e)
        return
    assert all(isinstance(key, str) and isinstance(raw, str) for key, raw in pairs)


# valid values for a round trip through the dump: one strategy per kind of field
ROUND_TRIP_VALUES = {
    "run.run_id": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True),
    "run.output_dir": st.text(min_size=1, max_size=30).filter(lambda s: "," not in s),
    "run.seed": st.integers(-2**63, 2**63 - 1).map(str),
    "inner.lr": st.floats(min_value=1e-300, max_value=1e300).map(repr),
    "inner.weight_decay": st.floats(min_value=0, max_value=10).map(repr),
    "diloco.inner_steps": st.integers(1, 10**9).map(str),
    "diloco.outer_momentum": st.floats(min_value=0, max_value=0.999).map(repr),
    "dht.identity_path": st.text(max_size=30),
    "dht.host_maddrs": st.sampled_from(["/ip4/127.0.0.1/tcp/0", "/ip4/0.0.0.0/tcp/31337,/ip6/::1/tcp/0", ""]),
    "checkpoint.dir": st.text(max_size=30),
    "train.progress": st.booleans().map(str),
    "model.n_layers": st.integers(4, 64).map(str),
}


@FAST
@given(st.dictionaries(st.sampled_from(list(ROUND_TRIP_VALUES)), st.none(), min_size=1).flatmap(
    lambda keys: st.tuples(*(st.tuples(st.just(k), ROUND_TRIP_VALUES[k]) for k in keys))))
def test_valid_configs_round_trip_through_their_toml_dump(overrides):
    config = load_config(None, list(overrides))
    with tempfile.TemporaryDirectory() as folder:
        assert_round_trip(config, Path(folder))


# ---- the checkpoint loader ------------------------------------------------------------------------------------

TENSORS = {"param/w": torch.randn(7, 5), "anchor/w": torch.randn(7, 5), "rng/torch": torch.get_rng_state(),
           "adam/b": torch.arange(9, dtype=torch.float64)}
META = {"inner_step": 120, "round": 3, "run_id": "prop", "sampler": {"seed": 5, "num_batches": 120},
        "summary": {"losses": [5.5, 4.25, float("nan")], "note": "ü"}, "pending": None}


def corrupt(raw: bytes, kind: str, data) -> bytes:
    """``raw`` with some bytes flipped, cut, added or replaced; positions and values are drawn from ``data``."""
    out = bytearray(raw)
    position = st.integers(0, len(out) - 1)
    if kind == "flip":
        for at, mask in data.draw(st.lists(st.tuples(position, st.integers(1, 255)), min_size=1, max_size=8)):
            out[at] ^= mask
    elif kind == "truncate":
        del out[data.draw(position):]
    elif kind == "append":
        out += data.draw(st.binary(min_size=1, max_size=16))
    else:  # a run of bytes replaced by others, e.g. a torn write
        at = data.draw(position)
        out[at:at + data.draw(st.integers(1, 64))] = data.draw(st.binary(max_size=64))
    return bytes(out)


def same_state(checkpoint, step: int, tensors: dict, meta: dict) -> bool:
    return (checkpoint.step == step and checkpoint.tensors.keys() == tensors.keys()
            and all(checkpoint.tensors[k].dtype == v.dtype and torch.equal(checkpoint.tensors[k], v)
                    for k, v in tensors.items())
            and json_equal(checkpoint.meta, meta))


def json_equal(a, b) -> bool:
    """Equality in which NaN equals NaN (the metadata carries NaN losses)."""
    return repr(a) == repr(b)


PREVIOUS = {k: v + 1 if v.is_floating_point() else v for k, v in TENSORS.items()}


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> dict[str, bytes]:
    """The files of a folder holding checkpoints 1 (PREVIOUS) and 2 (TENSORS), saved once: every example damages a
    copy of the same bytes (saving them anew each time was 3 fsyncs a checkpoint, most of the test's time)."""
    folder = tmp_path_factory.mktemp("checkpoints")
    save_checkpoint(folder, 1, PREVIOUS, dict(META, inner_step=1), keep=3)
    save_checkpoint(folder, 2, TENSORS, META, keep=3)
    return {path.name: path.read_bytes() for path in folder.iterdir()}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["json", "safetensors"]), st.sampled_from(["flip", "truncate", "append", "splice"]), st.data())
def test_a_damaged_checkpoint_loads_identically_or_is_refused(two_checkpoints, suffix, kind, data):
    with tempfile.TemporaryDirectory() as folder:
        for name, raw in two_checkpoints.items():
            (Path(folder) / name).write_bytes(raw)
        manifest = Path(folder) / "step-00000002.json"
        damaged = manifest.with_suffix(f".{suffix}")
        damaged.write_bytes(corrupt(damaged.read_bytes(), kind, data))
        try:
            checkpoint = read_checkpoint(manifest)
        except CheckpointError as e:
            assert "step-00000002" in str(e)
        else:
            assert same_state(checkpoint, 2, TENSORS, META), "a damaged checkpoint loaded as a different state"
        latest = load_latest_checkpoint(folder)
        assert same_state(latest, 2, TENSORS, META) or same_state(latest, 1, PREVIOUS, dict(META, inner_step=1))
