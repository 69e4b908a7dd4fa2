"""Measure constrained-decoding engines on a tokenizer: compile time and per-token mask time (llguidance,
outlines-core, xgrammar: install them first; xgrammar pulls torch). python scripts/measure_constrain_engines.py MODEL_DIR"""
import json, time, statistics, sys
import numpy as np
from transformers import AutoTokenizer
S = sys.argv[1]
hf = AutoTokenizer.from_pretrained(S)
V = len(hf)
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["name", "age", "tags"],
          "additionalProperties": False}
text = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}, separators=(",", ":"))
ids = hf.encode(text, add_special_tokens=False)
res = {}

import llguidance, llguidance.hf
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
t0 = time.perf_counter(); lt = llguidance.hf.from_tokenizer(hf); t_tok = time.perf_counter() - t0
t0 = time.perf_counter()
m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False}))
t_comp = time.perf_counter() - t0
bm = allocate_token_bitmask(1, lt.vocab_size)
times = []
for t in ids:
    t0 = time.perf_counter(); fill_next_token_bitmask(m, bm, 0); times.append(time.perf_counter() - t0)
    ok = m.consume_token(t)
res["llguidance"] = {"tokenizer_s": round(t_tok, 3), "compile_s": round(t_comp, 4), "mask_us_median": round(1e6 * statistics.median(times), 1),
                     "mask_us_max": round(1e6 * max(times), 1), "error": m.get_error() or None, "grammars": "JSON schema, regex, Lark CFG"}

from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema
t0 = time.perf_counter()
vocab = {}
for tok_s, i in hf.get_vocab().items():
    if i == hf.eos_token_id: continue
    b = bytes(hf.convert_tokens_to_string([tok_s]), "utf-8") if False else tok_s
    vocab.setdefault(hf.convert_tokens_to_string([tok_s]), []).append(i)
voc = Vocabulary(hf.eos_token_id, vocab)
t_tok = time.perf_counter() - t0
t0 = time.perf_counter(); idx = Index(build_regex_from_schema(json.dumps(schema)), voc); t_comp = time.perf_counter() - t0
g = Guide(idx); times = []
try:
    for t in ids:
        t0 = time.perf_counter(); allowed = g.get_tokens(); times.append(time.perf_counter() - t0); g.advance(t)
    err = None
except Exception as e:
    err = str(e)[:80]
res["outlines_core"] = {"tokenizer_s": round(t_tok, 3), "compile_s": round(t_comp, 3), "mask_us_median": round(1e6 * statistics.median(times), 1) if times else None,
                        "error": err, "grammars": "JSON schema, regex (no CFG)"}

try:
    import xgrammar as xgr
    t0 = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V); t_tok = time.perf_counter() - t0
    t0 = time.perf_counter(); comp = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False); t_comp = time.perf_counter() - t0
    gm = xgr.GrammarMatcher(comp); bmx = xgr.allocate_token_bitmask(1, info.vocab_size); times = []
    for t in ids:
        t0 = time.perf_counter(); gm.fill_next_token_bitmask(bmx); times.append(time.perf_counter() - t0); gm.accept_token(t)
    res["xgrammar"] = {"tokenizer_s": round(t_tok, 3), "compile_s": round(t_comp, 4), "mask_us_median": round(1e6 * statistics.median(times), 1),
                       "mask_us_max": round(1e6 * max(times), 1), "grammars": "JSON schema, regex, EBNF", "needs": "torch"}
except Exception as e:
    res["xgrammar"] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
print(json.dumps({"vocab": V, "tokens": len(ids), **res}, indent=1))
