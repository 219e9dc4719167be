"""Fragments: slices of the model defined by the model alone, the unit that streaming sync averages one at a time.

The model is a row of parts: the embedding, blocks 0..n-1, the head (final norm and output). F fragments cut
that row into F contiguous runs of parts, so that the largest fragment is as small as it can be (a linear
partition by parameter count; in a small model the embedding and the head are fragments of their own). The cut
depends on the model's shape and F only, never on how a peer splits the model into pipeline stages, so a
fragment is the same parameters on every peer. A stage of a pipeline holds whole fragments: a split with a
stage boundary inside a fragment is refused (:func:`check_split_fits`). Fragments are sequential, not strided
as Streaming DiLoCo's best pattern (arXiv 2501.18512, section 3.2) is: a stage holds contiguous blocks.

Streaming sync (arXiv 2501.18512, Algorithm 2) averages fragment f at its own inner steps, staggered by
``(F - 1 - f) * H / F`` before the regular round end (:func:`round_shifts`), so that one fragment is on the
wire at a time and the peak bandwidth falls by the largest fragment's share of the model. Who calls this:
``benchmarks/quality.py`` (the streaming rows) and ``p2p-diloco plan``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from torch import nn

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.model.llama import ModelArgs
from p2p_diloco.model.presets import block_num_params, embedding_num_params, head_num_params


def part_sizes(args: ModelArgs) -> list[int]:
    """Parameters of each part of the model: embedding, each block, head."""
    return [embedding_num_params(args)] + [block_num_params(args)] * args.n_layers + [head_num_params(args)]


def fragment_parts(args: ModelArgs, num_fragments: int) -> list[int]:
    """Parts per fragment (embedding, blocks, head counted as parts), e.g. ``[1, 2, 2, 1]`` for 4 blocks and F = 4
    with a large vocabulary: the contiguous cut with the smallest largest fragment, and of those the most even.

    Raises:
        ConfigError: F < 1, or more fragments than parts (naming ``diloco.fragments``).
    """
    sizes = part_sizes(args)
    if not 1 <= num_fragments <= len(sizes):
        raise ConfigError(f"diloco.fragments: must lie in [1, {len(sizes)}] for this model (embedding, "
                          f"{args.n_layers} blocks, head), got {num_fragments}")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    largest = _cut(prefix, num_fragments, lambda size: size, max)[0]
    # of the cuts with that largest fragment, the most even one (least sum of squares): the rest balanced too
    return _cut(prefix, num_fragments, lambda size: size * size if size <= largest else float("inf"),
                lambda a, b: a + b)[1]


def _cut(prefix: list[int], count: int, cost, combine) -> tuple[float, list[int]]:
    """The cut of parts (by ``prefix`` sums) into ``count`` contiguous runs that minimizes the runs' costs combined
    (``max`` or ``+``); the first such cut. Returns (the value, parts per run)."""
    n, inf = len(prefix) - 1, float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    start = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for f in range(1, count + 1):
        for i in range(f, n + 1):
            for j in range(f - 1, i):
                value = combine(best[f - 1][j], cost(prefix[i] - prefix[j]))
                if value < best[f][i]:
                    best[f][i], start[f][i] = value, j
    counts, i = [], n
    for f in range(count, 0, -1):
        counts.append(i - start[f][i])
        i = start[f][i]
    return best[count][n], counts[::-1]


def part_of(name: str, n_layers: int) -> int:
    """The part of a parameter by its name in the full model (a stage keeps the full model's names)."""
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith(("norm.", "output.")):
        return n_layers + 1
    pieces = name.split(".")
    if pieces[0] == "layers" and len(pieces) > 2 and pieces[1].isdigit() and int(pieces[1]) < n_layers:
        return 1 + int(pieces[1])
    raise ValueError(f"parameter {name!r} is in no part of a model of {n_layers} blocks")


def fragment_of(name: str, parts: Sequence[int]) -> int:
    """The fragment of a parameter, by its name in the full model.

    Raises:
        ValueError: a name of no part of the decoder.
    """
    return _fragment_of_part(part_of(name, sum(parts) - 2), parts)


def _fragment_of_part(part: int, parts: Sequence[int]) -> int:
    end = 0
    for index, count in enumerate(parts):
        end += count
        if part < end:
            return index
    raise ValueError(f"part {part} is in none of the fragments {list(parts)}")


def describe(parts: Sequence[int]) -> str:
    """``[1, 2, 2, 1]`` -> ``"0: embedding, 1: block 0 to block 1, 2: block 2 to block 3, 3: head"``."""
    n_layers = sum(parts) - 2
    names = ["embedding"] + [f"block {b}" for b in range(n_layers)] + ["head"]
    out, start = [], 0
    for index, count in enumerate(parts):
        held = names[start:start + count]
        out.append(f"{index}: " + (held[0] if count == 1 else f"{held[0]} to {held[-1]}"))
        start += count
    return ", ".join(out)


def check_split_fits(stage_layers: Sequence[int], parts: Sequence[int]) -> None:
    """Refuse a pipeline split that cuts a fragment: every stage boundary must be a fragment boundary.

    Raises:
        ConfigError: naming the stage, the block it starts at and the fragments.
    """
    bounds, end = set(), 0
    for count in parts:
        end += count
        bounds.add(end)
    block = 0
    for index, count in enumerate(stage_layers[:-1]):
        block += count
        if 1 + block not in bounds:  # parts before stage index + 1: the embedding and `block` blocks
            raise ConfigError(f"pipeline.stage_layers: stage {index + 1} starts at block {block}, inside a fragment "
                              f"(fragments {describe(parts)}); a stage must hold whole fragments")


def stage_fragments(stage_layers: Sequence[int], parts: Sequence[int], stage_index: int) -> list[int]:
    """The fragments a stage of a (fitting) split holds, e.g. ``([2, 2], [1, 2, 2, 1], 1) -> [2, 3]``."""
    n_layers = sum(stage_layers)
    if sum(parts) - 2 != n_layers:
        raise ValueError(f"the split has {n_layers} blocks, the fragments {sum(parts) - 2}")
    check_split_fits(stage_layers, parts)
    first = sum(stage_layers[:stage_index])
    held = [1 + b for b in range(first, first + stage_layers[stage_index])]  # part 0 is the embedding
    held += [0] if stage_index == 0 else []
    held += [n_layers + 1] if stage_index == len(stage_layers) - 1 else []
    return sorted({_fragment_of_part(part, parts) for part in held})


def fitting_split(args: ModelArgs, parts: Sequence[int], num_stages: int) -> list[int]:
    """Blocks per stage for a peer of ``num_stages`` stages in a run averaged by fragment: stages of whole fragments,
    each with at least one block, with the smallest largest stage (parameters); the first such split.

    Raises:
        ConfigError: no split of whole fragments gives every stage a block (naming ``pipeline.stages``).
    """
    sizes = part_sizes(args)
    best: tuple[int, list[int]] | None = None
    bounds = [sum(parts[:i]) for i in range(1, len(parts))]  # part indices where a fragment starts
    for cuts in itertools.combinations(bounds, num_stages - 1):
        edges = [0, *cuts, len(sizes)]
        blocks = [sum(1 for part in range(a, b) if 0 < part <= args.n_layers) for a, b in zip(edges, edges[1:])]
        if min(blocks) < 1:
            continue
        largest = max(sum(sizes[a:b]) for a, b in zip(edges, edges[1:]))
        if best is None or largest < best[0]:
            best = (largest, blocks)
    if best is None:
        raise ConfigError(f"pipeline.stages: {num_stages} stages of whole fragments, each with a block, do not fit "
                          f"the fragments {describe(parts)}; use fewer stages or another diloco.fragments")
    return best[1]


def split_parameters(named: Iterable[tuple[str, nn.Parameter]], parts: Sequence[int]
                     ) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """A module's (name, parameter) pairs by fragment, in their order; fragments with none are left out."""
    out: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for name, param in named:
        out.setdefault(fragment_of(name, parts), []).append((name, param))
    return dict(sorted(out.items()))


def round_shifts(num_fragments: int, inner_steps: int) -> list[int]:
    """Streaming sync: how many inner steps before the regular round end fragment f's round ends,
    ``(F - 1 - f) * H // F`` (the last fragment on the regular round end, fragment 0 earliest).

    Raises:
        ConfigError: fewer inner steps than fragments (two fragments would sync at the same step).
    """
    if inner_steps < num_fragments:
        raise ConfigError(f"diloco.fragments: streaming {num_fragments} fragments needs diloco.inner_steps >= "
                          f"{num_fragments} (one fragment per step at most), got {inner_steps}")
    return [(num_fragments - 1 - f) * inner_steps // num_fragments for f in range(num_fragments)]


class FragmentView(nn.Module):
    """A module holding some parameters of another (the same tensors, not copies), for a
    :class:`~p2p_diloco.round.stage.Stage` of one fragment; its parameter names are the model's."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]]):
        super().__init__()
        self._names = [name for name, _ in named]
        for i, (_, param) in enumerate(named):
            self.register_parameter(f"p{i}", param)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from zip(self._names, (getattr(self, f"p{i}") for i in range(len(self._names))))
