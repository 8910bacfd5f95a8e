"""The layer-1 value probe of llama.cpp's blend (CacheBlend, Yao et al. EuroSys 2025, §4.2: the
tokens to recompute are those whose KV deviates most from full attention at an early layer):
the whole prompt goes through the first layers and one value projection only, in a context of
its own, and the values are compared with those the cached chunks hold."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shared_core.runtime.llamacpp.session import decode
from shared_core.runtime.passage_cache.kv_state import StateFormatError

if TYPE_CHECKING:
    from shared_core.runtime.llamacpp.lm import LlamaCppModel
    from shared_core.runtime.protocol import SessionLM

PROBE_LAYER = 1  # CacheBlend selects on an early layer; layer 0's values see no context


class Probe:
    """A context of the same model that reads the prompt's layer-``layer`` value vectors and
    stops there: llama.cpp's evaluation callback copies the ``Vcur-<layer>`` tensor out of each
    ubatch's graph and ends the computation (returning false), so a probe costs about
    ``layer`` layers and a projection, not a prefill."""

    def __init__(self, model: LlamaCppModel, layer: int = PROBE_LAYER):
        llama = model.llama
        lib = os.path.join(os.path.dirname(str(llama.__file__)), "lib", "libggml-base.so")
        ggml = ctypes.CDLL(lib)
        ggml.ggml_get_name.restype = ctypes.c_char_p
        ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
        ggml.ggml_nelements.restype = ctypes.c_int64
        ggml.ggml_nelements.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                 ctypes.c_size_t]
        stop = f"Vcur-{layer}".encode()
        self.parts: list[np.ndarray] = []

        @llama.ggml_backend_sched_eval_callback
        def callback(tensor: Any, ask: bool, user_data: Any) -> bool:
            del user_data
            if ggml.ggml_get_name(tensor) != stop:
                return False
            if ask:
                return True
            out = np.empty(ggml.ggml_nelements(tensor), dtype=np.float32)
            ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
            self.parts.append(out)
            return False

        params = llama.llama_context_default_params()
        params.n_ctx = model.n_ctx
        params.n_batch = params.n_ubatch = model.settings.n_batch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = model.threads
        params.no_perf = True
        params.cb_eval = callback
        params.cb_eval_user_data = None
        self.llama, self.model, self.layer = llama, model, layer
        self._callback = callback  # kept alive as long as the context
        self.ctx = llama.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            msg = "llama.cpp could not create the passage cache's probe context (out of memory?)"
            raise MemoryError(msg)
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(model.settings.n_batch, 0, 1)
        self.n_batch = model.settings.n_batch
        self.lock = threading.Lock()

    def values(self, lm: SessionLM, ids: Sequence[int]) -> np.ndarray:
        """Layer-``layer`` values of ``ids`` read as one prompt: ``[len(ids), width]``."""
        with self.lock:
            self.parts = []
            self.llama.llama_memory_clear(self.memory, True)
            try:
                for begin in range(0, len(ids), self.n_batch):
                    decode(lm, self, [(int(t), begin + i, (0,), False)
                                      for i, t in enumerate(ids[begin : begin + self.n_batch])])
            finally:
                self.llama.llama_memory_clear(self.memory, True)
            flat = np.concatenate(self.parts) if self.parts else np.empty(0, np.float32)
        if len(ids) == 0 or flat.size % len(ids):
            msg = f"the probe read {flat.size} values for {len(ids)} ids (no Vcur-{self.layer}?)"
            raise StateFormatError(msg)
        return flat.reshape(len(ids), -1)

    def free(self) -> None:
        if self.ctx:
            self.llama.llama_batch_free(self.batch)
            self.llama.llama_free(self.ctx)
            self.ctx = None
