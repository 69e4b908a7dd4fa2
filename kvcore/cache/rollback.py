"""Rolling a CompressedKVCache back by n tokens (`trim`: speculative decoding's rejected drafts).

Dense tokens are cut off; encoded blocks are dropped whole and a partly kept block, or a block
that is back within `recent` of the new end, returns to the dense tail: the exact dense copy the
last update kept (`_fresh`) when it has it, else decoded.
"""

from __future__ import annotations


def trim(cache, n: int) -> int:
    """Remove the last n tokens (as many as the window still allows); returns how many."""
    n = min(n, cache.offset)
    if cache.window is not None:
        stored_from = cache.enc_start if cache.enc.n else cache.tail_start
        if stored_from > cache.keep:  # the next query must still see a whole window
            n = min(n, max(0, cache.offset - stored_from - (cache.window - cache.keep) + 1))
    if n <= 0:
        return 0
    rest = n
    k = min(rest, cache.tail.n)
    cache.tail.truncate(cache.tail.n - k)
    rest -= k
    k = min(rest, cache.enc.n * cache.block_tokens)
    if k:
        trim_encoded(cache, k)
        rest -= k
    cache.sink.truncate(cache.sink.n - rest)
    cache.offset -= n
    restore_recent(cache)
    return n


def restore_recent(cache) -> None:
    """After a trim: blocks within `recent` of the new end go back to the dense tail, exactly
    where the last update's dense copy has them, else decoded."""
    bt, short = cache.block_tokens, cache.recent - cache.tail.n
    if short <= 0 or not cache.enc.n:
        return
    blocks = min(cache.enc.n, -(-short // bt))
    b0 = cache.enc.n - blocks
    pos, n = cache.enc_start + b0 * bt, blocks * bt
    fresh = cache._fresh
    if fresh is not None and fresh[2] <= pos and pos + n <= fresh[2] + fresh[0].shape[2]:
        k, v = (a[:, :, pos - fresh[2] : pos - fresh[2] + n] for a in fresh[:2])
    else:
        ks, vs = cache._split_enc()
        k = cache.key_codec.decode(tuple(a[:, :, b0:] for a in ks), cache._dims[4])
        v = cache.value_codec.decode(tuple(a[:, :, b0:] for a in vs), cache._dims[4])
    rest = cache.tail.get() if cache.tail.n else None
    cache.tail.clear()
    cache.tail.append((k, v))
    if rest is not None:
        cache.tail.append(rest)
    cache.enc.truncate(b0)
    cache.tail_start = pos


def trim_encoded(cache, n: int) -> None:
    """Drop the last n encoded tokens: whole blocks, the kept head of a partly dropped one dense."""
    bt = cache.block_tokens
    blocks = (n + bt - 1) // bt
    keep_tokens = blocks * bt - n  # tokens of the last dropped block to restore dense
    if keep_tokens:
        b0 = cache.enc.n - blocks
        pos = cache.enc_start + b0 * bt
        fresh = cache._fresh
        if fresh is not None and fresh[2] <= pos and pos + bt <= fresh[2] + fresh[0].shape[2]:
            # encoded by the last update: its exact dense copy is still at hand
            k, v = (a[:, :, pos - fresh[2] : pos - fresh[2] + bt] for a in fresh[:2])
        else:
            ks, vs = cache._split_enc()
            dtype = cache._dims[4]
            k = cache.key_codec.decode(tuple(a[:, :, b0 : b0 + 1] for a in ks), dtype)
            v = cache.value_codec.decode(tuple(a[:, :, b0 : b0 + 1] for a in vs), dtype)
        cache.tail.clear()
        cache.tail.append((k[:, :, :keep_tokens], v[:, :, :keep_tokens]))
    cache.enc.truncate(cache.enc.n - blocks)
    cache.tail_start = cache.enc_start + cache.enc.n * bt
