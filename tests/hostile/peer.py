"""A hostile peer process: ``python -m tests.hostile.peer <kind>[:<value>] -- <the arguments of p2p-diloco peer>``
(run from the repository root).

It installs the kind's subclasses (:mod:`tests.hostile`) as the classes the stage process builds its averager and
swarm link with (``p2p_diloco.stage_process.SWARM_CLASSES``), then runs the ``peer`` command in this process. A
one-process peer only (P = 1, D = 1): the stage processes of a pipelined peer are started afresh, without them.
Nothing of it reaches a production peer: ``p2p-diloco peer`` has no hostile option, and no honest module reads this one.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

USAGE = "usage: python -m tests.hostile.peer KIND[:VALUE] -- ARGS OF p2p-diloco peer"


def one_process(peer_args: list[str]) -> bool:
    """Whether the peer these arguments start is one process (its config read as the ``peer`` command reads it)."""
    from p2p_diloco.cli.common import config_from_args
    from p2p_diloco.cli.main import build_parser
    from p2p_diloco.cli.peer import pipeline_overrides
    from p2p_diloco.config import ConfigError, split_overrides

    args, rest = build_parser().parse_known_args(["peer", *peer_args])
    try:
        cfg = config_from_args(args, split_overrides(rest), extra=pipeline_overrides(args))
    except ConfigError:
        return True  # the peer command says what is wrong with it
    return cfg.pipeline.stages * cfg.pipeline.replicas == 1


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[1] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    spec, peer_args = argv[0], argv[2:]
    if peer_args[:1] == ["peer"]:
        peer_args = peer_args[1:]
    from tests.hostile import parse_hostility

    try:
        hostility = parse_hostility(spec)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not one_process(peer_args):
        print("error: a hostile peer is one process (pipeline.stages and pipeline.replicas 1)", file=sys.stderr)
        return 2
    from p2p_diloco import stage_process
    from p2p_diloco.cli.main import main as cli_main

    stage_process.SWARM_CLASSES = stage_process.SwarmClasses(averager=hostility.averager, link=hostility.link)
    return cli_main(["peer", *peer_args])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as p2p-diloco's: hivemind's background processes can keep a finished interpreter alive
