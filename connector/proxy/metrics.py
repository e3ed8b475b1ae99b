"""The proxy's Prometheus metrics (``GET /metrics``): per server, what it was sent and how that
went, whether it is marked down now, and what is in flight there -- read from the pools
(``routing.Pool``) at each scrape, so they never disagree with ``/health`` -- and the requests
refused by each of the guards' limits (``guards.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from connector.proxy.guards import Limit
from connector.proxy.routing import Pool

# what a request sent to a server came to: answered (a status and headers came back, passed on
# as they are; a stream breaking later is not counted again), unreachable (refused or not
# accepted in time: the server is marked down), failed (timed out, or the connection broke
# before an answer)
OUTCOMES = ("answered", "unreachable", "failed")


class ProxyMetrics:
    def __init__(self, pools: Iterable[Pool]) -> None:
        self._pools = [p for p in pools if p.urls]
        self.sent: Counter[tuple[str, str, str]] = Counter()  # (role, server, outcome)
        self.marked_down: Counter[tuple[str, str]] = Counter()  # (role, server)
        self.refused: Counter[Limit] = Counter()  # requests refused, by the limit they passed
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def count(self, role: str, server: str, outcome: str) -> None:
        self.sent[(role, server, outcome)] += 1

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: ProxyMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Any]:
        labels = ["role", "server"]
        sent = CounterMetricFamily(
            "vllm_redis_proxy_requests",
            "Requests sent to each server, by outcome (answered, unreachable, failed)",
            labels=[*labels, "outcome"],
        )
        for (role, server, outcome), n in sorted(self.m.sent.items()):
            sent.add_metric([role, server, outcome], n)
        down = GaugeMetricFamily(
            "vllm_redis_proxy_server_down",
            "1 while the proxy sends the server nothing (it refused or did not accept a "
            "connection in time; probed until it answers)",
            labels=labels,
        )
        marked = CounterMetricFamily(
            "vllm_redis_proxy_marked_down",
            "Times the server was marked down",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "vllm_redis_proxy_in_flight", "Requests the server is answering now", labels=labels
        )
        for pool in self.m._pools:
            for url in pool.urls:
                down.add_metric([pool.role, url], 1.0 if url in pool.down else 0.0)
                marked.add_metric([pool.role, url], self.m.marked_down[(pool.role, url)])
                in_flight.add_metric([pool.role, url], pool.in_flight.get(url, 0))
        refused = CounterMetricFamily(
            "vllm_redis_proxy_refused",
            "Requests refused by a limit on what clients may make the proxy hold (by the "
            "limit: max_body_bytes, max_in_flight_body_bytes, max_concurrent_requests, "
            "body_read_timeout_s, max_json_containers, max_json_depth)",
            labels=["limit"],
        )
        for limit in Limit:  # every limit, 0 included: a series from the first scrape
            refused.add_metric([limit.label], self.m.refused[limit])
        yield from (sent, down, marked, in_flight, refused)
