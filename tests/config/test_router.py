"""RouterConfig: when serve is a front, the replica list, and refusals that say what to do."""

from __future__ import annotations

import pytest

from leanlm.config import RouterConfig


def test_defaults_are_the_single_process_server():
    assert not RouterConfig().is_routed
    assert RouterConfig(data_parallel_size=2).is_routed
    config = RouterConfig(replicas=" http://a:8000/, https://b:9000 ,")
    assert config.is_routed and config.replica_urls == ("http://a:8000", "https://b:9000")
    assert RouterConfig(data_parallel_size=0, replicas="http://a:1").is_routed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"data_parallel_size": -1}, "data_parallel_size must be >= 0"),
        ({"data_parallel_size": 0}, "name remote ones with --replicas"),
        ({"replicas": "a:8000"}, "must start with http:// or https://"),
        ({"router_policy": "random"}, "router_policy must be one of cache_aware, round_robin, least_load"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold must be >= 0"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold must be >= 1"),
        ({"router_prefix_blocks": 0}, "router_prefix_blocks must be >= 1"),
        ({"router_cache_entries": 0}, "router_cache_entries must be >= 1"),
        ({"health_check_interval_s": 0}, "health_check_interval_s must be > 0"),
        ({"replica_start_timeout_s": 0}, "replica_start_timeout_s must be > 0"),
        ({"replica_api_key": " "}, "replica_api_key is empty"),
        ({"health_check_timeout_s": 0}, "health_check_timeout_s must be > 0 and finite"),
        ({"replica_read_timeout_s": float("inf")}, "replica_read_timeout_s must be > 0 and finite"),
        ({"replica_read_timeout_s": float("nan")}, "replica_read_timeout_s must be > 0 and finite"),
    ],
)
def test_bad_values_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**options)
