"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier match of the suffix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from shared_core.drafters.base import EMPTY_DRAFT, Draft, DrafterBase


class PromptLookupDrafter(DrafterBase):
    """Model-free drafter (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

    The longest suffix n-gram (``max_ngram`` down to ``min_ngram``) of the context is searched in
    the context; the tokens after its most recent earlier occurrence are the draft.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            msg = f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}"
            raise ValueError(msg)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k < 1 or len(context) < self.min_ngram + 1:
            return EMPTY_DRAFT
        ids = np.asarray(context, dtype=np.int64)  # host ids: numpy, nothing to wait for
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(ids[:-1], n)  # [L - n, n], each earlier n-gram
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                tokens = tuple(int(t) for t in ids[start : start + k])
                if tokens:
                    return Draft(tokens, None, source="prompt_lookup")
        return EMPTY_DRAFT
