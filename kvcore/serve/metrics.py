"""Server figures in Prometheus' text format: rows running and waiting, tokens and tokens/s, KV
bytes in use, reserved and budgeted, requests by outcome."""

from __future__ import annotations

import time
from collections import Counter, deque

from ..engine import kv_summary

WINDOW_S = 10.0  # tokens/s is measured over this many recent seconds
REASONS = ("abort", "eos", "length", "stop")  # always rendered (0 until one happens), as Prometheus advises for known labels


class EngineMetrics:
    """Counted on the engine thread; read (ints, a deque) from the HTTP thread."""

    def __init__(self):
        self.requests = 0
        self.prompt_tokens = 0
        self.generated = 0
        self.decode_steps = 0
        self.peak_rows = 0  # most rows in one decode step
        self.finish = Counter()
        self.recent: deque[tuple[float, int]] = deque()

    def added(self, prompt_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens

    def stepped(self, engine, events) -> None:
        for entry in engine.trace:
            if entry[0] == "decode":
                self.decode_steps += 1
                self.peak_rows = max(self.peak_rows, len(entry[1]))
        n = sum(1 for e in events if e.token is not None)
        self.generated += n
        now = time.monotonic()
        self.recent.append((now, n))
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()

    def finished(self, completion) -> None:
        self.finish[completion.finish_reason or "unknown"] += 1

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        return sum(n for t, n in list(self.recent) if t >= now - WINDOW_S) / WINDOW_S


def snapshot(engine) -> dict:
    """Gauges read on the engine thread (the caches are its arrays)."""
    sch, prefix = engine.scheduler, engine.prefix
    caches = [c for c in (engine.caches or [])]
    if sch.admitting is not None and sch.admitting.caches:
        caches += list(sch.admitting.caches)
    return {"running": len(sch.running), "prefilling": int(sch.admitting is not None), "waiting": len(sch.waiting),
            "kv_bytes": kv_summary(caches)["kv_bytes"] if caches else 0, "kv_reserved_bytes": sch.reserved,
            "kv_bytes_peak": (engine.peak_kv or {}).get("kv_bytes", 0),
            "kv_budget_bytes": sch.kv_budget or 0, "batch_size": sch.batch_size,
            "prefix": None if prefix is None else {"entries": len(prefix.entries), "bytes": prefix.nbytes,
                                                   "capacity": prefix.capacity, "hits": prefix.hits,
                                                   "lookups": prefix.lookups, "reused": prefix.reused_tokens,
                                                   "disk": _disk(prefix)}}


def _disk(prefix) -> dict | None:
    d = prefix.disk
    return None if d is None else {"files": len(d.index), "bytes": d.nbytes, "capacity": d.capacity,
                                   "hits": prefix.disk_hits, "writes": d.writes, "evictions": d.evictions,
                                   "errors": d.errors}


def render(m: EngineMetrics, gauges: dict, http: Counter, in_flight: int) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]):
        lines.append(f"# HELP mlxkv_{name} {help_}")
        lines.append(f"# TYPE mlxkv_{name} {kind}")
        for labels, value in samples:
            lines.append(f"mlxkv_{name}{labels} {value}")

    metric("running_rows", "gauge", "Rows decoding in the running batch.", [("", gauges["running"])])
    metric("prefilling_rows", "gauge", "Rows being prefilled before they join.", [("", gauges["prefilling"])])
    metric("waiting_rows", "gauge", "Rows queued for admission.", [("", gauges["waiting"])])
    metric("batch_size", "gauge", "Most rows decoding together (--batch-size).", [("", gauges["batch_size"])])
    metric("running_rows_peak", "gauge", "Most rows in one decode step since start.", [("", m.peak_rows)])
    metric("requests_in_flight", "gauge", "HTTP generation requests accepted and not yet answered.",
           [("", in_flight)])
    metric("kv_bytes", "gauge", "KV bytes the running caches hold.", [("", gauges["kv_bytes"])])
    metric("kv_bytes_peak", "gauge", "Most KV bytes the running caches held (read as rows leave) since start.",
           [("", gauges["kv_bytes_peak"])])
    metric("kv_reserved_bytes", "gauge", "KV bytes admission reserved for the admitted rows at their final sizes.",
           [("", gauges["kv_reserved_bytes"])])
    metric("kv_budget_bytes", "gauge", "KV budget for admitting rows (--max-kv-bytes).",
           [("", gauges["kv_budget_bytes"])])
    metric("generation_tokens_per_second", "gauge", f"Tokens generated per second over the last {WINDOW_S:g} s.",
           [("", round(m.tokens_per_s(), 3))])
    metric("generated_tokens_total", "counter", "Tokens generated.", [("", m.generated)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", m.prompt_tokens)])
    metric("decode_steps_total", "counter", "Decode steps run.", [("", m.decode_steps)])
    metric("requests_total", "counter", "Requests handed to the engine.", [("", m.requests)])
    metric("requests_finished_total", "counter", "Requests finished, by reason.",
           [(f'{{reason="{r}"}}', n) for r, n in sorted({**dict.fromkeys(REASONS, 0), **m.finish}.items())])
    metric("http_refused_total", "counter", "Requests refused, by HTTP status.",
           [(f'{{status="{s}"}}', n) for s, n in sorted(http.items())] or [('{status="429"}', 0)])
    p = gauges.get("prefix")
    if p is not None:
        metric("prefix_cache_entries", "gauge", "Prompts held by the prefix cache.", [("", p["entries"])])
        metric("prefix_cache_bytes", "gauge", "Bytes the prefix cache holds.", [("", p["bytes"])])
        metric("prefix_cache_capacity_bytes", "gauge", "The prefix cache's bound (--prefix-cache-bytes).",
               [("", p["capacity"])])
        metric("prefix_cache_lookups_total", "counter", "Admitted rows looked up in the prefix cache.",
               [("", p["lookups"])])
        metric("prefix_cache_hits_total", "counter", "Rows that started from cached prompt tokens.", [("", p["hits"])])
        metric("prefix_cache_reused_tokens_total", "counter", "Prompt tokens not prefilled thanks to the cache.",
               [("", p["reused"])])
    d = (p or {}).get("disk")
    if d is not None:
        for key, kind, text in (("files", "gauge", "Prompt cache files in --prefix-cache-dir (this server's)."),
                                ("bytes", "gauge", "Bytes of those files."),
                                ("capacity", "gauge", "Their bound (--prefix-cache-dir-bytes)."),
                                ("hits", "counter", "Rows that started from a prompt read back from disk."),
                                ("writes", "counter", "Prompts written to disk (evicted from RAM, or at a stop)."),
                                ("evictions", "counter", "Files removed to stay within the bound."),
                                ("errors", "counter", "Files that could not be written or read back (misses).")):
            name = "prefix_cache_disk_" + ("capacity_bytes" if key == "capacity" else key)
            metric(name + ("_total" if kind == "counter" else ""), kind, text, [("", d[key])])
    return "\n".join(lines) + "\n"
