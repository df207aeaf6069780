import pytest

from dapo_ray.algo import group_advantages, overlong_filter_mask, soft_overlong_penalty


def test_soft_overlong_eq13_paper_numbers():
    # L_max 20480, L_cache 4096: no penalty up to 16384, linear to -1 at 20480, -1 beyond.
    f = lambda n: soft_overlong_penalty(n, max_length=20480, cache_length=4096)  # noqa: E731
    assert f(100) == 0.0
    assert f(16384) == 0.0
    assert f(16385) == pytest.approx(-1 / 4096)
    assert f(18432) == pytest.approx(-0.5)
    assert f(20480) == pytest.approx(-1.0)
    assert f(30000) == -1.0


def test_soft_overlong_factor_and_bad_cache():
    assert soft_overlong_penalty(18432, 20480, 4096, penalty_factor=0.5) == pytest.approx(-0.25)
    with pytest.raises(ValueError):
        soft_overlong_penalty(10, 100, 0)
    with pytest.raises(ValueError):
        soft_overlong_penalty(10, 100, 200)


def test_overlong_filter_mask():
    assert overlong_filter_mask([False, True, False]) == [1.0, 0.0, 1.0]


def test_group_advantages_hand_computed():
    # mean -0.5; unbiased std = sqrt(3 / 3) = 1 -> (1.5, -0.5, -0.5, -0.5)
    adv = group_advantages([1, -1, -1, -1])
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    # population std = sqrt(0.75)
    adv = group_advantages([1, -1, -1, -1], unbiased=False)
    assert adv[0] == pytest.approx(1.5 / 0.75**0.5, abs=1e-5)
    assert group_advantages([1, -1], scale_by_std=False) == [1.0, -1.0]


def test_group_advantages_identical_rewards_are_zero():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]


def test_group_advantages_sum_to_zero_and_need_two():
    adv = group_advantages([1, -1, 1, -0.3, 0.2])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        group_advantages([1.0])
