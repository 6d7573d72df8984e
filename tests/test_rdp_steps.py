"""The RDP accountant's per-step cache (dptrain.accounting.rdp_steps) gives dp_accounting's RdpAccountant's epsilon
bit for bit: Poisson-sampled and unsampled Gaussian steps, several entries and counts, both adjacencies, and the
events it leaves to dp_accounting (a fixed-size sample under replace-one)."""

import dp_accounting as dpa
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from dptrain.accounting.rdp_steps import RdpStepsAccountant, poisson_gaussian_rdp
from dptrain.accounting.standard import RDP_ORDERS

ADD, REPLACE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, dpa.NeighboringRelation.REPLACE_ONE
EVENTS = [
    (dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 300), ADD),
    (dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(0.8)), 7),
                          dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 5),
                          dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(3.0), 2)]), ADD),
    (dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(2.0), 4), REPLACE),
    (dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(1000, 10, dpa.GaussianDpEvent(1.0)), 20), REPLACE),
]


@pytest.mark.parametrize("event, relation", EVENTS)
def test_the_cached_steps_give_dp_accountings_epsilon_bit_for_bit(event, relation):
    orders = [a for a in RDP_ORDERS if a <= 64]
    for _ in range(2):  # (the second time from the cache)
        ours = RdpStepsAccountant(orders, neighboring_relation=relation).compose(event)
        theirs = rdp_privacy_accountant.RdpAccountant(orders, neighboring_relation=relation).compose(event)
        assert ours.get_epsilon_and_optimal_order(1e-5) == theirs.get_epsilon_and_optimal_order(1e-5)


def test_a_cached_step_cannot_be_changed_in_place():
    rdp = poisson_gaussian_rdp(0.01, 1.1, (2.0, 4.0))
    with pytest.raises(ValueError):
        rdp += 1.0
