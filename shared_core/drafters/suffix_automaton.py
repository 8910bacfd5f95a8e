"""Suffix automata over token ids: ReSpec's / SAM-Decoding's retrieval module.

A :class:`SuffixAutomaton` is built incrementally (Blumer et al. 1985; amortised O(1) state and
transition work per appended token with dict transitions). It keeps, per state, the first end
position (``firstpos``) and the children of the suffix-link tree, so that *all* end positions of
a state's strings (its endpos set) can be listed by walking its link subtree.

:class:`Matcher` follows a token stream through an automaton and keeps the longest suffix of the
stream that occurs in the automaton's text (matching statistics, amortised O(1) per token).

:class:`DynamicIndex` is the per-request source (prompt + retrieved documents + generated
tokens): its matcher advances *before* each token is added, so a match always refers to an
earlier occurrence that has a continuation. :class:`StaticIndex` is the optional corpus source
(REST / SAM-Decoding's static automaton), built once and shared by requests, each request
walking it with its own :class:`Matcher`; its match length is penalised by ``len_bias`` when the
two sources are compared (SAM-Decoding ``samd/draft.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SEPARATOR = -1  # placed between documents: never matches a real token, ends continuations


class SuffixAutomaton:
    """Incremental suffix automaton over a sequence of ints (token ids)."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.text: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.firstpos: list[int] = [-1]  # end index (into text) of the first occurrence
        self.is_clone: list[bool] = [False]
        self.children: list[set[int]] = [set()]  # suffix-link tree
        self.last = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.text)

    def _new_state(self, length: int, firstpos: int, clone: bool) -> int:
        self.next.append({})
        self.link.append(-1)
        self.length.append(length)
        self.firstpos.append(firstpos)
        self.is_clone.append(clone)
        self.children.append(set())
        return len(self.length) - 1

    def _set_link(self, state: int, target: int) -> None:
        old = self.link[state]
        if old >= 0:
            self.children[old].discard(state)
        self.link[state] = target
        self.children[target].add(state)

    def append(self, token: int) -> None:
        """Add one token at the end of the text (the classic online construction)."""
        pos = len(self.text)
        self.text.append(token)
        cur = self._new_state(self.length[self.last] + 1, pos, clone=False)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self._set_link(cur, 0)
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self._set_link(cur, q)
            else:
                clone = self._new_state(self.length[p] + 1, self.firstpos[q], clone=True)
                self.next[clone] = dict(self.next[q])
                self._set_link(clone, self.link[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self._set_link(q, clone)
                self._set_link(cur, clone)
        self.last = cur

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(int(token))

    def end_positions(self, state: int, limit: int | None = None) -> list[int]:
        """End indices of every occurrence of the state's strings (its endpos set), ascending.

        Walks the state's suffix-link subtree (each non-clone state contributes its
        ``firstpos``); ``limit`` caps the walk for very frequent keys.
        """
        found: list[int] = []
        stack = [state]
        while stack and (limit is None or len(found) < limit):
            node = stack.pop()
            if not self.is_clone[node] and node != 0:
                found.append(self.firstpos[node])
            stack.extend(self.children[node])
        return sorted(found)

    def continuation(self, end: int, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens after end index ``end``, stopping at a separator."""
        out: list[int] = []
        for token in self.text[end + 1 : end + 1 + k]:
            if token < 0:
                break
            out.append(token)
        return tuple(out)


class Matcher:
    """The longest suffix of a token stream that occurs in an automaton (matching statistics)."""

    def __init__(self, automaton: SuffixAutomaton) -> None:
        self.sam = automaton
        self.state = 0
        self.match_len = 0

    def feed(self, token: int) -> None:
        sam = self.sam
        while self.state != 0 and token not in sam.next[self.state]:
            self.state = sam.link[self.state]
            self.match_len = sam.length[self.state]
        nxt = sam.next[self.state].get(token)
        if nxt is None:
            self.state, self.match_len = 0, 0
        else:
            self.state, self.match_len = nxt, self.match_len + 1

    def refresh(self) -> None:
        """Move to the state that now holds the match (a later append may have split it)."""
        sam = self.sam
        while self.state != 0 and sam.length[sam.link[self.state]] >= self.match_len:
            self.state = sam.link[self.state]


@dataclass(frozen=True)
class Match:
    """The longest matched suffix (``length`` tokens) and the end indices of its occurrences."""

    source: str  # "dynamic" or "static"
    length: int
    ends: tuple[int, ...]  # end indices into the source's text, each with a continuation


NO_MATCH = Match("dynamic", 0, ())


class DynamicIndex:
    """Per-request automaton over documents, prompt and generated tokens.

    ``add`` appends context tokens; ``match`` returns the longest suffix of the context that also
    ends at an earlier position, with all those earlier end positions.
    """

    def __init__(self, documents: Sequence[Sequence[int]] = ()) -> None:
        self.sam = SuffixAutomaton()
        self.matcher = Matcher(self.sam)
        for doc in documents:
            self.sam.extend(doc)
            self.sam.append(SEPARATOR)
        self.context_start = len(self.sam)  # where the request's context begins in sam.text

    def add(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.matcher.feed(int(token))  # match against the text *before* this token
            self.sam.append(int(token))
            self.matcher.refresh()

    def match(self, limit: int | None = None) -> Match:
        if self.matcher.match_len == 0:
            return NO_MATCH
        last = len(self.sam) - 1
        ends = [e for e in self.sam.end_positions(self.matcher.state, None if limit is None
                                                   else limit + 1) if e < last]
        if limit is not None:
            ends = ends[-limit:]
        return Match("dynamic", self.matcher.match_len, tuple(ends))

    def continuation(self, end: int, k: int) -> tuple[int, ...]:
        return self.sam.continuation(end, k)


class StaticIndex:
    """A corpus automaton built once (documents joined by separators), shared by requests."""

    def __init__(self, documents: Iterable[Sequence[int]]) -> None:
        self.sam = SuffixAutomaton()
        for doc in documents:
            self.sam.extend(doc)
            self.sam.append(SEPARATOR)

    def matcher(self) -> StaticMatcher:
        return StaticMatcher(self)


class StaticMatcher:
    """One request's walk through a :class:`StaticIndex`."""

    def __init__(self, index: StaticIndex) -> None:
        self.index = index
        self.matcher = Matcher(index.sam)

    def add(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.matcher.feed(int(token))

    def match(self, limit: int | None = None) -> Match:
        if self.matcher.match_len == 0:
            return Match("static", 0, ())
        ends = [e for e in self.index.sam.end_positions(self.matcher.state, limit)
                if self.index.sam.continuation(e, 1)]
        return Match("static", self.matcher.match_len, tuple(ends))

    def continuation(self, end: int, k: int) -> tuple[int, ...]:
        return self.index.sam.continuation(end, k)


def longest_match_brute(text: Sequence[int]) -> tuple[int, list[int]]:
    """Reference for tests: longest suffix of ``text`` that also ends earlier, and those ends."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        key = list(text[n - length :])
        ends = [e for e in range(length - 1, n - 1) if list(text[e - length + 1 : e + 1]) == key]
        if ends:
            return length, ends
    return 0, []
