"""The llama.cpp LM ends a generation where llama.cpp itself does: at every token
``llama_vocab_is_eog`` marks, not only the GGUF's EOS and EOT (SmolLM2's ``<reponame>``, id 4,
ends llama-cpp-python's generation with finish_reason 'stop')."""

from __future__ import annotations

from typing import Any

import pytest

from shared_core.runtime.models import load_lm
from shared_core.runtime.weights.embedded import is_installed
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()


def _marked_eog(lm: Any) -> set[int]:
    model = lm.model
    return {i for i in range(model.n_vocab) if model.llama.llama_vocab_is_eog(model.vocab, i)}


def test_smollm2_stops_at_every_end_of_generation_token() -> None:
    lm = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=256, n_threads=1)
    assert 4 in lm.eos_token_ids  # <reponame>
    assert lm.eos_token_ids == _marked_eog(lm) == {0, 2, 4}


@pytest.mark.skipif(not is_installed("gemma-3-270m"), reason="the Gemma part packages")
def test_gemma3_stops_at_every_end_of_generation_token() -> None:
    lm = load_lm("gemma-3-270m", backend="llama.cpp", n_ctx=256, n_threads=1)
    assert lm.eos_token_ids >= _marked_eog(lm) >= {1, 106, 212}
