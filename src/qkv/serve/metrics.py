"""``GET /metrics``: what ``qkv serve`` is doing, in Prometheus' text format
(prometheus-client, one registry per app).

| metric | kind | what |
|---|---|---|
| ``qkv_requests_running`` | gauge | requests in the decoding batch now |
| ``qkv_requests_waiting`` | gauge | requests queued for room, or having their prompt read |
| ``qkv_cache_blocks_used`` / ``qkv_cache_blocks`` | gauge | KV cache blocks held / in the pool |
| ``qkv_prefix_cache_blocks`` | gauge | blocks no request holds, kept for their prefix |
| ``qkv_prefix_cache_hit_tokens`` | gauge | prompt positions read from shared blocks, in all |
| ``qkv_prefix_cache_queried_tokens`` | gauge | prompt positions of every request, in all |
| ``qkv_requests_total{finish_reason}`` | counter | choices ended: stop, length, cancelled, error |
| ``qkv_requests_refused_total{status}`` | counter | requests refused with an error status |
| ``qkv_prompt_tokens_total`` / ``qkv_generation_tokens_total`` | counter | tokens in / out |
| ``qkv_time_to_first_token_seconds`` | histogram | from the request's arrival to its first token |
| ``qkv_inter_token_latency_seconds`` | histogram | between two tokens of one choice |
| ``qkv_request_duration_seconds`` | histogram | from arrival to the last token |

Gauges are read from the engine when scraped; the rest is recorded as each answer ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import prometheus_client as prom

__all__ = ["ServeMetrics"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServeMetrics:
    """The server's metrics over one engine.

    Args:
        engine: a :class:`~qkv.generate.batching.BatchingEngine` (its ``running``,
            ``waiting`` and ``cache`` are read when scraped).
    """

    def __init__(self, engine: Any) -> None:
        r = self.registry = prom.CollectorRegistry()
        blocks = engine.blocks
        for name, what, read in (
            ("qkv_requests_running", "requests in the decoding batch", lambda: len(engine.running)),
            ("qkv_requests_waiting", "requests queued for room",
             lambda: len(engine.waiting) + (engine.prefilling is not None)),
            ("qkv_cache_blocks_used", "KV cache blocks held by requests", lambda: blocks.held),
            ("qkv_prefix_cache_blocks", "blocks kept for their prefix, held by none",
             lambda: len(blocks.idle)),
            ("qkv_cache_blocks", "KV cache blocks in the pool", lambda: engine.cache.num_blocks),
            ("qkv_prefix_cache_hit_tokens", "prompt positions read from shared blocks, in all",
             lambda: blocks.hit_tokens),
            ("qkv_prefix_cache_queried_tokens", "prompt positions of all requests",
             lambda: blocks.queried_tokens),
        ):  # fmt: skip
            prom.Gauge(name, what, registry=r).set_function(read)
        self.finished = prom.Counter("qkv_requests", "choices ended, by finish reason",
                                     ["finish_reason"], registry=r)  # fmt: skip
        self.refused_ = prom.Counter("qkv_requests_refused", "requests refused, by status",
                                     ["status"], registry=r)  # fmt: skip
        self.prompt_tokens = prom.Counter("qkv_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = prom.Counter("qkv_generation_tokens", "new tokens", registry=r)
        self.ttft = prom.Histogram("qkv_time_to_first_token_seconds", "arrival to first token",
                                   buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = prom.Histogram("qkv_inter_token_latency_seconds", "between two tokens",
                                  buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.duration = prom.Histogram("qkv_request_duration_seconds", "arrival to last token",
                                       buckets=DURATION_BUCKETS, registry=r)  # fmt: skip

    def answered(self, arrived: float, prompt_tokens: int, choices: Sequence[Any]) -> None:
        """Record one answer: ``arrived`` (``time.monotonic()`` at its arrival), its prompt's
        length, its :class:`~qkv.serve.flow.Choice` objects (their token times and ends)."""
        self.prompt_tokens.inc(prompt_tokens)
        times = sorted(t for c in choices for t in c.times)
        if times:
            self.ttft.observe(times[0] - arrived)
            self.duration.observe(times[-1] - arrived)
        for c in choices:
            self.generation_tokens.inc(len(c.times))
            self.finished.labels(c.reason or "cancelled").inc()
            for before, after in zip(c.times, c.times[1:], strict=False):
                self.itl.observe(after - before)

    def refused(self, status: int) -> None:
        self.refused_.labels(str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The metrics' text and its content type."""
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
