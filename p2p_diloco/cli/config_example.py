"""``p2p-diloco config --example NAME``: print (or ``--out FILE`` write) one of the example configs.

The examples ship inside the package (``p2p_diloco/examples/*.toml``, package data), so that a user who installed
only the wheel can run the README's ``--config peers/peer.toml`` commands after
``p2p-diloco config --example peer --out peers/peer.toml``. The repository's ``peers/`` and ``bootstrap/`` files
are the same bytes (``tests/unit/test_config_example.py`` checks it).
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

# name -> (where the repository keeps it, what it is for)
EXAMPLES = {
    "peer": ("peers/peer.toml", "a peer of a public swarm, every section documented"),
    "demo": ("peers/demo.toml", "the local demo's settings (`p2p-diloco swarm --config`)"),
    "gpu-1b": ("peers/gpu-1b.toml", "a GPU box training the 1b preset"),
    "sparseloco": ("peers/sparseloco.toml", "a peer averaging with SparseLoCo"),
    "bootstrap": ("bootstrap/bootstrap.toml", "a bootstrap node (`p2p-diloco bootstrap --config`)"),
}


def example_text(name: str) -> str:
    """The packaged example config ``name`` (a key of EXAMPLES), as text."""
    return (resources.files("p2p_diloco") / "examples" / f"{name}.toml").read_text(encoding="utf-8")


def register(subparsers) -> None:
    listing = "; ".join(f"{name}: {what}" for name, (_, what) in EXAMPLES.items())
    parser = subparsers.add_parser(
        "config", help="print or write an example config file", allow_abbrev=False,
        description="Print one of the example config files that ship with the package, or write it with --out "
        f"(then pass it to `--config`). Without --example, list them. Examples: {listing}.",
    )
    parser.add_argument("--example", choices=list(EXAMPLES), metavar="NAME",
                        help=f"the example to print: {', '.join(EXAMPLES)}")
    parser.add_argument("--out", metavar="FILE", help="write it to FILE (its folders are created) instead of printing")
    parser.add_argument("--force", action="store_true",
                        help="with --out: replace FILE if it exists with other contents (without it, an edited FILE "
                        "is kept and the command fails)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, _overrides) -> int:
    from p2p_diloco.config import ConfigError

    if args.example is None:
        if args.out is not None:
            raise ConfigError("--out needs --example NAME (the example to write)")
        for name, (path, what) in EXAMPLES.items():
            print(f"{name:<11} {what} (the repository's {path})")
        print("\n`p2p-diloco config --example NAME --out FILE` writes one; `--config FILE` uses it.")
        return 0
    text = example_text(args.example)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise ConfigError(f"--out {args.out}: a folder; name the file to write (e.g. {out / 'peer.toml'})")
    if out.is_file() and out.read_text(encoding="utf-8") == text:  # nothing to lose, nothing to change
        print(f"{out} is already the {args.example} example; use it with --config {out}", file=sys.stderr)
        return 0
    if out.exists() and not args.force:
        raise ConfigError(f"--out {args.out}: the file exists; --force replaces it")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"Wrote the {args.example} example to {out}; use it with --config {out}", file=sys.stderr)
    return 0
