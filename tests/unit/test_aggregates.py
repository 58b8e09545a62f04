"""Per-task aggregates: hand-worked examples and a property test against plain loops."""

import random

import pytest
import torch

from dflash_callbacks.scoring.aggregates import (
    acceptance_curve, decode_streaks, dense_tau, encode_streaks, live_rounds, live_tau, streak_width,
)


def test_hand_worked_example():
    # Anchors 10..17 with these streaks.
    s = torch.tensor([2, 0, 5, 1, 3, 0, 0, 4])
    assert dense_tau(s) == pytest.approx((3 + 1 + 6 + 2 + 4 + 1 + 1 + 5) / 8)
    # a=10 (streak 2, tau 3) -> a=13 (streak 1, tau 2) -> a=15 (tau 1) -> a=16 (tau 1)
    # -> a=17 (streak 4, tau 5) -> a=22, past the last anchor 17.
    assert live_rounds(s, 10, 100) == [3, 2, 1, 1, 5]
    assert live_tau(s, 10, 100) == pytest.approx(12 / 5)
    assert live_rounds(s, 10, 2) == [3, 2]
    assert live_tau(s, 10, 1) == 3.0
    assert acceptance_curve(s, 6) == pytest.approx([5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0.0])


def test_first_anchor_only_offsets_the_schedule():
    s = torch.tensor([0, 7, 1, 1])
    assert live_rounds(s, 0, 10) == live_rounds(s, 123, 10) == [1, 8]
    assert live_rounds(torch.tensor([4]), 5, 3) == [5]


def plain_live(streaks, first, max_rounds):
    taus, a = [], first
    for _ in range(max_rounds):
        if not first <= a <= first + len(streaks) - 1:
            break
        taus.append(streaks[a - first] + 1)
        a = a + streaks[a - first] + 1
    return taus


def test_property_against_plain_loops():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 40)
        values = [rng.choice([0, 0, 1, 2, 3, 7, 15]) for _ in range(n)]
        s = torch.tensor(values, dtype=rng.choice([torch.int64, torch.int32]))
        first, max_rounds, depth = rng.randint(0, 500), rng.randint(1, 12), rng.randint(1, 16)
        rounds = plain_live(values, first, max_rounds)
        assert live_rounds(s, first, max_rounds) == rounds
        assert live_tau(s, first, max_rounds) == pytest.approx(sum(rounds) / len(rounds))
        assert dense_tau(s) == pytest.approx(sum(v + 1 for v in values) / n)
        curve = [sum(1 for v in values if v >= d) / n for d in range(1, depth + 1)]
        assert acceptance_curve(s, depth) == pytest.approx(curve)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: dense_tau(torch.tensor([], dtype=torch.int64)), "streaks is empty"),
        (lambda: live_tau(torch.tensor([], dtype=torch.int64), 0, 4), "streaks is empty"),
        (lambda: acceptance_curve(torch.tensor([], dtype=torch.int64), 4), "streaks is empty"),
        (lambda: dense_tau(torch.zeros(2, 3, dtype=torch.int64)), r"1-D array \[n_anchors\]"),
        (lambda: dense_tau(torch.tensor(3)), "1-D array"),
        (lambda: dense_tau(torch.tensor([1.0, 2.0])), "must hold integers"),
        (lambda: dense_tau(torch.tensor([1, -1])), "must be >= 0"),
        (lambda: live_rounds(torch.tensor([1]), 0, 0), "max_rounds must be None or an integer >= 1"),
        (lambda: live_rounds(torch.tensor([1]), -1, 3), "first_anchor must be an integer >= 0"),
        (lambda: acceptance_curve(torch.tensor([1]), 0), "max_depth must be an integer >= 1"),
    ],
)
def test_validation(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_streak_codec_round_trips_one_byte_an_anchor_and_refuses_what_is_not_one():
    """encode_streaks: base-36 digits, as many per anchor as block_size - 1 needs (one up to
    block size 36, two up to 1296, 13 at the largest legal block size); decode_streaks reads them
    back exactly, against a plain int(digits, 36)."""
    rng = random.Random(0)
    for block_size in (2, 8, 16, 36, 37, 1296, 1297, 2**63 - 1):
        top = min(block_size - 1, 10**6) if block_size < 2**62 else block_size - 1
        values = [rng.randint(0, top) for _ in range(50)] + [0, block_size - 1]
        text = encode_streaks(torch.tensor(values), block_size)
        width = streak_width(block_size)
        assert len(text) == width * len(values) and text == text.lower()
        assert [int(text[i : i + width], 36) for i in range(0, len(text), width)] == values  # plain base 36
        assert decode_streaks(text, block_size).tolist() == values
    assert [streak_width(b) for b in (2, 36, 37, 1296, 1297, 2**63 - 1)] == [1, 1, 2, 2, 3, 13]
    assert encode_streaks(torch.tensor([10, 9, 8, 7, 0]), 16) == "a9870"
    for text, block_size, message in [("a9z", 16, "holds the streak 35, above max_tau - 1 = 15"),
                                      ("1 2", 16, "a character other than"), ("", 8, "not a non-empty string"),
                                      ("0a1", 37, "2 per anchor"), ("é", 8, "not a non-empty string")]:
        with pytest.raises(ValueError, match=message):
            decode_streaks(text, block_size)
    with pytest.raises(ValueError, match="at most max_tau - 1 = 7; got 8"):
        encode_streaks(torch.tensor([8]), 8)
