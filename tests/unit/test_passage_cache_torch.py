"""The passage cache on torch (shared_core.runtime.passage_cache.torch_cache) on tiny in-process models:
the load path, the store keys, refused payloads and the blend's ends (share 0 and 1). The
contracts both runtimes share (the disk tier across processes among them) are in
tests/conformance."""

from __future__ import annotations

import copy

import pytest
import torch
from fakes import PASSAGES
from tiny import tiny_lm

from shared_core.config import PassageCacheConfig
from shared_core.runtime.models import load_lm
from shared_core.runtime.passage_cache import attach, passage_stats, register_passages, warm_passages
from shared_core.runtime.passage_cache.chunks import passage_interior
from shared_core.runtime.passage_cache.torch_blend import ChunkKV
from shared_core.runtime.passage_cache.torch_cache import BLOCK, TorchPassageCache, identity_of
from shared_core.runtime.torch.session import KVSession


def prompt(lm, order, question="Who built the weir?"):
    text = "Context:\n" + "\n\n".join(PASSAGES[i] for i in order) + f"\n\nQuestion: {question}"
    return lm.prompt_ids([{"role": "user", "content": text}])


def greedy(lm, ids, n=4):
    session = lm.open_session()
    logits = session.prefill(ids)
    first, out = logits, []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = session.extend([out[-1]])[-1]
    return out, first, session


def test_load_lm_on_torch_attaches_a_passage_cache(tiny_model_folder):
    lm = load_lm(tiny_model_folder, backend="torch", passage_cache="exact", exact=True,
                 passage_cache_disk_mb=0)
    assert isinstance(lm.model.passage_cache, TorchPassageCache)
    assert lm.model.passage_cache.mode == "exact"
    ids = prompt(lm, [0, 1])
    lm.model.specrag_prefix_store.clear()
    cold, _, _ = greedy(lm, ids)
    lm.model.specrag_prefix_store.clear()
    warm, _, session = greedy(lm, ids)
    assert session.passage_report.reused == (len(ids) - 1) // BLOCK * BLOCK > 0
    assert warm == cold
    assert passage_stats(lm)["last"]["reused"] == session.passage_report.reused
    with pytest.raises(ValueError, match="passage_cache='blend'"):
        load_lm(tiny_model_folder, backend="torch", passage_cache="blend", exact=True)
    with pytest.raises(ValueError, match="recompute_share"):
        load_lm(tiny_model_folder, backend="torch", passage_cache="blend", recompute_share=2)
    blend = load_lm(tiny_model_folder, backend="torch", passage_cache="blend",
                    passage_cache_disk_mb=0)
    assert blend.model.passage_cache.mode == "blend"


def test_the_store_key_changes_with_the_weights_and_the_dtype():
    one, other = tiny_lm(num_layers=1, seed=1), tiny_lm(num_layers=1, seed=2)
    assert identity_of(one.model) == identity_of(tiny_lm(num_layers=1, seed=1).model)
    assert identity_of(one.model) != identity_of(other.model)
    assert identity_of(one.model) != identity_of(copy.deepcopy(one.model).to(torch.float64))


def test_changed_weights_never_serve_old_entries(tmp_path):
    lm = tiny_lm(num_layers=1, seed=4)
    attach(lm.model, PassageCacheConfig(mode="exact", disk_mb=0))
    ids = prompt(lm, [0, 1])
    greedy(lm, ids, 1)
    assert greedy(lm, ids, 1)[2].passage_report.reused > 0
    with torch.no_grad():
        lm.model.lm_head.weight.add_(1e-3)
    assert greedy(lm, ids, 1)[2].passage_report.reused == 0


def test_a_copied_model_gets_an_empty_cache_of_its_own():
    lm = tiny_lm(num_layers=1, seed=5)
    attach(lm.model, PassageCacheConfig(mode="exact", disk_mb=0))
    greedy(lm, prompt(lm, [0, 1]), 1)
    clone = copy.deepcopy(lm)
    assert clone.model.passage_cache is not lm.model.passage_cache
    assert clone.model.passage_cache.store is None  # bound on first use, to the copy's weights
    _, _, session = greedy(clone, prompt(clone, [0, 1]), 1)
    assert session.passage_report.reused == 0 and session.passage_report.stored > 0


def test_a_foreign_disk_entry_is_dropped_and_recomputed(tmp_path):
    """An entry on disk whose digest holds but whose contents the model cannot take (another
    dtype, or not a chunk at all) is deleted, counted as corrupt and read again in context."""
    lm = tiny_lm(num_layers=2, seed=6)
    cache = attach(lm.model, PassageCacheConfig(mode="blend", recompute_share=0.0),
                   disk_dir=tmp_path)
    register_passages(lm, PASSAGES[:1])
    inner = passage_interior(lm.encode, PASSAGES[0])
    assert warm_passages(lm, PASSAGES[:1], progress=False)["computed"] == 1
    store = cache.store
    key = store.key("chunk", cache.head, inner)
    good = store.get(key)
    wrong = ChunkKV(ids=good.ids, head_ids=(), position=0, keys=good.keys.double(),
                    values=good.values.double())  # another dtype
    for corrupt, payload in enumerate((wrong.to_bytes(), b"not a chunk"), start=1):
        store.clear_memory()
        store._path(key).unlink()
        store._write_disk(key, payload)
        _, _, session = greedy(lm, prompt(lm, [0]), 1)
        assert session.passage_report.reused == 0
        assert session.passage_report.unseen >= len(inner)  # read in context instead
        assert passage_stats(lm)["store"]["corrupt"] == corrupt
        assert store.get(key).dtype == torch.float32  # stored again, as that read left it


def test_the_memory_tier_hands_out_its_tensors_and_no_prompt_changes_them():
    """A memory hit is the stored KV itself, on the model's device (no parse, no copy); the
    prompts that place it, recompute around it and decode on leave it as it was."""
    lm = tiny_lm(num_layers=2, seed=8)
    cache = attach(lm.model, PassageCacheConfig(mode="blend", recompute_share=0.5, disk_mb=0))
    register_passages(lm, PASSAGES)
    warm_passages(lm, PASSAGES, progress=False)
    keys = [cache.store.key("chunk", cache.head, passage_interior(lm.encode, text))
            for text in PASSAGES]
    entries = [cache.store.get(key) for key in keys]
    assert all(cache.store.get(key) is entry for key, entry in zip(keys, entries, strict=True))
    assert {entry.keys.device for entry in entries} == {lm.device}
    before = [(entry.keys.clone(), entry.values.clone()) for entry in entries]
    greedy(lm, prompt(lm, [2, 0, 1]), 4)
    lm.generate_parallel([prompt(lm, [0, 1]), prompt(lm, [1, 2], "What did Marta Quell design?")],
                         3, lambda row, ids: False)
    assert cache.last.reused > 0
    for entry, (k, v) in zip(entries, before, strict=True):
        assert torch.equal(entry.keys, k) and torch.equal(entry.values, v)


def test_blend_ends_share_zero_reuses_all_share_one_equals_a_full_prefill():
    lm = tiny_lm(num_layers=3, seed=7)
    ids = prompt(lm, [2, 0], "What did Marta Quell design?")
    full = KVSession(lm).prefill(ids)
    for share in (0.0, 1.0):
        cache = attach(lm.model, PassageCacheConfig(mode="blend", recompute_share=share,
                                                    disk_mb=0))
        register_passages(lm, PASSAGES)
        warm_passages(lm, PASSAGES, progress=False)
        _, logits, session = greedy(lm, ids, 2)
        report = session.passage_report
        assert report.reused > 0 and report.computed_alone == 0
        if share == 0.0:
            assert report.recomputed == 0 and report.probe == 0
        else:
            assert report.recomputed == report.reused and report.probe == 0
            torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
        assert cache.last is report
        assert not session._prefilled_only  # blended KV never enters the exact prefix store
    lm.model.passage_cache = None


@pytest.mark.parametrize("exact", [False, True])
def test_the_exact_cache_reads_on_its_grid_only_in_exact_mode(monkeypatch, exact):
    """With ``exact=True`` a prefill through the exact cache runs ``BLOCK``-position forwards (a
    warm read then runs the forwards a cold one runs: bit-equal); otherwise the session's own
    chunks (on a CPU a 64-position forward reads a token 1.8x slower), a warm read equal to a
    cold one to rounding."""
    from shared_core.runtime.torch.prefix import attach as attach_prefix_store

    lm = tiny_lm(num_layers=2, seed=9)
    attach_prefix_store(lm.model, 0, exact=exact)
    attach(lm.model, PassageCacheConfig(mode="exact", disk_mb=0))
    ids = prompt(lm, [0, 1, 2])
    assert len(ids) > 2 * BLOCK
    sizes: list[int] = []
    forward = KVSession._forward

    def counted(self, new_ids, **kwargs):
        sizes.append(len(new_ids))
        return forward(self, new_ids, **kwargs)

    monkeypatch.setattr(KVSession, "_forward", counted)
    session = KVSession(lm)
    cold = session.prefill(ids)
    assert session.passage_report.reused == 0
    assert sizes == ([BLOCK] * (len(ids) // BLOCK) + [len(ids) % BLOCK] if exact else [len(ids)])
    sizes.clear()
    session = KVSession(lm)
    warm = session.prefill(ids)
    assert session.passage_report.reused == (len(ids) - 1) // BLOCK * BLOCK
    assert sizes == [len(ids) - session.passage_report.reused]
    if exact:
        assert torch.equal(warm, cold)
    else:
        torch.testing.assert_close(warm, cold, atol=1e-4, rtol=0)


def test_warm_passages_on_a_copied_models_unbound_cache_with_nothing_to_warm():
    lm = tiny_lm(num_layers=1, seed=10)
    attach(lm.model, PassageCacheConfig(mode="blend", disk_mb=0))
    clone = copy.deepcopy(lm)
    assert clone.model.passage_cache.store is None
    assert warm_passages(clone, ["too short"], progress=False) == {
        "passages": 1, "computed": 0, "skipped": 0, "too_short": 1, "too_long": 0, "not_kept": 0}
