"""The profile's inter-node link (planner/links.py): read into the this-machine entry, priced by
planner/comm.py for groups that cross nodes; old profiles load unchanged; bad sections refused."""

from __future__ import annotations

import pytest

from ndtrain.errors import NdtrainError
from ndtrain.planner import links
from ndtrain.planner.comm import collective_time
from ndtrain.planner.hardware import from_profile

FIT = {"alpha": 1e-4, "beta": 1e9}
BASE = {"devices_per_node": 8, "collectives": {k: dict(FIT) for k in ("all_reduce", "all_gather", "p2p")}}


def test_old_profile_loads_unchanged():
    hw = from_profile(BASE)
    assert hw.gpus_per_node == 8 and hw.alpha_inter == FIT["alpha"]


def test_inter_node_link_prices_groups_that_cross_nodes():
    slow = {"alpha": 2e-4, "beta": 12.5e6}  # 100 Mbit/s
    hw = from_profile({**BASE, links.KEY: links.section(2, FIT, slow)})
    assert hw.gpus_per_node == 2 and hw.alpha_inter == slow["alpha"]
    assert hw.inter_bw == pytest.approx(slow["beta"] / 2)  # the node's two ranks share its link
    n = 8e6
    inside = collective_time(hw, "all_reduce", 2, 1, n)
    across = collective_time(hw, "all_reduce", 2, 2, n)  # one rank on each node
    # one rank per node: a ring all-reduce of 2 moves n once each way at the rank's share of the link
    assert across == pytest.approx(2 * slow["alpha"] + n / (slow["beta"] / 2))
    assert across > 10 * inside


@pytest.mark.parametrize("bad", [{"ranks_per_node": 0, "inter": FIT}, {"ranks_per_node": 2},
                                 {"ranks_per_node": 2, "inter": {"alpha": 1e-4, "beta": 0}}])
def test_bad_links_section_is_refused_in_one_line(bad):
    with pytest.raises(NdtrainError) as err:
        from_profile({**BASE, links.KEY: bad})
    assert "\n" not in str(err.value) and links.KEY in str(err.value)


def test_a_collective_measured_across_nodes_is_priced_on_its_own_fit():
    slow = {"alpha": 2e-4, "beta": 12.5e6}
    gather = {"alpha": 1e-3, "beta": 8e6}  # Gloo's all-gather reached less than one message does
    hw = from_profile({**BASE, links.KEY: links.section(1, None, slow, {"all_gather": gather})})
    n = 8e6
    assert collective_time(hw, "all_gather", 2, 1, n) == pytest.approx(gather["alpha"] + n / 2 / gather["beta"])
    # kinds not measured keep the link's own fit
    assert collective_time(hw, "all_reduce", 2, 1, n) == pytest.approx(2 * slow["alpha"] + n / slow["beta"])


@pytest.mark.parametrize("colls", [{"all_to_all_x": FIT}, {"all_gather": {"alpha": 1e-4}}, ["all_gather"]])
def test_bad_collectives_in_the_links_section_are_refused_in_one_line(colls):
    with pytest.raises(NdtrainError) as err:
        from_profile({**BASE, links.KEY: {"ranks_per_node": 1, "inter": FIT, "collectives": colls}})
    assert "\n" not in str(err.value) and "collectives" in str(err.value)
