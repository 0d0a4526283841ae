"""bench/pass_at_k.py's estimator against brute force: the chance that k of n samples drawn without replacement hold
at least one of the c right ones."""

import itertools

import pytest

from tests._bench import bench_module


@pytest.fixture(scope="module")
def pass_at_k():
    return bench_module("pass_at_k").pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_matches_enumerating_every_subset(pass_at_k, n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            want = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_more_samples_than_drawn_is_an_error(pass_at_k):
    with pytest.raises(ValueError, match="at least 8 samples"):
        pass_at_k(4, 1, 8)
