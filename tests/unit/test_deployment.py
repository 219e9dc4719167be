"""The deployment material users copy (example configs, Dockerfile, docker-compose.yml, the systemd unit, the
bootstrap README) checked against the CLI's own argument parser and config validation, so that a renamed
option or a mistyped key fails here and not on a user's machine. No Docker engine, no network."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import yaml

from p2p_diloco.cli.common import config_from_args
from p2p_diloco.cli.main import build_parser
from p2p_diloco.cli.peer import pipeline_overrides
from p2p_diloco.cli.status import status_config
from p2p_diloco.cli.swarm import DEMO_DEFAULTS, LOOPBACK
from p2p_diloco.config import Config, load_config, split_overrides

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PEER_ID = "12D3KooWQRhMWEXs32iUEwckXD3ixtcp4M8THEUyqcMDAhgCsJGF"
EXAMPLE_TOMLS = sorted((ROOT / "peers").glob("*.toml")) + sorted((ROOT / "bootstrap").glob("*.toml"))
UNIT = ROOT / "bootstrap" / "p2p-diloco-bootstrap.service"
SYSTEMD_CONFIG = {"/etc/p2p-diloco/bootstrap.toml": ROOT / "bootstrap" / "bootstrap.toml"}


# ---------------------------------------------------------------------------------------------- helpers

def cli_config(argv: list[str], files: dict[str, Path]) -> tuple:
    """Parse ``p2p-diloco ARGV`` as the CLI does; for peer, bootstrap and status also build the validated config.

    ``files`` maps paths on the target machine (a container, /etc) to the repository files they will be.
    """
    try:
        args, rest = build_parser().parse_known_args(argv)
    except SystemExit as e:
        raise AssertionError(f"the CLI rejects: p2p-diloco {shlex.join(argv)}") from e
    assert getattr(args, "accepts_overrides", False) or not rest, f"unrecognized arguments {rest}"
    overrides = split_overrides(rest)
    if args.command not in ("peer", "bootstrap", "status"):
        return args, None
    args.target_config = args.config
    if args.config is not None:
        args.config = str(files.get(args.config, ROOT / args.config))
    if args.command == "status":
        return args, status_config(args)
    extra = pipeline_overrides(args) if args.command == "peer" else []
    return args, config_from_args(args, overrides, extra=extra)


def under(path: str, folder: str) -> bool:
    return PurePosixPath(folder) in (PurePosixPath(path), *PurePosixPath(path).parents)


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines
            if line and not line.startswith("#")]


def dockerfile_args() -> dict[str, str]:
    return dict(rest.split("=", 1) for kind, rest in dockerfile_instructions() if kind == "ARG" and "=" in rest)


def makefile_torch_version() -> str:
    return re.search(r"^TORCH_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


# ---------------------------------------------------------------------------------------------- configs

def test_every_example_is_there():
    names = {f"{p.parent.name}/{p.name}" for p in EXAMPLE_TOMLS}
    assert {"peers/peer.toml", "peers/demo.toml", "peers/gpu-1b.toml", "peers/compose.toml",
            "bootstrap/bootstrap.toml"} <= names


@pytest.mark.parametrize("path", EXAMPLE_TOMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_config_loads(path):
    load_config(path)


def test_peer_example_documents_every_section_and_leaves_initial_peers_to_fill():
    path = ROOT / "peers" / "peer.toml"
    assert set(tomllib.loads(path.read_text())) == set(Config.__dataclass_fields__)
    cfg = load_config(path)
    assert cfg.dht.initial_peers == []
    dht_section = path.read_text().split("[dht]", 1)[1].split("\n[", 1)[0]
    assert re.search(r"^#.*initial_peers = \[\"/.*/p2p/", dht_section, re.M), "no example initial_peers comment"


def test_demo_example_is_the_swarm_demo():
    demo = load_config(ROOT / "peers" / "demo.toml")
    assert demo.to_dict() == load_config(None, DEMO_DEFAULTS + [("dht.host_maddrs", LOOPBACK)]).to_dict()


def test_gpu_example_is_a_1b_gpu_peer():
    cfg = load_config(ROOT / "peers" / "gpu-1b.toml")
    assert (cfg.model.preset, cfg.run.device, cfg.diloco.inner_steps, cfg.pipeline.stages) == ("1b", "cuda", 500, 1)
    assert cfg.data.batch_size > Config().data.batch_size


def test_bootstrap_example_listens_on_a_fixed_port_with_a_persistent_identity():
    path = ROOT / "bootstrap" / "bootstrap.toml"
    cfg = load_config(path)
    assert cfg.dht.host_maddrs and all(not m.endswith("/tcp/0") for m in cfg.dht.host_maddrs)
    assert cfg.dht.identity_path and cfg.dht.announce_maddrs == [] and not cfg.dht.client_mode
    assert re.search(r"^#\s*announce_maddrs = \[\"/", path.read_text(), re.M), "no announce_maddrs placeholder"


# ---------------------------------------------------------------------------------------------- compose

def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation: ``$$`` is a literal ``$``, ``${NAME:-default}`` and ``$NAME``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(1):
            return "$"
        name = match.group(2) or match.group(4)
        if name in env:
            return env[name]
        assert match.group(3) is not None, f"${name} is used without a default"
        return match.group(3)

    return re.sub(r"\$(?:(\$)|\{(\w+)(?::?-([^}]*))?\}|(\w+))", substitute, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), env={})


def mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """Container path -> (source, read-only) of a service's short-syntax volumes."""
    result = {}
    for spec in service.get("volumes", []):
        source, target, *mode = spec.split(":")
        result[target] = (source, mode == ["ro"])
    return result


def source_of(service: dict, path: str) -> tuple[str, str]:
    """(volume or bind source, path inside it) that a container path lives in."""
    target = max((t for t in mounts(service) if under(path, t)), key=len, default=None)
    assert target is not None, f"{path} is in no volume: it is lost when the container is recreated"
    return mounts(service)[target][0], str(PurePosixPath(path).relative_to(target))


def as_list(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value or [])


def final_argv(service: dict, file_contents: dict[str, str], run_args: list[str] | None = None
               ) -> tuple[list[str], str]:
    """The arguments of the ``p2p-diloco`` process a service ends up running, and its shell wrapper (if any).

    A ``sh -c`` wrapper must end with ``exec p2p-diloco ...`` (so that p2p-diloco gets the stop signal);
    ``$(cat FILE)`` in it is replaced by ``file_contents[FILE]``, ``"$@"`` by the wrapper's arguments after
    ``$0``. ``run_args``: the arguments of ``docker compose run SERVICE ARGS...``, which replace the command.
    """
    entrypoint = as_list(service["entrypoint"]) if "entrypoint" in service else json.loads(
        next(rest for kind, rest in dockerfile_instructions() if kind == "ENTRYPOINT"))
    argv = entrypoint + (as_list(service.get("command")) if run_args is None else list(run_args))
    script = ""
    if argv[:2] == ["sh", "-c"]:
        script = argv[2].strip()
        match = re.search(r"(?:^|[;&|\n])\s*exec\s+(p2p-diloco\s[^\n;&|]*)$", script)
        assert match, f"the wrapper does not end with `exec p2p-diloco ...`:\n{script}"
        line = re.sub(r"\$\(cat ([^)\s]+)\)", lambda m: file_contents[m.group(1)], match.group(1))
        line = line.replace('"$@"', shlex.join(argv[4:]))
        assert "$" not in line, f"unexpanded shell variable in {line!r}"
        argv = shlex.split(line)
    assert argv[0] == "p2p-diloco", argv
    return argv[1:], script


def config_files(service: dict) -> dict[str, Path]:
    return {target: ROOT / source for target, (source, _) in mounts(service).items() if source.startswith("./")}


@pytest.fixture(scope="module")
def bootstrap(compose) -> tuple:
    service = compose["services"]["bootstrap"]
    argv, _ = final_argv(service, {})
    args, cfg = cli_config(argv, config_files(service))
    assert args.command == "bootstrap"
    return args, cfg


@pytest.fixture(scope="module")
def maddrs_file(bootstrap) -> dict[str, str]:
    """What the peers' wrappers will read: the bootstrap node's announced maddrs with its peer id."""
    args, cfg = bootstrap
    assert args.maddrs_file and cfg.dht.announce_maddrs
    return {args.maddrs_file: " ".join(f"{m}/p2p/{EXAMPLE_PEER_ID}" for m in cfg.dht.announce_maddrs)}


def test_compose_has_the_services_and_lifecycle_settings(compose):
    services = compose["services"]
    assert {"bootstrap", "peer1", "peer2"} <= set(services)
    for name in ("bootstrap", "peer1", "peer2"):
        service = services[name]
        assert service.get("volumes"), name
        assert service.get("restart") in ("unless-stopped", "on-failure", "always"), name
        assert service.get("stop_signal") == "SIGTERM" and service.get("stop_grace_period"), name
    assert services["bootstrap"]["restart"] == "unless-stopped"
    for name in ("peer1", "peer2"):
        assert "bootstrap" in services[name]["depends_on"], name


@pytest.mark.parametrize("name", ["peer1", "peer2"])
def test_compose_peer_runs_the_shared_config_with_the_bootstrap_maddrs(compose, maddrs_file, name):
    service = compose["services"][name]
    argv, script = final_argv(service, maddrs_file)
    args, cfg = cli_config(argv, config_files(service))
    assert args.command == "peer"
    (path,) = maddrs_file
    assert f"-s {path}" in script, "the wrapper must wait for the bootstrap node's maddrs file"
    assert cfg.dht.initial_peers == maddrs_file[path].split()
    assert cfg.run.run_id == "compose-demo"
    for state in (cfg.run.output_dir, cfg.dht.identity_path, cfg.data.cache_dir):
        volume, _ = source_of(service, state)
        assert volume in compose["volumes"], f"{state} is not in a named volume"


def test_compose_peers_share_the_config_file_read_only_but_not_their_state(compose, maddrs_file):
    sources, states = [], []
    for name in ("peer1", "peer2"):
        service = compose["services"][name]
        args, cfg = cli_config(final_argv(service, maddrs_file)[0], config_files(service))
        sources.append(mounts(service)[args.target_config])
        states.append(source_of(service, cfg.run.output_dir)[0])
    assert sources[0] == sources[1] == ("./peers/compose.toml", True)
    assert states[0] != states[1], "two peers must not share checkpoints and identity"


def test_compose_bootstrap_is_reachable_by_service_name_with_a_persistent_identity(compose, bootstrap):
    args, cfg = bootstrap
    service = compose["services"]["bootstrap"]
    (port,) = {m.rsplit("/tcp/", 1)[1] for m in cfg.dht.host_maddrs}
    assert f"/dns4/bootstrap/tcp/{port}" in cfg.dht.announce_maddrs
    assert any(str(p).split(":")[-1] == port for p in service["ports"]), "the DHT port is not published"
    identity_volume, _ = source_of(service, cfg.dht.identity_path)
    assert identity_volume in compose["volumes"]
    for name in ("peer1", "peer2"):
        assert identity_volume not in {s for s, _ in mounts(compose["services"][name]).values()}, \
            f"{name} can read the bootstrap node's private key"


def test_compose_peers_read_the_file_the_bootstrap_writes(compose, bootstrap):
    args, _ = bootstrap
    written = source_of(compose["services"]["bootstrap"], args.maddrs_file)
    assert args.maddrs_file in str(compose["services"]["bootstrap"]["healthcheck"]["test"])
    for name in ("peer1", "peer2"):
        service = compose["services"][name]
        (read,) = set(re.findall(r"\$\(cat ([^)\s]+)\)", final_argv(service, {args.maddrs_file: "x"})[1]))
        assert source_of(service, read) == written, f"{name} reads {read}, not the bootstrap node's file"
        assert service["depends_on"]["bootstrap"]["condition"] == "service_healthy"


def published(service: dict, container_port: int) -> list[tuple[str, str]]:
    """(host address, host port) pairs that publish a container port ("ADDR:HOST:CONTAINER" or "HOST:CONTAINER")."""
    result = []
    for spec in service.get("ports", []):
        *host, port = str(spec).split(":")
        if int(port) == container_port:
            result.append((host[0] if len(host) == 2 else "0.0.0.0", host[-1]))
    return result


def test_compose_every_service_serves_metrics_on_the_hosts_loopback_only(compose, bootstrap, maddrs_file):
    host_ports = []
    for name in ("bootstrap", "peer1", "peer2"):
        service = compose["services"][name]
        args, cfg = bootstrap if name == "bootstrap" else cli_config(final_argv(service, maddrs_file)[0],
                                                                     config_files(service))
        assert cfg.metrics.port and cfg.metrics.host == "0.0.0.0", f"{name}: metrics off or not reachable"
        (where,) = published(service, cfg.metrics.port)
        assert where[0] == "127.0.0.1", f"{name} publishes its metrics beyond the host"
        host_ports.append(where[1])
        if name != "bootstrap":  # a peer is healthy when its /health answers
            test = " ".join(service["healthcheck"]["test"])
            assert f"http://127.0.0.1:{cfg.metrics.port}/health" in test and test.startswith("CMD python -c")
    assert len(set(host_ports)) == 3, host_ports


@pytest.mark.parametrize("run_args", [None, ["--json"]])
def test_compose_status_service_shows_the_peers_run_through_the_bootstrap_node(compose, maddrs_file, run_args):
    service = compose["services"]["status"]
    assert service["profiles"] == ["tools"], "`docker compose up` must not start it"
    argv, script = final_argv(service, maddrs_file, run_args)
    args, cfg = cli_config(argv, config_files(service))
    assert args.command == "status" and args.json == bool(run_args)
    (path,) = maddrs_file
    assert cfg.dht.initial_peers == maddrs_file[path].split() and cfg.dht.client_mode
    peer_cfg = cli_config(final_argv(compose["services"]["peer1"], maddrs_file)[0],
                          config_files(compose["services"]["peer1"]))[1]
    assert cfg.run.run_id == peer_cfg.run.run_id
    assert cfg.dht.identity_path is None, "status must not take a peer's identity"
    assert service["depends_on"]["bootstrap"]["condition"] == "service_healthy"


# ---------------------------------------------------------------------------------------------- systemd

def unit_section(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser[name]


def test_systemd_unit_runs_a_valid_bootstrap_command():
    exec_start = unit_section("Service")["ExecStart"].lstrip("@-:+!")
    argv = shlex.split(exec_start)
    assert PurePosixPath(argv[0]).name == "p2p-diloco" and PurePosixPath(argv[0]).is_absolute()
    args, cfg = cli_config(argv[1:], SYSTEMD_CONFIG)
    assert args.command == "bootstrap" and args.target_config == "/etc/p2p-diloco/bootstrap.toml"


def test_systemd_unit_is_hardened_and_can_write_its_state():
    service = unit_section("Service")
    assert service["User"] not in ("", "root", "0")
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM" and service["TimeoutStopSec"]
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    writable = service["ReadWritePaths"].split()
    args, cfg = cli_config(shlex.split(service["ExecStart"].lstrip("@-:+!"))[1:], SYSTEMD_CONFIG)
    for path in (cfg.dht.identity_path, args.maddrs_file, service["WorkingDirectory"]):
        assert path and any(under(path, folder) for folder in writable), f"{path} is read-only for the service"
    assert f"/var/lib/{service['StateDirectory']}" in writable
    assert unit_section("Install")["WantedBy"] == "multi-user.target"


# ---------------------------------------------------------------------------------------------- Dockerfile

def test_dockerfile_installs_the_cpu_torch_pin_before_the_project():
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    args = dockerfile_args()
    assert args["TORCH_VERSION"] == makefile_torch_version() == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [rest for kind, rest in instructions if kind == "RUN"]
    torch_at = next(i for i, run in enumerate(runs) if re.search(r'pip install "?torch==\$\{?TORCH_VERSION', run))
    assert re.search(r'--index-url "?\$\{?TORCH_INDEX_URL', runs[torch_at]), "torch is not from TORCH_INDEX_URL"
    project_at = next(i for i, run in enumerate(runs) if re.search(r"pip install (\S+ )*\.(\s|$)", run))
    assert torch_at < project_at, "torch must be installed before the project, or pip pulls a CUDA build"


def test_dockerfile_copies_what_pip_install_dot_needs():
    instructions = dockerfile_instructions()
    install_at = next(i for i, (kind, rest) in enumerate(instructions)
                      if kind == "RUN" and re.search(r"pip install (\S+ )*\.(\s|$)", rest))
    copied = {src for kind, rest in instructions[:install_at] if kind == "COPY" for src in rest.split()[:-1]}
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert {"pyproject.toml", readme, "p2p_diloco"} <= copied
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not ignored & {"pyproject.toml", readme, "p2p_diloco", "*.md", "*.toml"}


def test_dockerfile_runs_p2p_diloco_as_a_non_root_user_with_a_data_volume(compose):
    instructions = dockerfile_instructions()
    kinds = [kind for kind, _ in instructions]
    (entrypoint,) = [rest for kind, rest in instructions if kind == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["p2p-diloco"]
    user_at = max(i for i, kind in enumerate(kinds) if kind == "USER")
    assert instructions[user_at][1] not in ("root", "0") and user_at < kinds.index("ENTRYPOINT")
    (volume,) = [rest for kind, rest in instructions if kind == "VOLUME"]
    assert "/data" in json.loads(volume)
    # a new named volume takes the ownership of the image's folder: the user must own every mount point
    chowned = " ".join(rest for kind, rest in instructions if kind == "RUN" and "chown" in rest)
    for service in compose["services"].values():
        for target, (source, _) in mounts(service).items():
            if source in compose["volumes"]:
                assert re.search(rf"chown .*{re.escape(target)}(\s|$)", chowned), f"{target} is not chowned"


def test_compose_builds_the_image_with_the_dockerfile_torch(compose):
    builds = [service["build"] for service in compose["services"].values() if "build" in service]
    assert builds, "no service builds the image"
    for build in builds:
        for name, value in build.get("args", {}).items():
            assert value == dockerfile_args()[name], name


def test_dockerignore_keeps_local_state_out_of_the_image():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for entry in (".venv", "runs", ".git", ".pytest_cache"):
        assert entry in ignored, entry
    assert {"__pycache__", "**/__pycache__"} & ignored


# ---------------------------------------------------------------------------------------------- README

def readme_commands() -> list[list[str]]:
    """The p2p-diloco argument lists of the commands in bootstrap/README.md's code blocks."""
    text = (ROOT / "bootstrap" / "README.md").read_text()
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            words = words[1:] if words[:1] == ["sudo"] else words
            if words and PurePosixPath(words[0]).name == "p2p-diloco":
                commands.append(words[1:])
            elif words[:2] == ["docker", "run"] and "p2p-diloco" in words:  # the image name, then its arguments
                commands.append(words[words.index("p2p-diloco") + 1:])
    return commands


def commands_in(text: str) -> list[list[str]]:
    """The p2p-diloco argument lists in the bash blocks of ``text``."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["p2p-diloco"]:
                commands.append(words[1:])
    return commands


def operating_commands() -> list[list[str]]:
    """The p2p-diloco argument lists in the bash blocks of docs/user-guide.md's "Operating a swarm" section."""
    text = (ROOT / "docs" / "user-guide.md").read_text()
    return commands_in(text.split("\n## Operating a swarm\n", 1)[1].split("\n## ", 1)[0])


def test_readme_operating_commands_are_accepted_by_the_cli():
    commands = operating_commands()
    assert {argv[0] for argv in commands} == {"peer", "bootstrap", "status"}
    for argv in commands:
        args, cfg = cli_config(argv, {})
        if args.command in ("peer", "status"):
            assert cfg.dht.initial_peers, f"no initial peers in: p2p-diloco {shlex.join(argv)}"
        if args.command == "status":
            assert cfg.run.run_id == "my-run"
    resumes = [cli_config(argv, {})[1].checkpoint.resume for argv in commands if argv[0] == "peer"]
    assert True in resumes and False in resumes, "the resume section shows both resuming and starting fresh"


def test_readme_commands_are_accepted_by_the_cli(compose):
    commands = readme_commands()
    assert {argv[0] for argv in commands} >= {"peer", "bootstrap"}
    files = {**SYSTEMD_CONFIG, **config_files(compose["services"]["bootstrap"])}
    for argv in commands:
        cli_config(argv, files)


def test_readme_paths_and_guide_start_a_new_swarm_whose_first_peers_wait_bounded():
    """The first peer of a new swarm does not train alone: the README's paths and the guide's operating section show a
    peer that waits for others (train.wait_for_peers > 1), with the timeout said, and the example configs of peers
    meant to start together (peer.toml, compose.toml) wait for a second one."""
    readme = (ROOT / "README.md").read_text()
    paths = readme.split("\n## Three paths\n", 1)[1].split("\n## ", 1)[0]
    guide = operating_commands()
    for where, commands in (("README's paths", commands_in(paths)), ("user guide", guide)):
        waits = [cfg.train for argv in commands if argv[0] == "peer" for cfg in [cli_config(argv, {})[1]]
                 if cfg.train.wait_for_peers > 1]
        assert waits, f"no first-peer recipe (a peer with --train.wait_for_peers N) in the {where}"
        assert all(train.wait_for_peers_timeout_s != Config().train.wait_for_peers_timeout_s for train in waits)
    for name in ("peer.toml", "compose.toml"):
        assert load_config(ROOT / "peers" / name).train.wait_for_peers == 2, name


def all_readme_commands() -> list[list[str]]:
    """The p2p-diloco argument lists in every bash block of README.md and docs/user-guide.md ("..." elisions
    dropped); a line of ``peers/launch-torchrun.sh`` is the ``p2p-diloco peer --stages P ...`` it runs (P from its
    environment)."""
    text = "\n".join((ROOT / name).read_text() for name in ("README.md", "docs/user-guide.md"))
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["p2p-diloco"] or words[:1] == [".venv/bin/p2p-diloco"]:
                commands.append([w for w in words[1:] if w != "..."])
            elif "peers/launch-torchrun.sh" in words:
                at = words.index("peers/launch-torchrun.sh")
                env = dict(w.split("=", 1) for w in words[:at])
                stages = int(env.get("NNODES", 1)) * int(env.get("NPROC_PER_NODE", 1))
                commands.append(["peer", "--stages", str(stages), *words[at + 1:]])
    return commands


def test_no_readme_command_uses_an_option_the_cli_lacks():
    """Every p2p-diloco command in README.md and docs/user-guide.md parses: its subcommand and options exist, and
    config overrides (--section.key) name real keys with valid values."""
    from p2p_diloco.cli.main import build_parser
    from p2p_diloco.config import load_config, split_overrides

    commands = all_readme_commands()
    assert {argv[0] for argv in commands} >= {"peer", "bootstrap", "status", "prepare-data", "export", "generate",
                                              "config"}
    assert ["--stages", "8"] in [argv[1:3] for argv in commands], "the torchrun line (2 nodes x 4) is parsed"
    parser = build_parser()
    for argv in commands:
        if argv == ["--version"]:  # prints the version and exits 0 (an unknown option exits 2)
            with pytest.raises(SystemExit) as exited:
                parser.parse_known_args(argv)
            assert exited.value.code in (0, None)
            continue
        args, rest = parser.parse_known_args(argv)
        if getattr(args, "accepts_overrides", False):
            load_config(getattr(args, "config", None), split_overrides(rest))
        else:
            assert not rest, f"p2p-diloco {shlex.join(argv)}: unknown {rest}"
