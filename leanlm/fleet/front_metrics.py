"""The front's /metrics: its own counters per replica (label `replica`) and in total, then every replica's own
/metrics page, scraped at request time and re-exposed with a `replica` label (prometheus_client renders both). The
label is the replica's redacted name (scheme://host:port): a --replicas URL's credentials never show."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from leanlm.fleet.replicas import Replica

logger = logging.getLogger("leanlm.router")

SCRAPE_TIMEOUT_S = 2.0

# (name, help, kind, the Replica attribute it reads)
_PER_REPLICA = (
    ("leanlm_router_requests_routed", "Requests the front sent to the replica.", "counter", "num_routed"),
    ("leanlm_router_requests_in_flight", "Requests routed and not yet answered in full.", "gauge", "num_in_flight"),
    ("leanlm_router_request_failures", "Requests broken on the way to or from the replica.", "counter", "num_failed"),
    (
        "leanlm_router_prefix_hits",
        "Requests routed to a replica that held at least one of the prompt's leading KV blocks.",
        "counter",
        "num_prefix_hits",
    ),
)


class FrontMetrics(Collector):
    """The front's families, read from the replicas' counters at scrape time."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        for name, help_text, kind, attribute in _PER_REPLICA:
            family_of = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            per_replica = family_of(name, help_text, labels=["replica"])
            for replica in self.replicas:
                per_replica.add_metric([replica.name], getattr(replica, attribute))
            yield per_replica
            total = family_of(name.replace("router_", "router_all_", 1), help_text + " All replicas.")
            total.add_metric([], sum(getattr(r, attribute) for r in self.replicas))
            yield total
        healthy = GaugeMetricFamily(
            "leanlm_router_replica_healthy", "1 while the replica is in rotation.", labels=["replica"]
        )
        for replica in self.replicas:
            healthy.add_metric([replica.name], int(replica.is_healthy))
        yield healthy


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def relabel(pages: dict[str, str]) -> list[Metric]:
    """Replica name -> its /metrics text, merged into families whose samples carry `replica="name"` (one family per
    name: a page with a family twice would be invalid exposition)."""
    merged: dict[str, Metric] = {}
    for name, text in pages.items():
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:  # not a Prometheus page: left out rather than failing the front's own page
            logger.warning("replica %s's /metrics is not Prometheus text; left out", name)
            continue
        for family in families:
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                target.add_sample(sample.name, {**sample.labels, "replica": name}, sample.value, sample.timestamp)
    return list(merged.values())


async def scrape(session: aiohttp.ClientSession, replicas: list[Replica]) -> dict[str, str]:
    """The /metrics text of every replica in rotation that answers within SCRAPE_TIMEOUT_S, by its redacted name."""

    async def one(replica: Replica) -> str | None:
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        try:
            async with session.get(replica.url + "/metrics", headers=replica.headers, timeout=timeout) as response:
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    healthy = [r for r in replicas if r.is_healthy]
    texts = await asyncio.gather(*(one(r) for r in healthy))
    return {r.name: text for r, text in zip(healthy, texts, strict=True) if text is not None}


def render(front: FrontMetrics, pages: dict[str, str]) -> str:
    registry = CollectorRegistry()
    registry.register(_Families(relabel(pages)))
    return generate_latest(front.registry).decode() + generate_latest(registry).decode()
