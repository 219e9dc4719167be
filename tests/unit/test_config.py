"""Unit tests of the config: TOML + overrides, type checks, errors that name the key, round trip."""

from __future__ import annotations

import pytest

from p2p_diloco.config import Config, ConfigError, describe_config, dump_config, load_config, split_overrides


def write(tmp_path, text: str):
    path = tmp_path / "peer.toml"
    path.write_text(text)
    return path


def test_defaults_are_valid_and_diloco_defaults():
    cfg = load_config()
    assert cfg.diloco.outer_lr == 0.7 and cfg.diloco.outer_momentum == 0.5 and cfg.diloco.nesterov
    assert cfg.diloco.outer_lr_group_exponent == 0 and cfg.diloco.outer_lr_largest_group == 4
    assert cfg.pipeline.stages == 1


def test_file_then_overrides(tmp_path):
    path = write(tmp_path, '[inner]\nlr = 1e-3\n[dht]\ninitial_peers = []\n[diloco]\ninner_steps = 7\n')
    cfg = load_config(path, [("inner.lr", "2e-3"), ("train.num_rounds", "3"), ("model.dim", "none")])
    assert cfg.inner.lr == 2e-3 and cfg.diloco.inner_steps == 7 and cfg.train.num_rounds == 3
    assert cfg.model.dim is None


def test_list_and_bool_overrides():
    cfg = load_config(None, [("dht.host_maddrs", "/ip4/127.0.0.1/tcp/0,/ip4/127.0.0.1/tcp/0"),
                             ("diloco.nesterov", "false"), ("pipeline.stage_layers", "none")])
    assert cfg.dht.host_maddrs == ["/ip4/127.0.0.1/tcp/0"] * 2
    assert cfg.diloco.nesterov is False


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([("inner.foo", "1")], "inner.foo"),
        ([("nosection.lr", "1")], "nosection.lr"),
        ([("inner.lr", "fast")], "inner.lr"),
        ([("diloco.inner_steps", "1.5")], "diloco.inner_steps"),
        ([("diloco.nesterov", "maybe")], "diloco.nesterov"),
        ([("diloco.inner_steps", "0")], "diloco.inner_steps"),
        ([("inner.lr", "-1")], "inner.lr"),
        ([("inner.lr", "nan")], "inner.lr"),
        ([("diloco.outer_momentum", "1.0")], "diloco.outer_momentum"),
        ([("run.run_id", "has.dot")], "run.run_id"),
        ([("run.device", "tpu")], "run.device"),
        ([("averaging.request_timeout_s", "9"), ("averaging.matchmaking_time_s", "5")], "averaging.request_timeout_s"),
        ([("data.batch_size", "10"), ("pipeline.microbatches", "3")], "pipeline.microbatches"),
        ([("pipeline.stages", "2"), ("pipeline.stage_layers", "4")], "pipeline.stage_layers"),
        ([("dht.initial_peers", "/ip4/1.2.3/tcp/5")], "dht.initial_peers"),
        ([("dht.initial_peers", "/ip4/127.0.0.1/tcp/5")], "dht.initial_peers"),
        ([("model.tie_embeddings", "true"), ("pipeline.stages", "2")], "model.tie_embeddings"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(key + ":"), str(info.value)


def test_toml_type_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^train\.num_rounds: expected an integer"):
        load_config(write(tmp_path, '[train]\nnum_rounds = "ten"\n'))
    with pytest.raises(ConfigError, match=r"^diloco\.nesterov: expected true or false"):
        load_config(write(tmp_path, "[diloco]\nnesterov = 1\n"))
    with pytest.raises(ConfigError, match=r"^inner: expected a \[inner\] table"):
        load_config(write(tmp_path, "inner = 3\n"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[inner\nlr = 3\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_dump_round_trip(tmp_path):
    cfg = load_config(None, [("inner.lr", "1.5e-3"), ("run.run_id", "abc"), ("dht.initial_peers",
                      "/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWQRhMWEXs32iUEwckXD3ixtcp4M8THEUyqcMDAhgCsJGF"),
                      ("pipeline.stages", "2"), ("pipeline.stage_layers", "3,1")])
    path = write(tmp_path, dump_config(cfg))
    assert load_config(path) == cfg


def test_split_overrides():
    assert split_overrides(["--inner.lr", "-1", "--train.num_rounds=3"]) == [("inner.lr", "-1"),
                                                                            ("train.num_rounds", "3")]
    with pytest.raises(ConfigError, match="missing value"):
        split_overrides(["--inner.lr"])
    with pytest.raises(ConfigError, match="unrecognized argument"):
        split_overrides(["positional"])


def test_describe_lists_every_key_with_its_doc():
    text = describe_config()
    for section in Config.__dataclass_fields__:
        assert f"[{section}]" in text
    assert "diloco.inner_steps = 20" in text and "H: inner steps per round" in text


def test_streaming_is_on_by_default_with_fragments_and_a_round_too_short_for_them_says_what_to_set():
    from p2p_diloco.config.sections import DiLoCoConfig

    assert DiLoCoConfig().streaming  # the default since issue 33 (benchmarks/newcomer_rounds.py)
    DiLoCoConfig(fragments=4, inner_steps=4).validate()
    DiLoCoConfig(fragments=0, inner_steps=1).validate()  # no fragments: nothing to stagger
    with pytest.raises(ConfigError, match=r"diloco.fragments.*needs diloco.inner_steps >= 4.*diloco.streaming false"):
        DiLoCoConfig(fragments=4, inner_steps=3).validate()
    DiLoCoConfig(fragments=4, inner_steps=3, streaming=False).validate()  # all at once: any H
