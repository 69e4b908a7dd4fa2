"""Rebuild a Hugging Face fast tokenizer from GGUF `tokenizer.ggml.*` metadata.

Two vocabularies, as llama.cpp knows them:
- "gpt2": byte-level BPE from `tokens` + `merges`; the pre-tokenizer is named by
  `tokenizer.ggml.pre` (smollm/starcoder: digits split one by one, then ByteLevel).
- "llama": SentencePiece BPE from `tokens` + `scores` (+ byte-fallback pieces);
  merges are derived from the scores (higher score merges first), in the same
  layout `transformers` uses for Llama-2 style tokenizer.json files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from kvcore.errors import MlxkvError
from kvcore.gguf.reader import GGUFFile

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre names -> pre-tokenizer (as llama.cpp's llama-vocab.cpp groups them)
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_GPT2_PRE = ("default", "gpt2", "gpt-2")
_REGEX_PRE = {"llama-bpe": _LLAMA3_RE, "llama3": _LLAMA3_RE, "smaug-bpe": _LLAMA3_RE,
              "dbrx": _LLAMA3_RE, "qwen2": _QWEN2_RE}


@dataclass
class TokenizerSpec:
    tokenizer: Tokenizer
    kind: str  # "bpe" (byte-level) or "spm"
    bos: str | None
    eos: str | None
    unk: str | None
    pad: str | None
    chat_template: str | None
    add_bos: bool
    add_space_prefix: bool
    model_max_length: int
    extra_eos_ids: list[int] = field(default_factory=list)

    def hf(self) -> Any:
        """transformers.PreTrainedTokenizerFast around the in-memory tokenizer."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self.tokenizer, **self._config())

    def wrapper(self) -> Any:
        """mlx-lm TokenizerWrapper with the matching streaming detokenizer."""
        from functools import partial

        from mlx_lm.tokenizer_utils import (
            BPEStreamingDetokenizer,
            SPMStreamingDetokenizer,
            TokenizerWrapper,
        )

        if self.kind == "spm":
            detok = partial(SPMStreamingDetokenizer, trim_space=self.add_space_prefix)
        else:
            detok = BPEStreamingDetokenizer
        return TokenizerWrapper(self.hf(), detok, eos_token_ids=self.extra_eos_ids)

    def _config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            k: v for k, v in (("bos_token", self.bos), ("eos_token", self.eos),
                              ("unk_token", self.unk), ("pad_token", self.pad)) if v is not None
        }
        cfg["clean_up_tokenization_spaces"] = False
        cfg["model_max_length"] = self.model_max_length
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return cfg

    def save(self, out_dir: Path) -> None:
        """tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
        self.tokenizer.save(str(out_dir / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **self._config()}
        cfg["add_bos_token"] = self.add_bos
        (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        special = {k: v for k, v in cfg.items()
                   if k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges for a score-ranked SentencePiece BPE vocab (as transformers derives them)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    merges = []
    for piece, pid in vocab.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(left, right, scores[pid]) for left, right in local]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _bpe_merges(gguf: GGUFFile, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as pairs; a byte-level BPE without merges cannot join two bytes
    (every word would come out as single bytes), and a merge naming no token is corrupt."""
    raw = gguf.get("tokenizer.ggml.merges")
    if not raw:
        raise MlxkvError(f"GGUF gpt2 (byte-level BPE) vocabulary has no tokenizer.ggml.merges: {gguf.path}")
    merges = []
    for k, m in enumerate(raw):
        left, sep, right = m.partition(" ") if isinstance(m, str) else ("", "", "")
        if not sep or left not in vocab or right not in vocab or left + right not in vocab:
            raise MlxkvError(f"GGUF tokenizer.ggml.merges entry {k} ({m!r}) does not join two tokens of the "
                             f"vocabulary into a third: {gguf.path}")
        merges.append((left, right))
    return merges


def _bpe_pre_tokenizer(pre: str, path: Path) -> Any:
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    supported = ", ".join(_DIGITS_PRE + _GPT2_PRE + tuple(_REGEX_PRE))
    raise MlxkvError(f"unsupported GGUF pre-tokenizer '{pre}' (supported: {supported}): {path}")


def _template(tok: str | None, tid: int | None, add_bos: bool, eos: str | None,
              eos_id: int | None, add_eos: bool) -> Any:
    single, pair, special = "$A", "$A $B:1", []
    if add_bos and tok is not None:
        single, pair = f"{tok} {single}", f"{tok} $A {tok}:1 $B:1"
        special.append((tok, tid))
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}:1"
        special.append((eos, eos_id))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_tokenizer(gguf: GGUFFile, context_length: int = 2048) -> TokenizerSpec:
    model = gguf.get("tokenizer.ggml.model")
    tokens: list[str] = gguf.get("tokenizer.ggml.tokens") or []
    if model is None or not tokens:
        raise MlxkvError(f"GGUF has no tokenizer (tokenizer.ggml.model/tokens): {gguf.path}")
    types = gguf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)

    def tok_of(name: str) -> tuple[str | None, int | None]:
        tid = gguf.get(f"tokenizer.ggml.{name}_token_id")
        if tid is None or not 0 <= int(tid) < len(tokens):
            return None, None
        return tokens[int(tid)], int(tid)

    bos, bos_id = tok_of("bos")
    eos, eos_id = tok_of("eos")
    unk, _ = tok_of("unknown")
    pad, _ = tok_of("padding")
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False))
    vocab = {t: i for i, t in enumerate(tokens)}

    if model == "gpt2":
        kind, add_space = "bpe", False
        add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False))
        merges = _bpe_merges(gguf, vocab)
        pre = gguf.get("tokenizer.ggml.pre", "default")
        llama3 = _REGEX_PRE.get(pre) == _LLAMA3_RE  # HF Llama-3 tokenizers ignore merges
        tk = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=None, fuse_unk=False,
                                  byte_fallback=False, ignore_merges=llama3))
        tk.pre_tokenizer = _bpe_pre_tokenizer(pre, gguf.path)
        if pre == "qwen2":
            tk.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
        tk.decoder = decoders.ByteLevel()
    elif model == "llama":
        kind = "spm"
        add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", True))
        add_space = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
        scores = gguf.get("tokenizer.ggml.scores")
        if scores is None:
            raise MlxkvError(f"SentencePiece GGUF vocab has no tokenizer.ggml.scores: {gguf.path}")
        tk = Tokenizer(models.BPE(vocab, _spm_merges(tokens, scores, types), dropout=None,
                                  unk_token=unk, fuse_unk=True, byte_fallback=True))
        norm = [normalizers.Replace(" ", "\u2581")]
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space:
            norm.insert(0, normalizers.Prepend("\u2581"))
            dec.append(decoders.Strip(" ", 1, 0))
        tk.normalizer = normalizers.Sequence(norm)
        tk.decoder = decoders.Sequence(dec)
    else:
        raise MlxkvError(f"unsupported GGUF tokenizer model '{model}' (supported: gpt2, llama): "
                         f"{gguf.path}")

    added = [AddedToken(t, special=types[i] != USER_DEFINED, normalized=False)
             for i, t in enumerate(tokens) if types[i] in (UNKNOWN, CONTROL, USER_DEFINED)]
    if added:
        tk.add_special_tokens([a for a in added if a.special])
        tk.add_tokens([a for a in added if not a.special])
    tk.post_processor = _template(bos, bos_id, add_bos, eos, eos_id, add_eos)

    extra = [int(x) for x in (gguf.get("tokenizer.ggml.eot_token_id"),
                              gguf.get("tokenizer.ggml.eom_token_id"))
             if x is not None and int(x) != eos_id]
    return TokenizerSpec(tk, kind, bos, eos, unk, pad, gguf.get("tokenizer.chat_template"),
                         add_bos, add_space, context_length, extra)
