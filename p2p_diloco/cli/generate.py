"""``p2p-diloco generate``: sample text from a peer's checkpoint or an exported folder.

Loads the whole model (every stage's anchor joined, or an exported folder's weights) into the decoder on CPU or
CUDA and prints the prompt followed by what the model writes (:mod:`p2p_diloco.model.sample`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="sample text from a checkpoint or an exported model folder", allow_abbrev=False,
        description="Sample text from the model a peer trained (its checkpoint's anchor, every stage joined) or "
        "from a folder written by `p2p-diloco export`. Prints the prompt and the sampled continuation.",
    )
    parser.add_argument("source", metavar="MODEL",
                        help="a peer's output folder, its checkpoints folder, or an exported model folder")
    parser.add_argument("--prompt", default="The ", help="text to continue (default: %(default)r)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                        help="tokens to sample at most (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="sampling temperature; 0 picks the most likely token (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=50, metavar="K",
                        help="sample among the K most likely tokens; 0: all (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu', 'cuda' or 'cuda:N'")
    parser.add_argument("--step", type=int, metavar="N",
                        help="for a checkpoint: the inner step (default: the newest that every stage has)")
    parser.add_argument("--tokenizer", metavar="SPEC",
                        help="'byte' or a tokenizer.json (default: the model's own)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, _overrides) -> int:
    from p2p_diloco.cli.export import device_of, load_model_source
    from p2p_diloco.config import ConfigError
    from p2p_diloco.model.sample import build_model, sample

    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens, --temperature and --top-k must be >= 0")
    device = device_of(args.device)
    model_args, tensors, tokenizer, what = load_model_source(Path(args.source).expanduser(), args.step,
                                                             args.tokenizer)
    model = build_model(model_args, tensors, device)
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise ConfigError("--prompt: the prompt is empty (it needs at least one token)")
    start = time.monotonic()
    try:
        new = sample(model, prompt_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                     stop_id=tokenizer.eot_id, seed=args.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    elapsed = time.monotonic() - start
    print(args.prompt + tokenizer.decode(new))
    print(f"({len(new)} tokens from {what} on {device}, {elapsed:.1f} s)", file=sys.stderr)
    return 0
