"""Prometheus metrics of one worker (`GET /metrics` on the worker server).

prometheus_client is the client library vLLM itself serves its metrics with, so a
worker and a vLLM server are scraped the same way. Each `WorkerMetrics` keeps its
own registry: two servers in one process (tests, a host running several) never
share or clash over counters.

    asyncwt_worker_rounds_total                     rounds published
    asyncwt_worker_round_failures_total{stage}      rounds (or inits) that failed, by the
                                                    call that failed: init, start, update,
                                                    finish
    asyncwt_worker_received_bytes_total             payload bytes of the rounds published
    asyncwt_worker_apply_seconds                    histogram: start_weight_update to the
                                                    publish (receive and apply)
    asyncwt_worker_weight_version_info{version}     the version published last
    asyncwt_worker_last_publish_timestamp_seconds   when it was published (Unix time)
    asyncwt_worker_trainer_connects_total           inits (a trainer connecting)
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

__all__ = ["CONTENT_TYPE", "WorkerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The content type of `WorkerMetrics.exposition` (Prometheus text format)."""

_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""Rounds last from milliseconds (a small model on one host) to minutes (70B over TCP)."""


class WorkerMetrics:
    """The counters a `RoundDriver` updates, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.rounds = Counter("asyncwt_worker_rounds", "Rounds published.", registry=registry)
        self.failures = Counter(
            "asyncwt_worker_round_failures",
            "Rounds or inits that failed, by the call that failed.",
            ["stage"],
            registry=registry,
        )
        self.bytes = Counter(
            "asyncwt_worker_received_bytes",
            "Payload bytes of the rounds published.",
            registry=registry,
        )
        self.apply_seconds = Histogram(
            "asyncwt_worker_apply_seconds",
            "Seconds from start_weight_update to the publish of a round.",
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.version = Info(
            "asyncwt_worker_weight_version", "The weight version published last.", registry=registry
        )
        self.published_at = Gauge(
            "asyncwt_worker_last_publish_timestamp_seconds",
            "Unix time of the last publish.",
            registry=registry,
        )
        self.connects = Counter(
            "asyncwt_worker_trainer_connects",
            "Inits of the transfer engine (a trainer connecting).",
            registry=registry,
        )

    def connected(self) -> None:
        """A trainer initialised the transfer engine."""
        self.connects.inc()

    def published(self, version: str | None, nbytes: int | None, seconds: float) -> None:
        """A round completed and `version` is now the worker's."""
        self.rounds.inc()
        if nbytes is not None:
            self.bytes.inc(nbytes)
        self.apply_seconds.observe(seconds)
        self.version.info({"version": "" if version is None else version})
        self.published_at.set(time.time())

    def failed(self, stage: str) -> None:
        """The `stage` call (init, start, update, finish) failed."""
        self.failures.labels(stage=stage).inc()

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
