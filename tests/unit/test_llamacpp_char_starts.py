"""Character offsets of llama.cpp tokens from the bytes each stands for (RAPID's shared-KV
drafter maps retrieved chunks' characters to prompt positions with them)."""

from shared_core.runtime.llamacpp.lm import char_starts


def test_each_token_starts_at_its_first_character() -> None:
    assert char_starts("Hi world", [b"Hi", b" world"]) == [0, 2]


def test_a_token_inside_a_character_starts_at_that_character() -> None:
    text = "a东b"  # 东 is three bytes, read here as two tokens
    assert char_starts(text, [b"a", "东".encode()[:2], "东".encode()[2:], b"b"]) == [0, 1, 1, 2]


def test_a_leading_space_the_vocabulary_writes_is_skipped() -> None:
    assert char_starts("Hi world", [b" Hi", b" world"]) == [0, 2]


def test_tokens_that_do_not_spell_the_text_give_none() -> None:
    assert char_starts("Hi world", [b"Hi", b"world"]) is None
