"""Group advantages, golden values derived by hand."""

import pytest

from astratk.dataflow.advantages import dr_grpo, get_advantage, grpo, rloo


def test_dr_grpo_centres_without_scaling():
    # rewards (1, 0, 0, 1): mean 0.5 -> (0.5, -0.5, -0.5, 0.5)
    assert dr_grpo([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]


def test_grpo_divides_by_population_std():
    # rewards (1, 0, 0, 0): mean 0.25, population std sqrt(0.75 * 0.25) = sqrt(3)/4 ~ 0.4330127
    # (1 - 0.25) / (0.4330127 + 1e-6) = 1.7320469..., (0 - 0.25) / (...) = -0.5773490...
    a = grpo([1.0, 0.0, 0.0, 0.0])
    assert a[0] == pytest.approx(0.75 / (3 ** 0.5 / 4 + 1e-6), rel=1e-12)
    assert a[1] == pytest.approx(-0.25 / (3 ** 0.5 / 4 + 1e-6), rel=1e-12)
    assert grpo([2.0, 2.0]) == [0.0, 0.0]  # zero variance: 0, not NaN


def test_rloo_leave_one_out():
    # rewards (1, 0, 0): baseline of sample 0 = mean(0, 0) = 0 -> 1; of sample 1 = mean(1, 0) = 0.5 -> -0.5
    assert rloo([1.0, 0.0, 0.0]) == [1.0, -0.5, -0.5]
    assert rloo([3.0]) == [0.0]  # a single sample has no baseline


def test_unknown_advantage_lists_choices():
    with pytest.raises(ValueError, match=r"choose one of \['dr_grpo', 'grpo', 'rloo'\]"):
        get_advantage("ppo")


def test_an_advantage_by_dotted_path_and_a_non_function_refused():
    """Advantages are registry plug-ins: a short name or the dotted path of any function rewards -> advantages."""
    assert get_advantage("astratk.dataflow.advantages.rloo") is rloo
    with pytest.raises(ValueError, match="is a dict, not a function"):
        get_advantage("astratk.registry.REGISTRY")
    with pytest.raises(ValueError, match="cannot import module 'nopkg'"):
        get_advantage("nopkg.centred")
