"""Check a GGUF's tensors against the config built from its metadata, before anything runs or is
written: every tensor a llama-shaped model needs is there once, with its shape, and no block lies
beyond `block_count`; the vocabulary fits the embedding. One line names the first problem."""

from __future__ import annotations

import re
from typing import Any

from kvcore.errors import MlxkvError
from kvcore.gguf.reader import GGUFFile

_BLK = re.compile(r"^blk\.(\d+)\.")


def expected_shapes(config: dict[str, Any], attention_bias: bool) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape (MLX order: rows, cols) a model of `config` needs."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    out = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        out["output.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": (hidden,), b + "ffn_norm.weight": (hidden,),
            b + "attn_q.weight": (q, hidden), b + "attn_k.weight": (kv, hidden), b + "attn_v.weight": (kv, hidden),
            b + "attn_output.weight": (hidden, q),
            b + "ffn_gate.weight": (ffn, hidden), b + "ffn_up.weight": (ffn, hidden), b + "ffn_down.weight": (hidden, ffn),
        })
        if attention_bias:
            out.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
    return out


def check_tensors(gguf: GGUFFile, config: dict[str, Any], attention_bias: bool) -> None:
    want = expected_shapes(config, attention_bias)
    layers = config["num_hidden_layers"]
    where = f"{gguf.path}"
    for name, info in gguf.infos.items():
        m = _BLK.match(name)
        if m and int(m[1]) >= layers:
            raise MlxkvError(f"GGUF tensor '{name}' lies beyond block_count {layers} (the metadata and the "
                             f"tensors disagree): {where}")
        if name in want and info.shape != want[name]:
            raise MlxkvError(f"GGUF tensor '{name}' has shape {list(info.shape)}, the metadata implies "
                             f"{list(want[name])}: {where}")
    if "rope_freqs.weight" in gguf.infos and gguf.infos["rope_freqs.weight"].shape != (config["head_dim"] // 2,):
        raise MlxkvError(f"GGUF tensor 'rope_freqs.weight' has shape {list(gguf.infos['rope_freqs.weight'].shape)}, "
                         f"head_dim {config['head_dim']} needs [{config['head_dim'] // 2}]: {where}")
    missing = [n for n in want if n not in gguf.infos]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise MlxkvError(f"GGUF is missing tensor '{missing[0]}'{more} (block_count {layers}): {where}")


def check_vocabulary(gguf: GGUFFile, config: dict[str, Any]) -> None:
    """The token list, its per-token tables and the special token ids agree with the embedding."""
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    vocab = config["vocab_size"]
    if tokens and len(tokens) != vocab:
        raise MlxkvError(f"GGUF vocabulary has {len(tokens)} tokens, the embedding {vocab} rows: {gguf.path}")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        table = gguf.get(key)
        if table is not None and (not isinstance(table, list) or len(table) != len(tokens)):
            n = len(table) if isinstance(table, list) else type(table).__name__
            raise MlxkvError(f"GGUF '{key}' has {n} entries for {len(tokens)} tokens: {gguf.path}")
    # BOS starts every prompt and EOS/EOT/EOM stop generation: out of the vocabulary they would be dropped
    # silently. (An unknown or padding id out of range is ignored, as llama.cpp does.)
    for name in ("bos", "eos", "eot", "eom"):
        key = f"tokenizer.ggml.{name}_token_id"
        tid = gguf.get(key)
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < len(tokens)):
            raise MlxkvError(f"GGUF '{key}' is {tid!r}, outside the vocabulary of {len(tokens)} tokens: "
                             f"{gguf.path}")
