"""Review of D2LPM's indexed worker credit (``_PairCredit``): every way a dict is filled keeps each client's index."""

from __future__ import annotations

import copy
import pickle

from petals_chain.algorithms.fairness import FairnessConfig, FairPolicy, _PairCredit


def _index_is_right(c: _PairCredit) -> bool:
    want: dict[str, dict] = {}
    for key, value in dict.items(c):
        want.setdefault(key[0], {})[key] = value
    return all(c.of(client) == want.get(client, {}) for client in set(want) | set(c._index()))


def test_the_constructor_or_and_copy_keep_the_pair_credit_index():
    """dict's constructor, ``|=`` and ``copy.copy`` fill a dict subclass without its ``__setitem__``: the client's
    credits were missing from ``of()`` (a refused arrival's restore then dropped them), and a shallow copy shared
    the original's index, so deleting from the copy hid the original's credit."""
    c = _PairCredit({("a", 1): 1.0}, **{})
    assert _index_is_right(c) and c.of("a") == {("a", 1): 1.0}
    same = c
    c |= {("b", 1): 2.0}
    c |= [(("b", 2), 3.0)]
    assert c is same and _index_is_right(c) and c.of("b") == {("b", 1): 2.0, ("b", 2): 3.0}

    d = copy.copy(c)
    assert type(d) is _PairCredit and d == c
    del d[("a", 1)]
    d[("z", 1)] = 9.0
    assert _index_is_right(c) and _index_is_right(d)
    assert c.of("a") == {("a", 1): 1.0} and d.of("a") == {} and c.of("z") == {}
    for other in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert other == c and _index_is_right(other)
    assert c == dict(c) and type(c.copy()) is dict  # compares as the plain dict it is

    # what it cost: an arrival refused in the same step puts back the credit its client held
    policy = FairPolicy("d2lpm", FairnessConfig(quantum=100.0, worker_quantum=100.0))
    policy.worker_credit |= {("x", "w"): 5.0}
    mark = policy.mark("x")
    policy.worker_credit[("x", "w")] = -95.0
    policy.restore(mark)
    assert dict(policy.worker_credit) == {("x", "w"): 5.0}
