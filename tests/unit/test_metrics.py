"""`scoring.metrics.streaks` against plain oracles written here over Python lists.

- DDTree: Algorithm 1 as the paper states it (tree of token ids, child maps, walk by
  label id), and for tiny V and L a brute force that enumerates every token sequence.
- vanilla and top@k: plain loops.
Cases include exact ties (logits from a few integers), -inf logits, V below the
budget, L = 1, V = 1, invalid tails and holes, and labels at ids 0 and V - 1.
"""

import heapq
import itertools

import pytest
import torch

from oracles import streaks


def descending_order(row):
    """Token ids by value descending, ties to the lower id."""
    return sorted(range(len(row)), key=lambda v: (-row[v], v))


def oracle_ddtree(lp, y, ok, budget, z):
    """DDTree Algorithm 1 over lists: lp [L][V] log-probs, y [L] labels, ok [L] valid; tokens
    ordered by the logits z [L][V]."""
    length, vocab = len(lp), len(lp[0])
    k = min(budget, vocab)
    order = [descending_order(row)[:k] for row in z]
    children = [{}]  # node 0 is the root
    # (-score, rank tuple, parent node, parent score)
    heap = [(-(0.0 + lp[0][order[0][0]]), (0,), 0, 0.0)]
    while heap and len(children) - 1 < budget:
        _, ranks, parent, parent_score = heapq.heappop(heap)
        depth, rank = len(ranks), ranks[-1]
        token = order[depth - 1][rank]
        node = len(children)
        children.append({})
        children[parent][token] = node
        score = parent_score + lp[depth - 1][token]
        if rank + 1 < k:
            sibling = order[depth - 1][rank + 1]
            heapq.heappush(heap, (-(parent_score + lp[depth - 1][sibling]), ranks[:-1] + (rank + 1,), parent, parent_score))
        if depth < length:
            heapq.heappush(heap, (-(score + lp[depth][order[depth][0]]), ranks + (0,), node, score))
    node, streak = 0, 0
    for d in range(length):
        if not ok[d] or y[d] not in children[node]:
            break
        node = children[node][y[d]]
        streak += 1
    return streak


def brute_ddtree(lp, y, ok, budget, z):
    """Every token sequence of length 1..L, sorted by (-score, rank tuple); first n kept."""
    length, vocab = len(lp), len(lp[0])
    position = [{v: i for i, v in enumerate(descending_order(row))} for row in z]
    prefixes = []
    for depth in range(1, length + 1):
        for tokens in itertools.product(range(vocab), repeat=depth):
            score = 0.0
            for d, v in enumerate(tokens):
                score += lp[d][v]
            ranks = tuple(position[d][v] for d, v in enumerate(tokens))
            prefixes.append((-score, ranks, tokens))
    prefixes.sort()
    tree = {tokens for _, _, tokens in prefixes[:budget]}
    streak = 0
    while streak < length and ok[streak] and tuple(y[: streak + 1]) in tree:
        streak += 1
    return streak


def oracle_vanilla(z, y, ok):
    streak = 0
    for d in range(len(z)):
        best = 0
        for v in range(len(z[d])):
            if z[d][v] > z[d][best]:
                best = v
        if not ok[d] or best != y[d]:
            break
        streak += 1
    return streak


def oracle_top(z, y, ok, k):
    streak = 0
    for d in range(len(z)):
        rank = sum(1 for v in range(len(z[d])) if z[d][v] > z[d][y[d]])
        if not ok[d] or rank >= k:
            break
        streak += 1
    return streak


def random_case(gen, n, length, vocab, tied, with_neg_inf=False):
    """Logits (tied: small integers, so exact ties are everywhere), labels biased to
    the argmax and to ids 0 and V-1, valid masks with tails and some holes."""
    if tied:
        z = torch.randint(0, 3, (n, length, vocab), generator=gen).float()
        if with_neg_inf:
            masked = torch.rand(n, length, vocab, generator=gen) < 0.3
            masked[..., 0] = False  # keep one finite logit per row
            z = z.masked_fill(masked, float("-inf"))
    else:
        z = torch.randn(n, length, vocab, generator=gen) * 2
    pick = torch.randint(0, 4, (n, length), generator=gen)
    y = torch.randint(0, vocab, (n, length), generator=gen)
    y = torch.where(pick == 0, z.argmax(-1), y)
    y = torch.where(pick == 1, torch.zeros_like(y), y)
    y = torch.where(pick == 2, torch.full_like(y, vocab - 1), y)
    cut = torch.randint(0, length + 1, (n, 1), generator=gen)
    valid = torch.arange(length).unsqueeze(0) < cut
    holes = torch.rand(n, length, generator=gen) < 0.05
    valid = valid & ~holes
    return z, y, valid


def check_against_oracles(z, y, valid, budgets, widths, brute):
    out = streaks(z, y, ddtree_budgets=budgets, topk=widths, valid=valid)
    zl = z.tolist()
    lp = torch.log_softmax(z.float(), dim=-1).tolist()
    yl, ok = y.tolist(), valid.tolist()
    for i in range(len(yl)):
        assert out["vanilla"][i] == oracle_vanilla(zl[i], yl[i], ok[i]), i
        for k in widths:
            assert out[f"top@{k}"][i] == oracle_top(zl[i], yl[i], ok[i], k), (i, k)
        for n in budgets:
            expected = oracle_ddtree(lp[i], yl[i], ok[i], n, zl[i])
            assert out[f"ddtree@{n}"][i] == expected, (i, n)
            if brute:
                assert brute_ddtree(lp[i], yl[i], ok[i], n, zl[i]) == expected, (i, n)
    return out


@pytest.mark.parametrize(
    "length,vocab,budgets,tied",
    [
        (3, 3, (1, 2, 3, 4, 8, 40), True),  # brute force; budget 40 > all 39 prefixes
        (3, 2, (1, 3, 5, 14), True),
        (1, 3, (1, 2, 4), True),  # L = 1
        (3, 1, (1, 2, 4), True),  # V = 1: a single chain
        (2, 3, (1, 2, 4, 8), False),
    ],
)
def test_ddtree_matches_brute_force_tiny(length, vocab, budgets, tied):
    gen = torch.Generator().manual_seed(length * 100 + vocab)
    z, y, valid = random_case(gen, 400, length, vocab, tied)
    check_against_oracles(z, y, valid, budgets, (1, 2), brute=True)


@pytest.mark.parametrize(
    "length,vocab,budgets,tied,neg_inf",
    [
        (15, 8, (1, 2, 3, 4, 8, 16), True, False),  # exact ties, V below budget 16
        (6, 5, (4, 8, 64), True, True),  # ties and masked (-inf) logits
        (15, 32, (4, 8), False, False),
        (1, 6, (1, 4, 8), True, False),
    ],
)
def test_ddtree_matches_heap_oracle(length, vocab, budgets, tied, neg_inf):
    gen = torch.Generator().manual_seed(length * 1000 + vocab)
    z, y, valid = random_case(gen, 1000, length, vocab, tied, neg_inf)
    out = check_against_oracles(z, y, valid, budgets, (1, 3), brute=False)
    assert out[f"ddtree@{budgets[-1]}"].sum() > 0  # the walk does get somewhere


def test_ddtree_large_budget():
    gen = torch.Generator().manual_seed(7)
    z, y, valid = random_case(gen, 12, 15, 40, tied=True)
    y[:, :] = z.argmax(-1)  # long label paths, so deep trees are walked
    out = check_against_oracles(z, y, valid, (1024,), (), brute=False)
    assert out["ddtree@1024"].max() >= 3


def test_ddtree_grows_with_budget_and_is_bounded_by_top_k():
    gen = torch.Generator().manual_seed(3)
    z, y, valid = random_case(gen, 500, 15, 16, tied=False)
    out = streaks(z, y, ddtree_budgets=(1, 2, 4, 8, 16), topk=(1, 2, 4, 8, 16), valid=valid)
    for small, big in [(1, 2), (2, 4), (4, 8), (8, 16)]:
        assert (out[f"ddtree@{small}"] <= out[f"ddtree@{big}"]).all()
    for n in (1, 2, 4, 8, 16):
        assert (out[f"ddtree@{n}"] <= out[f"top@{n}"]).all()
    assert torch.equal(out["ddtree@1"], out["vanilla"].clamp(max=1))  # one node: the depth-1 argmax


def test_low_precision_logits_are_scored_in_fp32():
    gen = torch.Generator().manual_seed(11)
    z, y, valid = random_case(gen, 300, 8, 12, tied=False)
    z16 = z.to(torch.bfloat16)
    low = streaks(z16, y, ddtree_budgets=(2, 8), topk=(2,), valid=valid)
    high = streaks(z16.float(), y, ddtree_budgets=(2, 8), topk=(2,), valid=valid)
    assert low.keys() == high.keys()
    for key in low:
        assert low[key].dtype == torch.int64 and low[key].shape == (300,)
        assert torch.equal(low[key], high[key]), key


def test_hand_worked_example():
    # V = 3, L = 2. Depth 1 log-probs favour token 2, then 0; depth 2 favours token 1.
    z = torch.tensor([[[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]]])
    y = torch.tensor([[0, 1]])
    out = streaks(z, y, ddtree_budgets=(1, 2, 3), topk=(1, 2))
    assert out["vanilla"].tolist() == [0]  # argmax at depth 1 is token 2
    assert out["top@1"].tolist() == [0] and out["top@2"].tolist() == [2]
    # Best prefixes: (2), (2,1), (0), ... -> y_1 = 0 enters with the third node.
    assert out["ddtree@1"].tolist() == [0]
    assert out["ddtree@2"].tolist() == [0]
    assert out["ddtree@3"].tolist() == [1]
    # Ties: all logits equal -> lowest id first; labels 0 follow the greedy chain.
    flat = torch.zeros(2, 3, 4)
    labels = torch.tensor([[0, 0, 0], [1, 0, 0]])
    out = streaks(flat, labels, ddtree_budgets=(1, 4, 5, 6), topk=(1,))
    assert out["vanilla"].tolist() == [3, 0]
    assert out["top@1"].tolist() == [3, 3]  # tied tokens share rank 0
    assert out["ddtree@1"].tolist() == [1, 0]
    # Depth 1 (score -log 4) beats depth 2 (-2 log 4): budget 4 is the four tokens,
    # then depth-2 nodes come in tuple order (0,0), (0,1), ...
    assert out["ddtree@4"].tolist() == [1, 1]
    assert out["ddtree@5"].tolist() == [2, 1]
    assert out["ddtree@6"].tolist() == [2, 1]


def test_two_logits_one_fp32_log_prob_apart_are_ordered_by_the_logit_as_the_scorer_orders_them():
    """Tokens 0 and 1 have distinct logits (1 is one fp32 ulp above 0) whose fp32 log-probs are
    equal (next to a logit of 40, both round to -39.999). By the logit, label 1 ranks second:
    the second node of ddtree@2 is its prefix. Ordered by the log-prob with ties to the lower
    id, it ranked third and ddtree@2 missed it. The scorer (head_stats + the closed form)
    agrees with the oracle."""
    from dflash_callbacks.kernels.head_stats import head_stats
    from dflash_callbacks.scoring.config import ScoringConfig
    from dflash_callbacks.scoring.scorer import streaks_from_stats

    z = torch.tensor([[[1e-3, 1e-3, 40.0, 0.0]]])
    z[0, 0, 1] = torch.nextafter(z[0, 0, 0], torch.tensor(1.0))
    lp = torch.log_softmax(z, dim=-1)
    assert z[0, 0, 1] > z[0, 0, 0] and lp[0, 0, 1] == lp[0, 0, 0]  # the corner: one log-prob, two logits
    y = torch.tensor([[1]])
    out = streaks(z, y, ddtree_budgets=(1, 2), topk=(1, 2))
    assert {k: v.tolist() for k, v in out.items()} == {"vanilla": [0], "ddtree@1": [0], "ddtree@2": [1],
                                                     "top@1": [0], "top@2": [1]}
    assert oracle_ddtree(lp[0].tolist(), [1], [True], 2, z[0].tolist()) == 1
    stats = head_stats(z[0], torch.eye(4), y[0], 2, backend="reference")  # logits exact: z @ I
    fast = streaks_from_stats(stats, torch.ones(1, 1, dtype=torch.bool), ScoringConfig(ddtree_budgets=[1, 2], topk=[1, 2]))
    assert {k: v.tolist() for k, v in fast.items()} == {k: v.tolist() for k, v in out.items()}


def test_streak_stops_at_first_invalid_position():
    z = torch.zeros(1, 4, 2)
    z[..., 1] = 5.0
    y = torch.ones(1, 4, dtype=torch.int64)
    valid = torch.tensor([[True, True, False, True]])
    out = streaks(z, y, ddtree_budgets=(8,), topk=(1,), valid=valid)
    assert {k: v.tolist() for k, v in out.items()} == {"vanilla": [2], "ddtree@8": [2], "top@1": [2]}


def test_empty_batch():
    out = streaks(torch.zeros(0, 5, 7), torch.zeros(0, 5, dtype=torch.int64), topk=(2,))
    assert set(out) == {"vanilla", "ddtree@4", "ddtree@8", "top@2"}
    assert all(v.shape == (0,) and v.dtype == torch.int64 for v in out.values())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(logits=torch.zeros(2, 3)), r"logits must be a floating-point tensor of shape \[N, L, V\]"),
        (dict(logits=torch.zeros(2, 3, 4, dtype=torch.int64)), "logits must be a floating-point"),
        (dict(logits=torch.zeros(2, 0, 4)), "L >= 1 and V >= 1"),
        (dict(labels=torch.zeros(2, 3, dtype=torch.int32)), r"labels must be an int64 tensor of shape \[N, L\] = \[2, 3\]"),
        (dict(labels=torch.zeros(3, 2, dtype=torch.int64)), "labels must be an int64"),
        (dict(labels=torch.full((2, 3), 4)), r"labels must lie in \[0, 3\]"),
        (dict(labels=torch.full((2, 3), -1)), r"labels must lie in \[0, 3\]"),
        (dict(valid=torch.ones(2, 3, dtype=torch.int64)), "valid must be None or a bool tensor"),
        (dict(valid=torch.ones(2, 2, dtype=torch.bool)), "valid must be None or a bool tensor"),
        (dict(ddtree_budgets=(4, 0)), "ddtree_budgets must be integers >= 1"),
        (dict(ddtree_budgets=(2.0,)), "ddtree_budgets must be integers >= 1"),
        (dict(ddtree_budgets=(True,)), "ddtree_budgets must be integers >= 1"),
        (dict(topk=(0,)), "topk must be integers >= 1"),
        (dict(logits=torch.full((2, 3, 4), float("nan"))), "NaN or \\+inf"),
        (dict(logits=torch.full((2, 3, 4), float("-inf"))), "at least one finite value"),
    ],
)
def test_input_validation(kwargs, message):
    args = dict(logits=torch.zeros(2, 3, 4), labels=torch.zeros(2, 3, dtype=torch.int64))
    args.update(kwargs)
    logits, labels = args.pop("logits"), args.pop("labels")
    with pytest.raises(ValueError, match=message):
        streaks(logits, labels, **args)
