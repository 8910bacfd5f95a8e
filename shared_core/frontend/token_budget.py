"""Token counts without loading a model's tokenizer: tiktoken encodings, for the token budgets of
OpenAI-compatible served models and quick prompt-size checks before any model loads.

For a local model the count is an estimate (its own tokenizer splits text differently); the
engines count with the model's own tokenizer and say when a context does not fit.

Offline: ``cl100k_base`` and ``o200k_base`` (and every OpenAI model name that maps to them) load
from the BPE files llama-index-core ships, when ``TIKTOKEN_CACHE_DIR`` is unset; other encodings
need that variable to point at a folder holding their file, or the network on first use.

Setup::

    from shared_core.frontend.token_budget import check_prompt_size, count_tokens

    count_tokens("How tall is the Eiffel Tower?")                 # cl100k_base
    count_tokens(["doc one", "doc two"], encoding="gpt-4o")       # o200k_base, summed
    check_prompt_size(prompt, max_tokens=8192, reserve=512)       # ValueError when it won't fit
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from shared_core.config import check_int

if TYPE_CHECKING:
    import tiktoken

DEFAULT_ENCODING = "cl100k_base"
BUNDLED_ENCODINGS = ("cl100k_base", "o200k_base")  # shipped by llama-index-core
CACHE_ENV = "TIKTOKEN_CACHE_DIR"
_ENV_LOCK = threading.RLock()  # reentrant: an unpickled object may unpickle another


def _bundled_cache_dir() -> Path | None:
    """llama-index-core's ``_static/tiktoken_cache`` folder, if that package is installed."""
    try:
        spec = importlib.util.find_spec("llama_index.core")
    except ModuleNotFoundError:  # no llama_index namespace package at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0]) / "_static" / "tiktoken_cache"
    return folder if folder.is_dir() else None


@contextmanager
def _offline_cache(encoding_name: str) -> Iterator[None]:
    """Point tiktoken at the bundled BPE files while it loads a bundled encoding.

    tiktoken reads the variable only while loading (the encoding is then kept in memory), so it
    is set for that moment and removed again; a user's own setting is never touched.
    """
    with _ENV_LOCK:
        folder = _bundled_cache_dir() if encoding_name in BUNDLED_ENCODINGS else None
        if folder is None or CACHE_ENV in os.environ:
            yield
            return
        os.environ[CACHE_ENV] = str(folder)
        try:
            yield
        finally:
            os.environ.pop(CACHE_ENV, None)


@contextmanager
def offline_tiktoken() -> Iterator[None]:
    """While unpickling objects that hold tiktoken encodings (LlamaIndex's tokenizers): the
    bundled encodings load from llama-index-core's files, never from the network."""
    with _offline_cache(DEFAULT_ENCODING):
        yield


def encoding_name(encoding: object) -> str:
    """The tiktoken encoding name for an encoding name or an OpenAI model name."""
    import tiktoken

    if not isinstance(encoding, str):
        msg = f"encoding must be a str (tiktoken encoding or OpenAI model name), got {encoding!r}"
        raise TypeError(msg)
    if encoding in tiktoken.list_encoding_names():
        return encoding
    try:
        return tiktoken.encoding_name_for_model(encoding)
    except KeyError:
        names = ", ".join(tiktoken.list_encoding_names())
        msg = (f"encoding={encoding!r} is neither a tiktoken encoding ({names}) nor an OpenAI "
               "model name; for other served models pass the closest encoding, e.g. 'cl100k_base'")
        raise ValueError(msg) from None


def get_encoding(encoding: str = DEFAULT_ENCODING) -> tiktoken.Encoding:
    """A tiktoken ``Encoding`` by encoding name (``"o200k_base"``) or model name (``"gpt-4o"``)."""
    import tiktoken

    name = encoding_name(encoding)
    try:
        with _offline_cache(name):
            return tiktoken.get_encoding(name)
    except OSError as e:
        msg = (f"could not load the tiktoken encoding {name!r} (encoding={encoding!r}): {e}. "
               f"Offline, set {CACHE_ENV} to a folder holding its BPE file, or use one of "
               f"{', '.join(BUNDLED_ENCODINGS)} with llama-index-core installed (it bundles their files: "
               "pip install 'specrag[llamaindex]')")
        raise OSError(msg) from e


def _check_text(text: object, name: str) -> list[str]:
    if isinstance(text, str):
        return [text]
    if isinstance(text, Sequence) and not isinstance(text, bytes):
        for i, item in enumerate(text):
            if not isinstance(item, str):
                msg = f"{name}[{i}] must be a str, got {type(item).__name__}"
                raise TypeError(msg)
        return list(text)
    msg = f"{name} must be a str or a list of str, got {type(text).__name__}"
    raise TypeError(msg)


def count_tokens(text: str | Sequence[str], *, encoding: str = DEFAULT_ENCODING) -> int:
    """Tokens in ``text`` (summed over a list). Special-token strings count as plain text."""
    texts = _check_text(text, "text")
    enc = get_encoding(encoding)
    return sum(len(ids) for ids in enc.encode_batch(texts, disallowed_special=()))


def check_prompt_size(prompt: str | Sequence[str], *, max_tokens: int, reserve: int = 0,
                      encoding: str = DEFAULT_ENCODING) -> int:
    """The prompt's token count, or ValueError if it leaves fewer than ``reserve`` tokens (for the
    answer) of a ``max_tokens`` window. A list (e.g. retrieved documents) is counted summed."""
    check_int(max_tokens, "max_tokens", 1)
    check_int(reserve, "reserve", 0)
    if reserve >= max_tokens:
        msg = f"reserve ({reserve}) must be smaller than max_tokens ({max_tokens})"
        raise ValueError(msg)
    n = count_tokens(_check_text(prompt, "prompt"), encoding=encoding)
    budget = max_tokens - reserve
    if n > budget:
        msg = (f"prompt is {n} tokens by {encoding_name(encoding)}, over the budget of {budget} "
               f"(max_tokens={max_tokens} minus reserve={reserve} for the answer); shorten it, "
               "pass fewer or shorter documents, or raise max_tokens")
        raise ValueError(msg)
    return n
