"""Loading a :class:`Config` from a TOML file plus ``--section.field value`` overrides, and saving it back.

Values are type-checked against the dataclass annotations: an unknown section or key, a wrong
type or an impossible value raises :class:`ConfigError` naming the key. Called by the CLI only;
components receive their own section.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Union

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.network import AveragingConfig, DHTConfig
from p2p_diloco.config.sections import (
    CheckpointConfig,
    DataConfig,
    DiLoCoConfig,
    InnerConfig,
    MetricsConfig,
    ModelConfig,
    PipelineConfig,
    RunConfig,
    TrainConfig,
)

_TRUE = ("true", "yes", "1", "on")
_FALSE = ("false", "no", "0", "off")
_NONE = ("none", "null", "")
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\"}


@dataclass
class Config:
    """The whole configuration of one peer; each component reads only its own section."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> None:
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        if self.data.batch_size % self.pipeline.microbatches != 0:
            raise ConfigError(
                f"pipeline.microbatches: {self.pipeline.microbatches} does not divide data.batch_size "
                f"{self.data.batch_size}"
            )
        round_bound = self.averaging.round_timeout_s + self.averaging.allreduce_timeout_s
        if self.pipeline.stages > 1 and self.pipeline.timeout_s <= round_bound:
            raise ConfigError(
                f"pipeline.timeout_s: {self.pipeline.timeout_s} s is not above the longest round end "
                f"(averaging.round_timeout_s + averaging.allreduce_timeout_s = {round_bound} s), during which the "
                "other stages wait"
            )
        if self.model.tie_embeddings and self.pipeline.stages > 1:
            raise ConfigError(
                "model.tie_embeddings: tied embeddings need the embedding and the head on one stage; "
                f"they cannot be used with pipeline.stages = {self.pipeline.stages}"
            )
        self._check_split()

    def _check_split(self) -> None:
        """The model must split into the stages asked for, checked here so that no stage process is started (with
        model.init_from, by the ``peer`` command once it has read the folder's config.json)."""
        from p2p_diloco.model.presets import PRESETS  # local import: the model package pulls in torch

        if self.model.init_from is not None:
            return
        n_layers = self.model.n_layers or PRESETS[self.model.preset_name]["n_layers"]
        if self.pipeline.stages > n_layers:
            raise ConfigError(f"pipeline.stages: {self.pipeline.stages} stages need at least {self.pipeline.stages} "
                              f"blocks, but the model has {n_layers} (model.n_layers)")
        layers = self.pipeline.stage_layers
        if layers is not None and sum(layers) != n_layers:
            raise ConfigError(f"pipeline.stage_layers: {layers} adds up to {sum(layers)} blocks, but the model has "
                              f"{n_layers} (model.n_layers); the blocks per stage must add up to it")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


@functools.cache
def _section_types(config_cls: type) -> MappingProxyType[str, Any]:
    """The field types of a config dataclass, read-only as every call shares them. Cached: ``get_type_hints``
    evaluates every string annotation of the class again on each call, and the parser asks twice per key set
    (uncached, that is 80% of the time of a property test of the parser)."""
    return MappingProxyType(typing.get_type_hints(config_cls))


def _convert(value: Any, annotation: Any, key: str) -> Any:
    """Check (TOML values) or parse (command-line strings) one value against its annotation."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Union:  # Optional[X]
        inner = next(arg for arg in args if arg is not type(None))
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        return _convert(value, inner, key)
    if origin is list:
        (item_type,) = args
        if isinstance(value, str):
            items = [item.strip() for item in value.split(",") if item.strip()]
        elif isinstance(value, list):
            items = value
        else:
            raise ConfigError(f"{key}: expected a list of {item_type.__name__}, got {value!r}")
        return [_convert(item, item_type, f"{key}[{i}]") for i, item in enumerate(items)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            result = float(value)
        elif isinstance(value, str):
            try:
                result = float(value.strip())
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        else:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(result):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return result
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported config annotation {annotation!r} for {key}")


def _set_value(config: Config, key: str, value: Any) -> None:
    section_name, _, field_name = key.partition(".")
    section_types = _section_types(Config)
    if section_name not in section_types or not field_name:
        known = ", ".join(section_types)
        raise ConfigError(f"{key}: unknown key (sections are {known}; keys look like section.field)")
    section = getattr(config, section_name)
    field_types = _section_types(type(section))
    if field_name not in field_types:
        raise ConfigError(f"{key}: unknown key (known keys in [{section_name}]: {', '.join(field_types)})")
    setattr(section, field_name, _convert(value, field_types[field_name], key))


def load_config(path: str | Path | None = None, overrides: list[tuple[str, str]] = ()) -> Config:
    """Build a validated Config from an optional TOML file and ``(key, raw string)`` overrides."""
    config = Config()
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for section_name, section_values in data.items():
            if not isinstance(section_values, dict):
                raise ConfigError(f"{section_name}: expected a [{section_name}] table, got a bare value")
            for field_name, value in section_values.items():
                _set_value(config, f"{section_name}.{field_name}", value)
    for key, raw in overrides:
        _set_value(config, key, raw)
    config.validate()
    return config


def split_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """Turn ``['--inner.lr', '1e-3', '--train.num_rounds=3']`` into ``[('inner.lr', '1e-3'), ...]``."""
    overrides, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognized argument {arg!r} (config overrides look like --section.field VALUE)")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg[2:]}: missing value")
            key, raw = arg[2:], argv[i + 1]
            i += 2
        overrides.append((key, raw))
    return overrides


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):  # a TOML basic string: quotes, backslashes and control characters escaped
        return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                             for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_config(config: Config) -> str:
    """The resolved config as TOML (None values are left out: they mean 'the default')."""
    lines = []
    for section_name, values in config.to_dict().items():
        lines.append(f"[{section_name}]")
        lines.extend(f"{name} = {_toml_value(value)}" for name, value in values.items() if value is not None)
        lines.append("")
    return "\n".join(lines)


def describe_config() -> str:
    """Every key with its default and its docstring, for ``--help-config``."""
    import ast
    import inspect

    lines = []
    for section_name, section_cls in _section_types(Config).items():
        lines.append(f"[{section_name}]")
        docs: dict[str, str] = {}
        body = ast.parse(inspect.getsource(section_cls)).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
        defaults = dataclasses.asdict(section_cls())
        for name, default in defaults.items():
            lines.append(f"  {section_name}.{name} = {default!r}\n      {docs.get(name, '')}")
        lines.append("")
    return "\n".join(lines)
