"""The front's /metrics page: its own per-replica and total families, and replica pages re-exposed with a label."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from leanlm.fleet.front_metrics import FrontMetrics, render
from leanlm.fleet.replicas import Replica

PAGE = """# HELP leanlm_request_success_total Finished sequences by finish reason.
# TYPE leanlm_request_success_total counter
leanlm_request_success_total{finished_reason="stop",model_name="m"} 3.0
# HELP leanlm_kv_cache_usage_perc Fraction of KV-cache blocks held by requests (1 = full).
# TYPE leanlm_kv_cache_usage_perc gauge
leanlm_kv_cache_usage_perc{model_name="m"} 0.25
"""


A, B = "http://a:8000", "http://b:8000"  # already in their redacted form (scheme://host:port)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_page_has_front_counters_and_relabelled_replica_families():
    a = Replica(A, is_healthy=True, num_routed=5, num_in_flight=1, num_prefix_hits=3)
    b = Replica(B, num_routed=2, num_failed=1)
    page = samples(render(FrontMetrics([a, b]), {A: PAGE, B: PAGE.replace("3.0", "4.0")}))
    assert page[("leanlm_router_requests_routed_total", (("replica", A),))] == 5
    assert page[("leanlm_router_all_requests_routed_total", ())] == 7
    assert page[("leanlm_router_all_requests_in_flight", ())] == 1
    assert page[("leanlm_router_request_failures_total", (("replica", B),))] == 1
    assert page[("leanlm_router_all_prefix_hits_total", ())] == 3
    assert page[("leanlm_router_replica_healthy", (("replica", B),))] == 0
    stop = (("finished_reason", "stop"), ("model_name", "m"))
    assert page[("leanlm_request_success_total", (*stop, ("replica", A)))] == 3
    assert page[("leanlm_request_success_total", (*stop, ("replica", B)))] == 4
    assert page[("leanlm_kv_cache_usage_perc", (("model_name", "m"), ("replica", B)))] == 0.25
