"""Finding cached chunks in a prompt's ids whatever its format, with the embedded SmolLM2's real
tokenizer: known passages by their interior, content-defined chunks for plain prompts."""

from __future__ import annotations

import itertools

import pytest
from fakes import PASSAGES

from shared_core.runtime.passage_cache.chunks import (
    PassageIndex,
    Span,
    cdc_chunks,
    find_passages,
    first_of_each,
    interior,
    passage_interior,
    uncovered_chunks,
)

LONG = " ".join(f"Sentence {i} of the long report says that the {w} river flows {d} past the "
                f"old mill of {t}." for i, (w, d, t) in enumerate(
                    [("green", "north", "Arden"), ("slow", "east", "Brill"), ("wide", "south", "Carr"),
                     ("cold", "west", "Dunmore"), ("deep", "north", "Elm"), ("brown", "east", "Fenn"),
                     ("quiet", "south", "Gask"), ("clear", "west", "Holt"), ("grey", "north", "Ince"),
                     ("swift", "east", "Jura"), ("dark", "south", "Kell"), ("pale", "west", "Lorn")]))


@pytest.fixture(scope="module")
def tokenizer():
    from shared_core.runtime.weights.embedded import embedded_gguf
    from shared_core.runtime.weights.sources import load_gguf_tokenizer

    path = embedded_gguf("smollm2-135m-instruct")
    if path is None:
        pytest.skip("the embedded SmolLM2 is not installed")
    return load_gguf_tokenizer(path, False)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                              add_generation_prompt=True, return_dict=True)["input_ids"])


TEMPLATES = [
    lambda ps, q: "Context:\n" + "\n\n".join(ps) + f"\n\nQuestion: {q}",
    lambda ps, q: "Answer using the documents.\n" + "".join(f"[doc] {p}\n" for p in ps) + q,
    lambda ps, q: q + " Sources: " + " | ".join(f'"{p}"' for p in ps),
]


@pytest.mark.parametrize("template", range(len(TEMPLATES)))
def test_known_passages_are_found_in_any_template_and_order(tokenizer, template):
    order = [2, 0, 1]
    prompt = _chat(tokenizer, TEMPLATES[template]([PASSAGES[i] for i in order], "Who built it?"))
    spans = find_passages(prompt, [_ids(tokenizer, p) for p in PASSAGES])
    assert len(spans) == 3
    for span, i in zip(spans, order, strict=True):
        inner = interior(_ids(tokenizer, PASSAGES[i]))
        assert tuple(prompt[span.start : span.end]) == inner  # the same ids: the same cache key
    assert [s.start for s in spans] == sorted(s.start for s in spans)


def test_a_first_word_that_splits_alone_is_still_found(tokenizer):
    """SmolLM2 splits "Victoria" alone into "Victor" "ia" but " Victoria" after a space into one
    id: the interior starts at the second word, so the passage is found after any prefix."""
    text = ("Victoria (Australia): Victoria (abbreviated as Vic) is a state in the south-east of "
            "Australia, the second most populous state and the smallest on the mainland.")
    assert _ids(tokenizer, text)[:2] != _ids(tokenizer, " " + text)[:2]
    inner = passage_interior(lambda t: _ids(tokenizer, t), text)
    index = PassageIndex()
    index.add_interior(inner)
    for prompt_text in (f"Document [1]: {text}\nQ?", f"Context:\n{text}", f'"{text}"'):
        prompt = _chat(tokenizer, prompt_text)
        [span] = index.find(prompt)
        assert tuple(prompt[span.start : span.end]) == inner


def test_a_passage_not_in_the_prompt_is_not_found(tokenizer):
    prompt = _chat(tokenizer, "Context:\n" + PASSAGES[0] + "\n\nQuestion: why?")
    edited = PASSAGES[1].replace("blue", "red")
    assert find_passages(prompt, [_ids(tokenizer, edited)]) == []
    assert PassageIndex().find(prompt) == []
    assert interior(_ids(tokenizer, "Too short.")) == ()


def test_content_defined_chunks_repeat_across_templates(tokenizer):
    """The same long text in two prompts (other template, other text before it) yields the same
    interior chunks: boundaries come from the ids, not from where the text starts."""
    a = _chat(tokenizer, "Context:\n" + LONG + "\n\nQuestion: which mill?")
    b = _chat(tokenizer, "Read the following report carefully, then answer.\n[report] " + LONG
              + " [end]\nWhich river is swift?")
    chunks_a = {tuple(a[s.start : s.end]) for s in uncovered_chunks(a, [])}
    chunks_b = {tuple(b[s.start : s.end]) for s in uncovered_chunks(b, [])}
    long_ids = len(_ids(tokenizer, LONG))
    shared = chunks_a & chunks_b
    assert len(shared) >= 2
    assert sum(map(len, shared)) >= long_ids // 2  # most of the text is reusable


def test_cdc_covers_the_ids_within_its_limits():
    ids = [(i * 7919) % 5003 for i in range(3000)]
    spans = cdc_chunks(ids, min_len=32, max_len=128)
    assert spans[0].start == 0 and spans[-1].end == len(ids)
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))
    assert all(32 <= len(s) <= 128 for s in spans[:-1])
    assert cdc_chunks(ids[:3000], min_len=32, max_len=128) == spans  # deterministic
    with pytest.raises(ValueError, match="min_len"):
        cdc_chunks(ids, min_len=4, window=8)


def test_uncovered_chunks_skip_known_spans_and_cut_edges():
    ids = [(i * 31337) % 4099 for i in range(1200)]
    known = [Span(400, 600)]
    chunks = uncovered_chunks(ids, known)
    assert chunks and all(c.end <= 400 or c.start >= 600 for c in chunks)
    assert all(c.start > 0 and c.end not in (400, 1200) for c in chunks)


def test_recompute_groups_fill_decodes_and_split_long_runs_in_order():
    from shared_core.runtime.passage_cache.llamacpp import _groups

    assert _groups([(0, 3), (5, 6), (10, 30)], 2, 8) == [[(0, 3), (5, 6)], [(10, 18)],
                                                         [(18, 26)], [(26, 30)]]
    assert _groups([(0, 3), (5, 6), (7, 9)], 31, 512) == [[(0, 3), (5, 6), (7, 9)]]
    assert _groups([], 31, 512) == []
    runs = [(a, a + 2) for a in range(0, 200, 5)]
    groups = _groups(runs, 31, 512)
    assert [len(g) for g in groups] == [31, 9] and list(itertools.chain(*groups)) == runs


def test_a_chunk_the_prompt_holds_twice_is_stored_once():
    a, b, again = (Span(0, 16), "k1"), (Span(20, 40), "k2"), (Span(50, 66), "k1")
    assert list(first_of_each([a, b, again])) == [a, b]
