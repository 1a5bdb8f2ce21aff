"""The lane share: premium first, but standard keeps its guaranteed share."""

from __future__ import annotations

from flatfare.contract import Lane
from workers.claims import LaneShare


def test_standard_gets_one_claim_in_five_under_premium_load() -> None:
    share = LaneShare(0.2)
    served = []
    for _ in range(100):
        lane = Lane.STANDARD if share.standard_first() else Lane.PREMIUM
        share.took(lane, 1)
        served.append(lane)
    assert served.count(Lane.STANDARD) == 20
    assert Lane.STANDARD not in served[:4]  # premium goes first


def test_credit_is_bounded_after_a_long_premium_only_stretch() -> None:
    share = LaneShare(0.2)
    share.took(Lane.PREMIUM, 10_000)
    assert share.credit == 8.0
