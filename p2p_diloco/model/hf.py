"""The model in Hugging Face ``transformers``' terms: ``LlamaForCausalLM``'s config, parameter names and tokenizer.

Our decoder is LLaMA's (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, no biases), with torchtitan's
parameter names. The layouts are transformers' already: every ``nn.Linear`` is (out, in), and rotary embeddings
rotate the two halves of each head (``rotate_half``), the convention transformers' Llama uses, so a checkpoint
converts by renaming alone, with no permutation of the query and key rows (Meta's original checkpoints rotate
interleaved pairs and need one; ours never did). The byte tokenizer becomes a byte-level BPE ``tokenizer.json``
with no merges: byte b is token b, the end-of-document token 256.

Nothing here imports ``transformers``: exporting and loading an exported folder need only ``safetensors``; the
test that loads the folder in transformers is what checks these names and layouts
(``tests/integration/test_export.py``). Called by :mod:`p2p_diloco.model.export`.
"""

from __future__ import annotations

import re

from p2p_diloco.model.llama import ModelArgs

_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_INVERSE = {theirs: ours for ours, theirs in _BLOCK.items()}
_TOP_INVERSE = {theirs: ours for ours, theirs in _TOP.items()}
_OURS_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
BYTE_EOT = "<|endoftext|>"


def hf_name(name: str) -> str:
    """transformers' name of one of our parameters (KeyError: not a parameter of our decoder)."""
    if name in _TOP:
        return _TOP[name]
    match = _OURS_BLOCK.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK:
        raise KeyError(name)
    return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}"


def our_name(name: str) -> str:
    """Our name of one of transformers' Llama parameters (KeyError: not one our decoder has)."""
    if name in _TOP_INVERSE:
        return _TOP_INVERSE[name]
    match = _HF_BLOCK.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK_INVERSE:
        raise KeyError(name)
    return f"layers.{match.group(1)}.{_BLOCK_INVERSE[match.group(2)]}"


def hf_order(args: ModelArgs) -> list[str]:
    """Our parameter names in the order of transformers' ``state_dict`` (the order its shards are cut in)."""
    names = ["tok_embeddings.weight"]
    names += [f"layers.{i}.{name}" for i in range(args.n_layers) for name in _BLOCK]
    names += ["norm.weight"] + ([] if args.tie_embeddings else ["output.weight"])
    return names


def hf_config(args: ModelArgs, eos_token_id: int | None, dtype: str = "float32") -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with this shape whose weights are stored in ``dtype`` (rope given
    both ways: ``rope_theta`` for transformers 4, ``rope_parameters`` for 5)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }


def args_from_hf_config(config: dict) -> ModelArgs:
    """Our shape of an exported folder's ``config.json`` (ValueError naming what does not fit our decoder)."""
    if config.get("model_type") != "llama":
        raise ValueError(f"config.json: model_type is {config.get('model_type')!r}, not 'llama'")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, expected) != expected:
            raise ValueError(f"config.json: {key} is {config.get(key)!r}; this decoder has {expected!r}")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError("config.json: scaled rotary embeddings are not supported by this decoder")
    try:
        args = ModelArgs(dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
                         n_heads=config["num_attention_heads"],
                         n_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
                         ffn_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
                         max_seq_len=config["max_position_embeddings"],
                         rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                         norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                         tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ValueError(f"config.json: no {e.args[0]!r}") from None
    if config.get("head_dim", args.head_dim) != args.head_dim:
        raise ValueError(f"config.json: head_dim {config['head_dim']} is not hidden_size / num_attention_heads")
    return args


def byte_tokenizer_json() -> dict:
    """Our byte tokenizer as a ``tokenizer.json`` that ``tokenizers`` and transformers load: a byte-level BPE with
    no merges (token b is byte b, in GPT-2's printable byte alphabet) and the end-of-document token 256."""
    alphabet = _bytes_to_unicode()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 256, "content": BYTE_EOT, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {alphabet[b]: b for b in range(256)} | {BYTE_EOT: 256}, "merges": []},
    }


def tokenizer_config(eos_token: str | None, model_max_length: int) -> dict:
    """``tokenizer_config.json``: which class loads ``tokenizer.json``, its end-of-document token, and the model's
    context length (transformers warns of a longer input)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": model_max_length}
    if eos_token is not None:
        config["eos_token"] = eos_token
    return config


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
