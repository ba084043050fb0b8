"""Region routing (service/region_routing.py): local first; a failed peer is detected within the stated bound
(failed probes, or probes that hang); one that comes back takes traffic only after answering every probe for
recover_after_s (no flapping); the best peer by round trip and load; a forwarded request is never forwarded again."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.service.region_routing import Health, Local, RegionPolicy, RegionRouter

POLICY = RegionPolicy(probe_period_s=0.5, probe_timeout_s=1.0, fail_after=3, stale_after_s=3.0, recover_after_s=10.0)


def router() -> RegionRouter:
    r = RegionRouter("us", ["eu", "ap"], POLICY)
    r.probe_ok("eu", 0.0, rtt_ms=80)
    r.probe_ok("ap", 0.0, rtt_ms=150)
    return r


def test_local_first_then_the_nearest_healthy_peer_weighed_by_load():
    r = router()
    assert r.choose(Local()).region == "us"
    for bad in (Local(healthy=False), Local(draining=True), Local(over_bounds=True)):
        assert r.choose(bad).region == "eu" and r.choose(bad).reason == "failover"
    r.probe_ok("eu", 0.5, rtt_ms=80, load=0.5)  # 80 + 100 > 150
    assert r.choose(Local(over_bounds=True)).region == "ap"
    r.probe_ok("ap", 0.5, rtt_ms=150, load=1.0)  # at its bounds: takes no forwards
    assert r.choose(Local(over_bounds=True)).region == "eu"
    r.probe_ok("eu", 1.0, rtt_ms=80, draining=True)
    d = r.choose(Local(over_bounds=True))
    assert (d.region, d.reason) == ("us", "local_fallback")  # queued or refused by its own admission
    assert r.choose(Local(healthy=False)).region is None


def test_a_forwarded_request_is_never_forwarded_again():
    r = router()
    d = r.choose(Local(over_bounds=True), forwarded=True)
    assert (d.region, d.reason) == ("us", "forwarded_here")
    assert r.choose(Local(healthy=False), forwarded=True).region is None


def test_a_dead_peer_is_detected_within_the_bound_by_failed_probes_or_by_silence():
    r = router()
    t, down_at = 0.0, None
    while down_at is None:  # the peer died just after t=0: every probe fails after its timeout
        t += POLICY.probe_period_s
        r.probe_failed("eu", t + POLICY.probe_timeout_s)
        if r.peers["eu"].health is Health.DOWN:
            down_at = t + POLICY.probe_timeout_s
    assert down_at <= POLICY.detection_bound_s < 5.0
    assert r.peers["eu"].changed_at == down_at  # what /v1/region/status dates the change by (peers_for_s)
    # ap's probes hang: no answer at all; time alone makes it DOWN
    r.tick(POLICY.stale_after_s - 0.01)
    assert r.peers["ap"].health is Health.UP
    r.tick(POLICY.stale_after_s)
    assert r.peers["ap"].health is Health.DOWN and r.peers["ap"].changed_at == POLICY.stale_after_s
    assert r.choose(Local(healthy=False)).region is None


def test_a_recovered_peer_takes_traffic_only_after_answering_every_probe_for_a_while():
    r = router()
    for t in (0.5, 1.0, 1.5):
        r.probe_failed("eu", t)
    r.probe_failed("ap", 1.5)
    r.probe_failed("ap", 1.6)
    r.probe_failed("ap", 1.7)
    t = 2.0
    for _ in range(10):  # flapping: answers, fails, answers... never UP
        r.probe_ok("eu", t, rtt_ms=80)
        r.probe_failed("eu", t + 0.5)
        t += 1.0
    assert r.peers["eu"].health is Health.DOWN and r.choose(Local(healthy=False)).region is None
    start = t
    while r.peers["eu"].health is not Health.UP:
        r.probe_ok("eu", t, rtt_ms=80)
        assert r.choose(Local(healthy=False)).region is None or r.peers["eu"].health is Health.UP
        t += POLICY.probe_period_s
    assert t - POLICY.probe_period_s - start == pytest.approx(POLICY.recover_after_s)
    assert r.choose(Local(healthy=False)).region == "eu"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=200))
def test_after_any_failure_a_peer_turns_up_only_once_every_probe_of_recover_after_s_answered(probes):
    r = RegionRouter("us", ["eu"], POLICY)
    history: list[tuple[float, bool]] = []
    for i, ok in enumerate(probes):
        now = i * POLICY.probe_period_s
        history.append((now, ok))
        before = r.peers["eu"].health
        if ok:
            r.probe_ok("eu", now, rtt_ms=50)
        else:
            r.probe_failed("eu", now)
        if r.peers["eu"].health is Health.UP and before is not Health.UP and not all(x for _, x in history):
            assert all(x for t, x in history if t >= now - POLICY.recover_after_s), history[-25:]
            assert now - max(t for t, x in history if not x) > POLICY.recover_after_s - POLICY.probe_period_s


def test_policy_is_validated():
    with pytest.raises(ValueError):
        RegionPolicy(fail_after=0)
    with pytest.raises(ValueError):
        RegionRouter("us", ["us"])



def test_the_regions_table_is_read_and_validated():
    from kvserve.config import ConfigError, RegionsConfig

    c = RegionsConfig.from_table({"local": "us", "ledger": "eu", "peers": [{"name": "eu", "url": "http://eu:8000"}],
                                  "policy": {"probe_period_s": 0.25}, "escrow": {"floor_fraction": 0.2}})
    assert c.enabled and c.names == ["us", "eu"] and c.policy.probe_period_s == 0.25
    assert c.escrow.floor_fraction == 0.2 and c.escrow.release_period_s == 5.0
    for bad in ({"ledger": "mars"}, {"escrow": {"floor_fraction": 2}}, {"escrow": {"release_period_s": 0}},
                {"peers": [{"name": "eu", "url": "http://eu"}, {"name": "eu", "url": "http://eu2"}]}):
        with pytest.raises(ConfigError):
            RegionsConfig.from_table({"local": "us", "peers": [{"name": "eu", "url": "http://eu:8000"}], **bad})


def test_one_file_lists_every_region_and_each_server_picks_its_own(tmp_path):
    from kvserve.config import ConfigError, ServerConfig

    path = tmp_path / "regions.toml"
    path.write_text('[regions]\nledger = "us"\npeers = [{name = "us", url = "http://us:8000"}, '
                    '{name = "eu", url = "http://eu:8000", ray_address = "eu-head:6379"}, '
                    '{name = "ap", url = "http://ap:8000"}]\n')
    eu = ServerConfig.from_toml(str(path), region="eu").regions
    assert eu.local == "eu" and [p.name for p in eu.peers] == ["us", "ap"] and eu.ledger == "us"
    assert eu.ray_address == "eu-head:6379" and ServerConfig.from_toml(str(path), region="us").regions.ray_address == ""
    with pytest.raises(ConfigError, match="--region mars"):
        ServerConfig.from_toml(str(path), region="mars")
    with pytest.raises(ConfigError, match="needs `local`"):
        ServerConfig.from_toml(str(path))
