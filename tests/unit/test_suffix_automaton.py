"""Suffix automaton: incremental matches equal a brute-force matcher on random sequences."""

from __future__ import annotations

import random

import pytest

from shared_core.drafters.suffix_automaton import (
    SEPARATOR,
    DynamicIndex,
    StaticIndex,
    SuffixAutomaton,
    longest_match_brute,
)


@pytest.mark.parametrize("alphabet", [2, 3, 7])
def test_dynamic_match_equals_brute_force(alphabet: int) -> None:
    rng = random.Random(alphabet)
    for _ in range(20):
        index = DynamicIndex()
        text: list[int] = []
        for _ in range(rng.randint(1, 60)):
            token = rng.randrange(alphabet)
            text.append(token)
            index.add([token])
            match = index.match()
            length, ends = longest_match_brute(text)
            offset = index.context_start
            assert match.length == length
            assert [e - offset for e in match.ends] == ends


def test_all_end_positions_of_every_substring() -> None:
    rng = random.Random(0)
    text = [rng.randrange(3) for _ in range(80)]
    sam = SuffixAutomaton(text)
    for _ in range(200):
        i = rng.randrange(len(text))
        j = rng.randrange(i, min(len(text), i + 6))
        key = text[i : j + 1]
        state = 0
        for t in key:
            state = sam.next[state][t]
        expected = [e for e in range(len(key) - 1, len(text))
                    if text[e - len(key) + 1 : e + 1] == key]
        assert sam.end_positions(state) == expected


def test_documents_are_searchable_and_separated() -> None:
    index = DynamicIndex([[5, 6, 7, 8], [9, 9]])
    index.add([1, 5, 6])
    match = index.match()
    assert match.length == 2
    (end,) = match.ends
    assert index.continuation(end, 10) == (7, 8)  # stops at the separator
    assert SEPARATOR not in index.continuation(end, 10)


def test_limit_caps_the_positions() -> None:
    index = DynamicIndex()
    index.add([t for i in range(20) for t in (1, 2, 100 + i)] + [1, 2])
    assert len(index.match().ends) == 20
    assert len(index.match(limit=5).ends) <= 5


def test_static_matcher_and_no_match() -> None:
    static = StaticIndex([[1, 2, 3, 4], [2, 3, 9]])
    matcher = static.matcher()
    matcher.add([7, 2, 3])
    match = matcher.match()
    assert match.source == "static" and match.length == 2
    assert sorted(matcher.continuation(e, 5) for e in match.ends) == [(4,), (9,)]
    matcher.add([42])
    assert matcher.match().length == 0


def test_amortised_linear_build() -> None:
    """The automaton's size bounds (≤ 2n − 1 states, ≤ 3n − 4 transitions) that make the online
    build amortised linear; counted, not timed, so the test cannot flake on a busy machine."""
    rng = random.Random(1)
    for n in (2_000, 20_000):
        index = DynamicIndex()
        index.add([rng.randrange(50) for _ in range(n)])
        states = len(index.sam.length) - 1  # without the root
        transitions = sum(len(edges) for edges in index.sam.next)
        assert states <= 2 * n - 1 and transitions <= 3 * n - 4
