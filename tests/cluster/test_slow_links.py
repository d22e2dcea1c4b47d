"""A slow link between nodes (slow): with each node's cable limited by a token bucket (tbf, both
directions), `ndtrain calibrate --links` across 2 nodes x 2 ranks records the link between the
nodes apart from the one inside a node. The mechanism, not a speed: the link between nodes comes
out slower than the one inside, and no faster than the rate set (a token bucket lets a burst
through, and the fit is over a few sizes: RATE_SLACK); the planner then prices a group that
crosses the nodes on it. Timing figures: benchmarks/slow_links.py."""

from __future__ import annotations

import json

import link_calibration
import pytest

from ndtrain.planner.comm import collective_time
from ndtrain.planner.hardware import from_profile

MBIT = 100
# The measured bandwidth may exceed the token rate only by what one burst (harness: ~4 ms of
# traffic) adds to the smallest timed message that is rate-bound, and by the fit's scatter.
RATE_SLACK = 1.2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_calibrate_measures_the_rate_limited_link_apart_from_the_node(make_cluster, guard):
    cluster = make_cluster(2)
    for node in cluster.nodes:
        node.rate_limit(MBIT)
    profile = cluster.shared / "hardware.json"
    base = {"description": "one node's part, not measured here", "collectives": {}}
    profile.write_text(json.dumps(base))
    codes, started = link_calibration.calibrate_links(cluster, 2, profile, guard(120))
    assert codes == {"node1": 0, "node2": 0}, started.all_logs()
    links = link_calibration.links_section(profile)
    assert links["ranks_per_node"] == 2, links
    rate = MBIT * 1e6 / 8  # bytes/s
    inter, intra = links["inter"]["beta"], links["intra"]["beta"]
    assert inter < intra, links
    assert inter <= rate * RATE_SLACK, f"{inter * 8 / 1e6:.1f} Mbit/s measured through a {MBIT} Mbit/s limit"
    hw = from_profile(json.loads(profile.read_text()))
    n = 4 << 20
    # 2 nodes x 2 ranks: a pair inside node1 against a pair with one rank on each node
    assert collective_time(hw, "all_reduce", 2, 2, n) > collective_time(hw, "all_reduce", 2, 1, n)
