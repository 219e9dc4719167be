"""Sampling text from the decoder: temperature and top-k, one token at a time.

The decoder has no key/value cache (it is built for training), so each new token runs the whole context again,
cut to the model's ``max_seq_len`` most recent tokens: fine for the short samples a user looks at, not a serving
stack (export the model and use transformers or vLLM for that). Called by ``p2p-diloco generate`` and the demo.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from p2p_diloco.model.llama import ModelArgs, Transformer


def build_model(args: ModelArgs, tensors: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """The whole decoder of shape ``args`` holding ``tensors`` (every parameter, our names), in eval mode."""
    model = Transformer(args)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])
    return model.to(device).eval()


@torch.no_grad()
def sample(model: Transformer, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.8,
           top_k: Optional[int] = 50, stop_id: Optional[int] = None, seed: int = 0) -> list[int]:
    """The ids of up to ``max_new_tokens`` tokens following ``prompt_ids``.

    Args:
        temperature: 0 picks the most likely token (greedy); higher flattens the distribution.
        top_k: sample among the k most likely tokens only (None or 0: all).
        stop_id: stop after this token (the end-of-document token), which is not returned.
        seed: the sampling generator's seed (the same seed and model give the same text).

    Raises:
        ValueError: an empty prompt, a negative count or temperature, or a token id outside the vocabulary.
    """
    vocab = model.args.vocab_size
    if not prompt_ids:
        raise ValueError("the prompt is empty (it needs at least one token)")
    if any(not 0 <= i < vocab for i in prompt_ids):
        raise ValueError(f"the prompt holds token ids outside the model's vocabulary of {vocab}")
    if max_new_tokens < 0 or temperature < 0:
        raise ValueError("max_new_tokens and temperature must be >= 0")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-model.args.max_seq_len:]], device=device)  # (1, T)
        with autocast:
            logits = model(context)[0, -1].float().cpu()  # (V,)
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, vocab)).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        if token == stop_id:
            break
        ids.append(token)
        new.append(token)
    return new
