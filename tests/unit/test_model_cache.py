"""shared_core.runtime.model_cache: one loaded LM per (name, device, dtype) in a process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared_core.runtime.model_cache import cached_lm


def test_same_arguments_share_one_model(tiny_model_folder: str) -> None:
    first = cached_lm(tiny_model_folder, device="cpu", dtype="float32")
    assert cached_lm(tiny_model_folder, device="cpu", dtype="float32") is first
    other = cached_lm(tiny_model_folder, device="cpu", dtype="bfloat16")
    assert other is not first
    assert str(other.dtype) == "torch.bfloat16"


def test_loaded_copies_lists_every_key_of_a_name_and_loads_nothing(tiny_model_folder: str
                                                                   ) -> None:
    from shared_core.runtime.model_cache import loaded_copies

    before = loaded_copies(tiny_model_folder)  # what other tests loaded under other keys
    assert len(loaded_copies(tiny_model_folder)) == len(before)  # looking loads nothing
    assert loaded_copies("another-model") == []
    copies = [cached_lm(tiny_model_folder, device="cpu", dtype=d) for d in ("float32", "bfloat16")]
    found = loaded_copies(tiny_model_folder)
    assert all(any(lm is c for lm in found) for c in copies)
    assert len(found) == len({id(lm) for lm in [*before, *copies]})


def test_a_failed_load_is_not_cached(tmp_path: Path) -> None:
    missing = str(tmp_path / "not-yet")
    with pytest.raises(FileNotFoundError):
        cached_lm(missing)
    (tmp_path / "not-yet").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        cached_lm(missing)  # tried again, not a cached failure


def test_adapters_and_engines_share_one_copy_and_release_drops_both(tiny_model_folder: str) -> None:
    from shared_core.frontend import serving

    lm, lock = serving.loaded_model(tiny_model_folder, "cpu", "float32")
    assert lm is cached_lm(tiny_model_folder, device="cpu", dtype="float32")
    assert serving.lock_for(lm) is lock
    assert serving.release(tiny_model_folder, "cpu", "float32")
    assert cached_lm(tiny_model_folder, device="cpu", dtype="float32") is not lm  # loaded anew


def test_release_by_name_drops_the_copy_an_adapter_loaded(tiny_model_folder: str) -> None:
    """The adapters load with backend="auto"; ``release(name)`` (what their errors advise)
    drops that copy too, and every other copy of the name."""
    from shared_core.frontend import serving

    auto, _ = serving.loaded_model(tiny_model_folder, None, None, "auto", prefix_cache=2)
    serving.loaded_model(tiny_model_folder, "cpu", "float32", "torch")  # a second copy
    assert serving.release(tiny_model_folder) is True
    assert serving.release(tiny_model_folder) is False
    again, _ = serving.loaded_model(tiny_model_folder, None, None, "auto", prefix_cache=False)
    assert again is not auto  # loaded anew, so another prefix_cache is taken
    serving.release(tiny_model_folder)


def test_one_name_resolves_to_one_object_and_one_lock(tiny_model_folder: str) -> None:
    from shared_core.runtime.model_cache import loaded_model, resolve_lm
    from shared_core.runtime.model_lock import lock_for

    lm = resolve_lm(tiny_model_folder, device="cpu", dtype="float32")
    again, lock = loaded_model(tiny_model_folder, "cpu", "float32")
    assert again is lm and resolve_lm(lm) is lm  # an object is used as given
    assert lock is lock_for(lm) is lock_for(resolve_lm(tiny_model_folder, device="cpu",
                                                         dtype="float32"))


def test_urls_and_lora_names_resolve_once_through_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A served model's URL and a tuned drafter's name go through the one cache; settings they
    ignore (device, backend) do not make a second copy."""
    from shared_core.runtime import model_cache, remote
    from shared_core.runtime.weights import lora

    made: list[tuple[str, Any]] = []

    class Served:
        def __init__(self, url: str) -> None:
            made.append(("served", url))

    def tuned(name: str, dtype: str | None = None) -> object:
        made.append(("lora", name))
        return object()

    monkeypatch.setattr(remote, "RemoteLM", Served)
    monkeypatch.setattr(lora, "load_tuned_drafter", tuned)
    url, name = "http://127.0.0.1:9/v1", "smollm2-135m-instruct+specrag"
    try:
        served = model_cache.resolve_lm(url, backend="auto")
        assert isinstance(served, Served) and model_cache.resolve_lm(url, dtype="bfloat16") is served
        drafter = model_cache.resolve_lm(name, backend="auto")
        assert model_cache.resolve_lm(name) is drafter
        assert made == [("served", url), ("lora", name)]
        with pytest.raises(ValueError, match="served model's URL"):  # the token engines' path
            model_cache.loaded_model(url)
    finally:
        assert model_cache.release(url) and model_cache.release(name)


def test_lock_for_keeps_one_lock_for_objects_without_weak_references() -> None:
    from shared_core.runtime.model_lock import lock_for

    model = object()  # no __weakref__ slot
    assert lock_for(model) is lock_for(model)


def _budget(lm: Any) -> int:
    from shared_core.runtime.torch.prefix import ATTRIBUTE

    return getattr(lm.model, ATTRIBUTE).budget


def test_prefix_cache_reaches_load_lm_and_a_different_one_is_refused(tiny_model_folder: str
                                                                     ) -> None:
    """The resolver passes ``prefix_cache`` to load_lm on the first load; later ``None`` or the
    same setting share that copy, a different one is refused naming it (no second copy)."""
    from shared_core.runtime import model_cache
    from shared_core.runtime.torch.prefix import MIB

    where = (tiny_model_folder, "cpu", "float32")
    model_cache.release(*where)
    try:
        lm = model_cache.resolve_lm(tiny_model_folder, device="cpu", dtype="float32",
                                    prefix_cache=1)
        assert _budget(lm) == MIB
        assert model_cache.cached_lm(*where) is lm  # None: what was loaded
        assert model_cache.loaded_model(*where, prefix_cache=1)[0] is lm
        for other in (True, 2, False, 0):  # True is "on with the default budget", not 1
            with pytest.raises(ValueError, match=rf"prefix_cache={other!r}: model .* already "
                                                 r"loaded with prefix_cache=1"):
                model_cache.cached_lm(*where, prefix_cache=other)
        assert model_cache.release(*where)
        off = model_cache.cached_lm(*where, prefix_cache=False)
        assert off is not lm and _budget(off) == 0
        assert model_cache.cached_lm(*where, prefix_cache=0) is off  # the same meaning
    finally:
        model_cache.release(*where)


@pytest.mark.parametrize(("bad", "error"), [("4", TypeError), (1.5, TypeError),
                                            (-1, ValueError)])
def test_a_bad_prefix_cache_is_refused_before_any_load(bad: Any, error: type) -> None:
    from shared_core.runtime import model_cache

    with pytest.raises(error, match="prefix_cache must be True, False or an int >= 0"):
        model_cache.cached_lm("/no/such/model", prefix_cache=bad)  # not FileNotFoundError


def test_served_models_ignore_prefix_cache(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    from shared_core.runtime import model_cache, remote

    monkeypatch.setattr(remote, "RemoteLM", lambda url: object())
    url = "http://127.0.0.1:9/v1"
    try:
        served = model_cache.resolve_lm(url, prefix_cache=False)
        assert model_cache.resolve_lm(url, prefix_cache=4) is served  # the server's cache
    finally:
        model_cache.release(url)
