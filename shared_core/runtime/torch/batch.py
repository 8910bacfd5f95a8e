"""Several rows at once on torch: parallel greedy drafts and batched span scoring.

The sibling of :mod:`shared_core.runtime.llamacpp.batch`, behind the same two methods of
:class:`shared_core.runtime.protocol.ModelLM` (``generate_parallel``, ``span_logprobs``).
Drafting is ONE left-padded ``generate`` over all prompts with a per-row stop; scoring is ONE
right-padded decoder forward over all rows, the LM head run only on the positions that are scored.
On a model with a passage cache (:mod:`shared_core.runtime.passage_cache.torch_cache`), each
row's KV but its last id is assembled by the cache (its passages from the store) and the
``generate`` starts from those rows, left-padded like the prompts.
:func:`final_norm` finds the module whose output is the final hidden state (KNN-LM's keys).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from shared_core.runtime.protocol import Row, SessionLM, Spans, StopRule

if TYPE_CHECKING:
    import torch
    from transformers import StoppingCriteria
    from transformers.cache_utils import Cache

_LM_HEAD_CHUNK = 64  # positions per LM-head call when scoring spans (bounds memory)


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def _stop_criteria(prompt_len: int, stop: StopRule, lengths: list[int],
                   on_prefilled: Callable[[], None] | None) -> StoppingCriteria:
    """A ``StoppingCriteria`` asking ``stop(row, ids)`` of every unfinished row after each step
    and recording each row's length; the first call follows the forward that read the prompts."""
    import torch
    from transformers import StoppingCriteria

    class _Stop(StoppingCriteria):
        prefilled = False

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
            if not self.prefilled and on_prefilled is not None:
                on_prefilled()
            self.prefilled = True
            new = input_ids[:, prompt_len:]
            for row in range(new.shape[0]):
                if lengths[row] < 0 and stop(row, new[row].tolist()):
                    lengths[row] = new.shape[1]
            done = [length >= 0 for length in lengths]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return _Stop()


def pad_id_of(lm: SessionLM) -> int:
    pad_id = lm.tokenizer.pad_token_id
    return int(pad_id) if pad_id is not None else next(iter(lm.eos_token_ids), 0)


def generate_parallel(lm: SessionLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      stop: StopRule, on_prefilled: Callable[[], None] | None = None
                      ) -> list[Row]:
    """Greedy continuations of every prompt in ONE left-padded batch; per row (new ids, log P of
    each under the raw distribution), up to and including the token ``stop`` ended it on."""
    import torch

    pad_id = pad_id_of(lm)
    ids, mask = _left_pad(prompts, pad_id)
    lengths = [-1] * len(prompts)
    criteria = _stop_criteria(ids.shape[1], stop, lengths, on_prefilled)
    with torch.inference_mode():
        past = _cached_rows(lm, prompts, ids.shape[1] - 1)
        out = lm.model.generate(
            input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device),
            max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
            top_k=None, pad_token_id=pad_id, eos_token_id=None, stopping_criteria=[criteria],
            output_logits=True, return_dict_in_generate=True,  # EOS ends a row only by ``stop``
            **past)
        new = out.sequences[:, ids.shape[1]:]  # [B, T]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    results = []
    for row in range(len(prompts)):
        n = lengths[row] if lengths[row] >= 0 else new.shape[1]
        results.append((new[row, :n].tolist(), logp[row, :n].tolist()))
    return results


def _cached_rows(lm: SessionLM, prompts: Sequence[Sequence[int]], width: int
                 ) -> dict[str, Cache]:
    """``generate``'s cache keyword for rows assembled by the model's passage cache ({} without
    one): row ``r``'s KV of all its ids but the last, right-aligned in ``width`` positions (the
    prompts are left-padded: the padding is masked, and ``generate`` then feeds only the last
    column)."""
    import torch
    from transformers.cache_utils import DynamicCache

    from shared_core.runtime.torch.session import cache_keyword

    passages = getattr(lm.model, "passage_cache", None)
    if passages is None:
        return {}
    rows = passages.fill_rows(lm, prompts)
    if width == 0:  # one-id prompts: nothing before the ids generate feeds
        return {}
    layers, heads, _, dim = rows[0][0].shape
    shape = (len(rows), heads, width, dim)
    cache = DynamicCache()
    for layer in range(layers):
        keys = torch.zeros(shape, dtype=lm.dtype, device=lm.device)
        values = torch.zeros_like(keys)
        for r, (row_keys, row_values) in enumerate(rows):
            n = row_keys.shape[2]
            keys[r, :, width - n:] = row_keys[layer]
            values[r, :, width - n:] = row_values[layer]
        cache.update(keys, values, layer)
    return {cache_keyword(lm.model): cache}


def _head_logprobs(lm: SessionLM, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log P(target) from the LM head on ``hidden`` ``[N, H]``, in chunks (bounds memory)."""
    import torch

    head = lm.model.get_output_embeddings()
    softcap = getattr(lm.model.config, "final_logit_softcapping", None)
    logp = torch.empty(hidden.shape[0])
    for i in range(0, hidden.shape[0], _LM_HEAD_CHUNK):
        logits = head(hidden[i:i + _LM_HEAD_CHUNK]).float()  # [c, V]
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        lse = torch.logsumexp(logits, dim=-1)
        chosen = logits.gather(-1, targets[i:i + _LM_HEAD_CHUNK, None].to(logits.device))[:, 0]
        logp[i:i + _LM_HEAD_CHUNK] = (chosen - lse).cpu()
    return logp


def _sum_spans(lm: SessionLM, hidden: torch.Tensor, ids: torch.Tensor, spans: Spans
               ) -> list[list[float]]:
    """Sum of log P(token) over each span, running the LM head only on the needed positions."""
    import torch

    rows, cols, owners = [], [], []
    for r, row_spans in enumerate(spans):
        for s, (start, end) in enumerate(row_spans):
            for t in range(max(start, 1), end):  # position t-1 predicts token t
                rows.append(r)
                cols.append(t)
                owners.append((r, s))
    rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
    logp = _head_logprobs(lm, hidden[rows_t, cols_t - 1], ids[rows_t, cols_t])
    sums = [[0.0] * len(s) for s in spans]
    for value, (r, s) in zip(logp.tolist(), owners, strict=True):
        sums[r][s] += value
    return sums


def span_logprobs(lm: SessionLM, rows: Sequence[Sequence[int]], spans: Spans
                  ) -> list[list[float]]:
    """Per row, the summed log P over each ``(start, end)`` span, from ONE right-padded forward
    (real tokens keep their natural positions)."""
    import torch

    width = max(len(r) for r in rows)
    pad_id = lm.tokenizer.pad_token_id or 0
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    with torch.inference_mode():
        hidden = lm.model.get_decoder()(input_ids=ids.to(lm.device),
                                        attention_mask=mask.to(lm.device)).last_hidden_state
        return _sum_spans(lm, hidden, ids.to(lm.device), spans)


def final_norm(lm: SessionLM) -> torch.nn.Module:
    """The module whose output is the model's final normed hidden state (KNN-LM's keys)."""
    model = lm.model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for name in ("norm", "final_layernorm", "ln_f"):
        if hasattr(decoder, name):
            norm: torch.nn.Module = getattr(decoder, name)
            return norm
    msg = f"cannot find the final norm of {type(model).__name__} for KNN-LM keys"
    raise TypeError(msg)
