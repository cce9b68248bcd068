"""The quality gate both calibrations share (zeroedge.export.gate), on a synthetic model of cost:
the measured perplexity rise is the sum of the chosen settings' true costs, so the best allocation
within the budget is known by brute force."""
import itertools
import random

import pytest

from zeroedge.export import gate


def _problem(seed, layers=4, settings=4):
    rnd = random.Random(seed)
    gain = sorted(rnd.uniform(0.1, 1.0) for _ in range(settings))
    cost = {i: sorted(rnd.uniform(0, 0.05) for _ in range(settings)) for i in range(layers)}
    return cost, gain


def _measure(cost, gain):
    def measure(chosen):
        rise = sum(cost[i][k] for i, k in chosen.items() if k is not None)
        got = sum(gain[k] for k in chosen.values() if k is not None)
        return 1.0 + rise, got, dict(chosen)
    return measure


@pytest.mark.parametrize("seed", range(6))
def test_search_finds_the_best_allocation_among_its_candidates(seed):
    cost, gain = _problem(seed)
    measure, limit = _measure(cost, gain), 1.04
    chosen, ppl, res = gate.search(cost, gain, measure, limit, steps=32, include_zero=True)
    assert ppl <= limit and res == chosen
    # every allocation the one-knob rule can give, checked by brute force: none within the limit
    # gains more than the chosen one (the bisection assumes cost grows with the scale, as here)
    best = max(measure(gate.allocation(cost, gain, s))[1]
               for s in gate.candidate_scales(cost, gain, True)
               if measure(gate.allocation(cost, gain, s))[0] <= limit)
    assert measure(chosen)[1] == pytest.approx(best)


def test_allocation_is_deeper_at_larger_scales_and_keeps_fixed_layers():
    cost, gain = _problem(1)
    prev = -1.0
    for s in gate.candidate_scales(cost, gain, True):
        got = sum(gain[k] for k in gate.allocation(cost, gain, s).values())
        assert got >= prev
        prev = got
    assert gate.allocation(cost, gain, 0.0, fixed={9: None})[9] is None


def test_mildest_over_budget_is_a_gate_error():
    cost = {0: [0.5, 0.6], 1: [0.7, 0.8]}
    with pytest.raises(gate.GateError) as e:
        gate.search(cost, [0.1, 0.2], _measure(cost, [0.1, 0.2]), 1.01, steps=8)
    assert e.value.ppl > 1.01


def test_search_logs_each_step_and_stops_within_steps():
    cost, gain = _problem(3, layers=6, settings=5)
    steps = []
    gate.search(cost, gain, _measure(cost, gain), 1.05, steps=3, log=lambda *a: steps.append(a))
    assert 1 <= len(steps) <= 3 and all(len(a) == 5 for a in steps)
    assert list(itertools.accumulate(1 for _ in steps)) == [a[0] for a in steps]
