"""The closed-form DDTree streaks (`kernels.ddtree`) equal the reference heap
(`tests/support/oracles.py` `streaks`) on the same inputs: continuous logits, and exact ties
(small-integer logits, log-probs that round to 0.0), which the rank tuples decide."""

import pytest
import torch

from dflash_callbacks.kernels.ddtree import ddtree_streaks_from_top
from oracles import streaks


def closed_form_inputs(z, y, width):
    """top-`width` log-probs (padded with -inf when V < width), label log-probs and the
    label's order (log-prob descending, ties to the lower id)."""
    logprobs = torch.log_softmax(z.float(), dim=-1)
    top = logprobs.topk(min(width, z.shape[-1]), dim=-1).values
    pad = torch.full((*top.shape[:-1], width - top.shape[-1]), float("-inf"))
    label = logprobs.gather(-1, y.unsqueeze(-1))
    lower = torch.arange(z.shape[-1]) < y.unsqueeze(-1)
    order = (logprobs > label).sum(-1) + ((logprobs == label) & lower).sum(-1)
    return torch.cat([top, pad], dim=-1), label.squeeze(-1), order


def random_case(seed, n, length, vocab):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, length, vocab, generator=gen) * 2.5
    y = torch.randint(0, vocab, (n, length), generator=gen)
    # Labels mostly among the likely tokens, so streaks are long enough to matter.
    likely = z.topk(min(3, vocab), dim=-1).indices
    pick = torch.randint(0, likely.shape[-1], (n, length, 1), generator=gen)
    y = torch.where(torch.rand(n, length, generator=gen) < 0.8, likely.gather(-1, pick).squeeze(-1), y)
    cut = torch.randint(0, length + 1, (n, 1), generator=gen)
    valid = torch.arange(length).unsqueeze(0) < cut
    valid[: n // 10] = True  # some anchors with no invalid tail at all
    return z, y, valid


@pytest.mark.parametrize(
    "n,length,vocab,budgets",
    [
        (1500, 15, 64, (1, 2, 3, 4, 8, 64)),
        (800, 6, 5, (1, 2, 3, 4, 8, 64)),  # V below most budgets: -inf padding
        (400, 1, 12, (1, 2, 3, 4, 8, 64)),  # L = 1
        (300, 4, 2, (1, 3, 8, 64)),  # V = 2: padding everywhere but ranks 0 and 1
        (40, 15, 3000, (1024,)),
        (40, 5, 7, (1024,)),  # fewer prefixes than the budget
    ],
)
def test_closed_form_equals_reference(n, length, vocab, budgets):
    z, y, valid = random_case(n * 7 + length * 3 + vocab, n, length, vocab)
    expected = streaks(z, y, ddtree_budgets=budgets, valid=valid)
    top, label, order = closed_form_inputs(z, y, max(budgets))
    got = ddtree_streaks_from_top(top, label, order, valid, budgets)
    assert sorted(got) == sorted(budgets)
    for budget in budgets:
        assert got[budget].dtype == torch.int64 and got[budget].shape == (n,)
        assert torch.equal(got[budget], expected[f"ddtree@{budget}"]), budget
    assert got[max(budgets)].sum() > 0


def test_wider_top_than_budget_and_invalid_holes():
    # N = 16 columns while only budgets up to 8 are asked; valid has holes, not tails.
    z, y, valid = random_case(5, 500, 15, 40)
    valid &= torch.rand(valid.shape, generator=torch.Generator().manual_seed(1)) > 0.1
    top, label, order = closed_form_inputs(z, y, 16)
    got = ddtree_streaks_from_top(top, label, order, valid, [8, 2])
    expected = streaks(z, y, ddtree_budgets=(2, 8), valid=valid)
    assert torch.equal(got[2], expected["ddtree@2"]) and torch.equal(got[8], expected["ddtree@8"])


def test_confident_drafter_never_beats_the_budget():
    # p(argmax) > 1 - 6e-8 rounds its fp32 log-prob to 0.0: every prefix ties with its child
    # of rank 0. A tree of n nodes reaches depth n at most; counting the ties as accepted gave
    # every budget the full streak of 15.
    z = torch.zeros(3, 15, 32)
    z[:, :, 3] = 30.0
    z[1, 5:, 3] = 3.0  # a less sure tail: prefixes below depth 5 score less
    z[2, 0, 3] = 8.0  # log-prob -1.4e-2 at depth 1, then 0.0 below: a plateau of ties
    y = torch.full((3, 15), 3)
    valid = torch.ones(3, 15, dtype=torch.bool)
    assert torch.log_softmax(z[0, 0], -1)[3] == 0.0
    top, label, order = closed_form_inputs(z, y, 8)
    got = ddtree_streaks_from_top(top, label, order, valid, (1, 4, 8))
    expected = streaks(z, y, ddtree_budgets=(1, 4, 8), valid=valid)
    for budget in (1, 4, 8):
        assert torch.equal(got[budget], expected[f"ddtree@{budget}"]), budget
        assert got[budget].max() <= budget
    assert got[8].tolist() == [8, 8, 8] and got[1].tolist() == [1, 1, 1]


@pytest.mark.parametrize("seed,n,length,vocab", [(0, 600, 15, 6), (1, 600, 4, 3), (2, 300, 15, 40)])
def test_exact_ties_equal_reference(seed, n, length, vocab):
    # Small-integer logits: ties between tokens, between depths and between whole
    # prefixes everywhere, plus rows with a 30-nat winner (log-prob 0.0).
    gen = torch.Generator().manual_seed(seed)
    z = torch.randint(0, 3, (n, length, vocab), generator=gen).float()
    z += 30.0 * (torch.rand(n, length, 1, generator=gen) < 0.3) * (torch.arange(vocab) == 0)
    y = torch.where(torch.rand(n, length, generator=gen) < 0.8, z.argmax(-1), torch.randint(0, vocab, (n, length), generator=gen))
    valid = torch.arange(length) < torch.randint(0, length + 1, (n, 1), generator=gen)
    valid[: n // 2] = True
    budgets = (1, 2, 3, 4, 8, 16)
    top, label, order = closed_form_inputs(z, y, max(budgets))
    got = ddtree_streaks_from_top(top, label, order, valid, budgets)
    expected = streaks(z, y, ddtree_budgets=budgets, valid=valid)
    for budget in budgets:
        assert torch.equal(got[budget], expected[f"ddtree@{budget}"]), budget


def test_empty_batch():
    got = ddtree_streaks_from_top(torch.zeros(0, 3, 4), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.int64),
                                  torch.zeros(0, 3, dtype=torch.bool), (4,))
    assert got[4].shape == (0,) and got[4].dtype == torch.int64


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(top=torch.zeros(2, 3, 4, dtype=torch.float64)), r"top_logprobs must be a float32 tensor of shape \[A, L, N\]"),
        (dict(top=torch.zeros(2, 0, 4)), "L >= 1 and N >= 1"),
        (dict(label=torch.zeros(2, 4)), r"label_logprobs must be a torch.float32 tensor of shape \[A, L\] = \[2, 3\]"),
        (dict(valid=torch.ones(2, 3)), "valid must be a torch.bool tensor"),
        (dict(order=torch.zeros(2, 3)), r"label_order must be a torch.int64 tensor of shape \[A, L\] = \[2, 3\]"),
        (dict(budgets=(0,)), r"budgets must be integers in \[1, N = 4\]"),
        (dict(budgets=(5,)), r"budgets must be integers in \[1, N = 4\]"),
        (dict(budgets=(2.0,)), r"budgets must be integers in \[1, N = 4\]"),
        (dict(budgets=()), "at least one budget"),
        (dict(top=torch.tensor([-1.0, -0.5, -2.0, -3.0]).expand(2, 3, 4)), "sorted descending"),
        (dict(top=torch.full((2, 3, 4), float("nan"))), "sorted descending"),
    ],
)
def test_input_validation(change, message):
    args = dict(
        top=torch.tensor([-0.5, -1.0, -2.0, float("-inf")]).expand(2, 3, 4),
        label=torch.zeros(2, 3),
        order=torch.zeros(2, 3, dtype=torch.int64),
        valid=torch.ones(2, 3, dtype=torch.bool),
        budgets=(2,),
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        ddtree_streaks_from_top(args["top"], args["label"], args["order"], args["valid"], args["budgets"])
