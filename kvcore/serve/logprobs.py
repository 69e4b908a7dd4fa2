"""A completion's log-probabilities in OpenAI's two shapes: chat (`content`: token, logprob, bytes,
top_logprobs) and text completions (tokens, token_logprobs, top_logprobs, text_offset).

The chosen tokens' texts come from a streaming detokenizer, so they join into the generated
text; an alternative's text is its token decoded alone."""

from __future__ import annotations


def _texts(tokenizer, ids: list[int]) -> list[str]:
    detok = tokenizer.detokenizer
    detok.reset()
    out = []
    for t in ids:
        detok.add_token(t)
        out.append(detok.last_segment)
    detok.finalize()
    if out:
        out[-1] += detok.last_segment
    return out


def _alone(tokenizer, tok: int) -> str:
    return tokenizer.decode([tok])


def chat_logprobs(tokenizer, ids: list[int], entries: list[dict]) -> dict:
    content = []
    for text, entry in zip(_texts(tokenizer, ids), entries):
        top = [{"token": (t := _alone(tokenizer, i)), "logprob": lp, "bytes": list(t.encode())}
               for i, lp in entry["top"]]
        content.append({"token": text, "logprob": entry["logprob"], "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, ids: list[int], entries: list[dict]) -> dict:
    texts = _texts(tokenizer, ids)
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_alone(tokenizer, i): lp for i, lp in e["top"]} for e in entries],
            "text_offset": offsets}
