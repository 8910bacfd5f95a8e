"""The one call both token-engine chat adapters make: :func:`chat`, for ``ChatSpeculative``
(LangChain) and ``SpeculativeLLM`` (LlamaIndex), sync, streamed and async alike.

Framework-neutral (no LangChain / LlamaIndex import; the engines, and with them torch, are
imported when a generation starts), so the two adapters accept the same settings
(:class:`~shared_core.frontend.chat_settings.ChatSettings`) and behave the same; each keeps only
its framework's message and response conversion around one call::

    stream = chat(settings, turns, options, lm)
    stream.finish()          # invoke / complete: the whole generation under the model's lock
    for event in stream: ... # stream: ReplyDelta per step, then Finished

- **checks**: :func:`chat` resolves the per-call options against the settings and validates
  each once (TypeError / ValueError naming the option), the messages into
  :class:`~shared_core.decoding.output.ChatTurns`, before any model is loaded; the engines take
  the result unchecked;
- **model**: the :class:`ChatStream` loads its model on first use (:meth:`ChatStream.open`):
  a per-call ``model``, else the adapter's preloaded one, else the shared cache's
  (:mod:`shared_core.frontend.serving`);
- **locking**: :meth:`ChatStream.finish` holds the model's lock for the whole generation;
  iterating takes it for one step at a time and never while the caller reads;
- **tools**: calls are parsed out of the reply as they complete
  (:class:`~shared_core.decoding.tool_calls.ReplyScanner`), so what a stream yields adds up to
  what :meth:`ChatStream.finish` returns; ``parallel_tool_calls=False`` keeps a reply's first
  call only (as OpenAI's API does; later calls are dropped, not generated differently);
- **events** (:mod:`shared_core.frontend.chat_events`): typed, frozen, with the call's usage and
  engine stats in :class:`~shared_core.frontend.chat_events.CallReport`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from shared_core.config import (
    PENALTY_SETTINGS,
    SAMPLING_SETTINGS,
    GenerationConfig,
    PenaltyConfig,
    check_kwargs,
    check_text,
)
from shared_core.decoding.constrained import (
    Constraint,
    check_json_schema,
    grammar_mask,
    xgrammar_available,
)
from shared_core.decoding.output import ChatTurns, chat_turns, generation_config, logprobs_count
from shared_core.decoding.penalty import ChainedMasks, RepetitionPenalty
from shared_core.decoding.tool_calls import (
    ReplyScanner,
    auto_calls,
    call_or_answer,
    check_tool_choice,
    check_tools,
    forced_call,
    render_prompt,
    tool_names,
)
from shared_core.engines.registry import PLAIN_ENGINE, check_engine_options, start_engine
from shared_core.frontend.chat_events import (
    CallReport,
    ChatEvent,
    Finished,
    FoundCall,
    Reply,
    ReplyDelta,
)
from shared_core.frontend.chat_settings import (
    CALL_OPTIONS,
    CHAT_SETTINGS,
    DEFAULT_ENGINE,
    LOGPROB_SETTINGS,
    MAX_TOKEN_NAMES,
    AdapterState,
    ChatSettings,
    ModelKey,
)
from shared_core.frontend.serving import FairLock, loaded_model, lock_for, step_locked
from shared_core.retrieval.frameworks import to_documents
from shared_core.runtime.model_cache import check_model_name
from shared_core.runtime.model_lock import abandoned
from shared_core.runtime.passage_cache import ensure as ensure_passage_cache

if TYPE_CHECKING:
    from shared_core.config import PassageCacheConfig
    from shared_core.decoding.output import GenerationResult
    from shared_core.engines.loop import Prompt, TokenStream
    from shared_core.runtime.protocol import SessionLM

logger = logging.getLogger(__name__)

__all__ = ["CALL_OPTIONS", "CHAT_SETTINGS", "DEFAULT_ENGINE", "LOGPROB_SETTINGS", "MAX_TOKEN_NAMES",
           "AdapterState",
           "CallReport", "ChatEvent", "ChatSettings", "ChatStream", "Finished", "FoundCall",
           "ModelKey", "Reply", "ReplyDelta", "chat", "chat_model", "check_response_format",
           "prompt_length"]


def chat(settings: ChatSettings, prompt: Prompt, options: Mapping[str, Any],
         lm: SessionLM | None = None, *, parse_tools: bool = True) -> ChatStream:
    """One chat call, checked now, run when read (see the module doc).

    ``prompt``: a message list (checked into :class:`ChatTurns` unless it is one already), a
    formatted prompt string or token ids (the engine encodes and checks them). ``options``: the
    call's keyword arguments, any of :data:`CALL_OPTIONS` (another name is a TypeError naming the
    closest one); a ``None`` for ``stop``, ``documents`` or the token limit means the setting.
    ``documents`` may be strings, our documents or either framework's documents / nodes.
    ``lm``: the adapter's preloaded model (None: the settings' model, loaded by name).
    ``parse_tools=False`` leaves a reply's tool calls in its text (a completion).
    """
    request = _checked_request(settings, prompt, dict(options), settings.adapter_state(lm))
    return ChatStream(request, parse_tools=parse_tools)


def chat_model(settings: ChatSettings, lm: SessionLM | None = None, override: str | None = None
               ) -> tuple[SessionLM, FairLock]:
    """The model a call of these settings runs on and its lock (loaded now if needed): see
    :func:`chat` for ``lm``, ``override`` is a per-call ``model``."""
    return _load(_model_of(settings, settings.adapter_state(lm), override),
                 settings.load_settings(), settings.passage_cache_config())


def prompt_length(lm: SessionLM, turns: ChatTurns, tools: list[dict[str, Any]] | None = None
                  ) -> int:
    """The tokens a call reads ``turns`` as, with ``tools`` (OpenAI format) shown as a call
    shows them (:meth:`ChatStream.open` renders the same way)."""
    shown = check_tools(tools or ())
    if not shown and not _has_tool_turns(turns):
        return len(lm.prompt_ids(turns))
    return len(render_prompt(lm, list(turns), shown, ""))


def check_response_format(response_format: object) -> Constraint | None:
    """``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "schema":
    {...}}`` (also OpenAI's ``{"json_schema": {"schema": {...}}}``) as a :class:`Constraint`."""
    if response_format is None or isinstance(response_format, Constraint):
        return response_format
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return Constraint("json")
    if kind == "json_schema" and isinstance(response_format, dict):
        schema = response_format.get("schema") or (response_format.get("json_schema") or {}
                                                   ).get("schema")
        checked = check_json_schema(schema, "response_format schema")
        if not isinstance(checked, dict):  # true / false: valid schemas, but no object's shape
            msg = f"response_format schema must be a dict, got {type(checked).__name__}"
            raise ValueError(msg)
        return Constraint("json_schema", checked)
    msg = ("response_format must be {'type': 'json_object'} or {'type': 'json_schema', "
           f"'schema': {{...}}}}, got {response_format!r:.80}")
    raise ValueError(msg)


# -- the checked request -------------------------------------------------------------------------
@dataclass(frozen=True)
class _ToolPrompt:
    """How tools (or a response format) change the prompt: the conversation to render, the
    tools shown, the forced beginning of the reply and the grammar every engine row is masked
    with. Rendering needs the model's tokenizer, so it waits for :meth:`ChatStream.open`."""

    turns: list[dict[str, Any]]
    shown: list[dict[str, Any]]
    prefill: str
    constraint: Constraint | None
    single_call: bool = False  # parallel_tool_calls=False: the reply's first call only


@dataclass(frozen=True)
class _Request:
    """One call's input, checked once, no model touched: the engines take it as it is."""

    engine: str
    engine_chosen: bool  # named by the caller (settings, call or options), not the default
    prompt: Prompt
    generation: GenerationConfig
    documents: list[str] | None
    options: dict[str, Any]
    tool_prompt: _ToolPrompt | None
    model: SessionLM | ModelKey
    engine_state: dict[str, Any]
    load_settings: dict[str, Any]  # prefix_cache, n_ctx, n_threads, exact (ChatSettings.load_settings)
    passage_cache: PassageCacheConfig | None
    model_name: str  # the model that answers, as the report names it (a preloaded one's name)
    penalty: PenaltyConfig


def _checked_request(settings: ChatSettings, prompt: Prompt, kwargs: dict[str, Any],
                     state: AdapterState) -> _Request:
    """Resolve and validate one call's options (``kwargs`` is consumed)."""
    check_kwargs(kwargs, CALL_OPTIONS, type(settings).__name__)
    chosen = "engine" in kwargs or "engine" in settings.model_fields_set
    engine = kwargs.pop("engine", settings.engine)
    options = _engine_options(settings, engine, kwargs.pop("engine_options", None) or {})
    documents = kwargs.pop("documents", None)
    documents = settings.documents if documents is None else documents
    generation = _generation(settings, kwargs)
    tools = check_tools(kwargs.pop("tools", None) or ())
    choice = check_tool_choice(kwargs.pop("tool_choice", None), tools)
    parallel = kwargs.pop("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        msg = f"parallel_tool_calls must be a bool, got {type(parallel).__name__}"
        raise TypeError(msg)
    constraint = check_response_format(kwargs.pop("response_format", None))
    penalty = PenaltyConfig(**{name: kwargs.pop(name, getattr(settings, name))
                               for name in PENALTY_SETTINGS})
    texts = None if documents is None else [d.text for d in to_documents(documents)]
    checked = _checked_prompt(prompt)
    model = _model_of(settings, state, _checked_model(kwargs.pop("model", None)))
    return _Request(engine, chosen or bool(options), checked, generation, texts, options,
                    _tool_prompt(checked, tools, choice, constraint, single_call=not parallel),
                    model, state.engine_state, settings.load_settings(),
                    settings.passage_cache_config(), model.name, penalty)


def _checked_model(model: object) -> str | None:
    """A per-call ``model``: a model's name, checked as the ``model`` setting is."""
    if model is not None:
        check_text(model, "model")
        check_model_name(model, "model")
    return cast("str | None", model)


def _generation(settings: ChatSettings, kwargs: dict[str, Any]) -> GenerationConfig:
    """The call's token limit (either name), stop strings and sampling, checked once."""
    name = next((n for n in MAX_TOKEN_NAMES if n in kwargs), settings.TOKEN_LIMIT)
    per_call = [kwargs.pop(n, None) for n in MAX_TOKEN_NAMES]
    limit = next((v for v in per_call if v is not None), settings.token_limit())
    stop = kwargs.pop("stop", None)
    sampling = {k: kwargs.pop(k, getattr(settings, k)) for k in SAMPLING_SETTINGS}
    top = logprobs_count(*(kwargs.pop(k, getattr(settings, k)) for k in LOGPROB_SETTINGS))
    return generation_config(limit, name=name, stop=settings.stop if stop is None else stop,
                             top_logprobs=top, **sampling)


def _engine_options(settings: ChatSettings, engine: str, per_call: object) -> dict[str, Any]:
    """The call's engine options (and with them its engine name), checked once: the configured
    options belong to the configured engine, a per-call engine gets its own."""
    if not isinstance(per_call, dict):
        msg = f"engine_options must be a dict, got {type(per_call).__name__}"
        raise TypeError(msg)
    base = settings.engine_options if engine == settings.engine else {}
    return check_engine_options(engine, {**base, **per_call})  # before any model loads


def _checked_prompt(prompt: Prompt) -> Prompt:
    """A message list as :class:`ChatTurns` (checked once); a string or ids as given (the
    engine encodes and checks them)."""
    if isinstance(prompt, ChatTurns):  # the adapter checked them already
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return chat_turns(prompt)
    return prompt


def _has_tool_turns(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in prompt)


def _tool_prompt(prompt: Prompt, tools: list[dict[str, Any]], choice: str,
                 constraint: Constraint | None, *, single_call: bool = False
                 ) -> _ToolPrompt | None:
    """Tools shown, a forced call prefilled and the grammar to mask with (None: a plain
    prompt)."""
    if not tools and constraint is None and not _has_tool_turns(prompt):
        return None
    if not isinstance(prompt, list):
        msg = "tools / response_format need chat messages, not a formatted prompt string"
        raise TypeError(msg)
    prefill, forced = forced_call(choice, tools)
    offered = bool(tools) and choice == "auto"
    turns = (prompt if constraint is None
             else _with_format_instruction(prompt, constraint, tools_offered=offered))
    # under "auto" the calls the model chooses to write are constrained; with a response_format
    # too, the reply is one call or the answer in that format (an agent's tool loop)
    auto = None if not offered else (auto_calls(tools) if constraint is None
                                     else call_or_answer(tools, constraint))
    grammar = forced or auto or constraint
    if grammar is not None and not xgrammar_available():
        if constraint is not None:
            msg = "response_format needs constrained decoding: pip install 'specrag[constrained]'"
            raise ImportError(msg)
        if forced is not None:  # unconstrained, a small model's forced arguments are rarely JSON
            msg = (f"tool_choice={choice!r} forces a call decoded under the tool's schema: pip "
                   "install 'specrag[constrained]' (or tool_choice='auto', parsed as written)")
            raise ImportError(msg)
        logger.debug("xgrammar is not installed: tool calls are parsed as written, not "
                     "constrained ('specrag[constrained]' constrains them)")
        grammar = None
    return _ToolPrompt(list(turns), tools if choice != "none" else [], prefill, grammar,
                       single_call)


def _with_format_instruction(turns: list[dict[str, Any]], constraint: Constraint, *,
                             tools_offered: bool = False) -> list[dict[str, Any]]:
    """The conversation with the expected JSON named in its system turn."""
    lead = ("Call a tool if you need one; otherwise respond" if tools_offered else "Respond")
    if constraint.kind == "json_schema":
        text = (f"{lead} only with a JSON object that matches this JSON schema:\n"
                + json.dumps(constraint.schema, ensure_ascii=False))
    else:
        text = f"{lead} only with a JSON object."
    if turns and turns[0]["role"] == "system":
        return [{**turns[0], "content": f"{turns[0]['content']}\n\n{text}".strip()}, *turns[1:]]
    return [{"role": "system", "content": text}, *turns]


# -- the model -----------------------------------------------------------------------------------
def _model_of(settings: ChatSettings, state: AdapterState, override: str | None
              ) -> SessionLM | ModelKey:
    """A per-call ``model`` other than the setting, else the preloaded ``lm``, else (after
    unpickling) the model it was, else the settings' model; a key is looked up in the shared
    cache per call, so ``serving.release`` frees it."""
    if override is not None and override != settings.model:
        return ModelKey(override, settings.device, settings.dtype, settings.backend)
    if state.lm is not None:
        return state.lm
    if state.reload_as is not None:
        return state.reload_as
    return ModelKey(settings.model, settings.device, settings.dtype, settings.backend)


def _load(model: SessionLM | ModelKey, load_settings: dict[str, Any],
          passage_cache: PassageCacheConfig | None) -> tuple[SessionLM, FairLock]:
    if isinstance(model, ModelKey):
        lm, lock = loaded_model(*model, **load_settings)
    else:
        lm, lock = model, lock_for(model)
    if passage_cache is not None:  # attaching one waits for the model; nothing else here does
        with lock:
            ensure_passage_cache(lm, passage_cache)
    return lm, lock


# -- the stream ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Opened:
    lm: SessionLM
    lock: FairLock
    prompt: Prompt  # with tools: the rendered token ids
    engine: str  # the engine that runs (see _engine_for)


_WARNED_PLAIN: set[str] = set()


def _engine_for(request: _Request, lm: SessionLM) -> str:
    """The request's engine; the default one is replaced by plain decoding on a model whose
    sessions cannot roll drafts back (a recurrent state: Mamba, Qwen3.5), with one warning per
    model. An engine the caller named is kept, and refuses such a model itself."""
    if request.engine_chosen or request.engine == PLAIN_ENGINE or lm.capabilities.rollback:
        return request.engine
    if lm.name not in _WARNED_PLAIN:
        _WARNED_PLAIN.add(lm.name)
        logger.warning("%s keeps a recurrent state, which cannot roll back drafted tokens: "
                       "decoding it with engine=%r instead of the default %r (name an engine "
                       "to choose)", lm.name, PLAIN_ENGINE, request.engine)
    return PLAIN_ENGINE


class ChatStream:
    """One checked chat call (from :func:`chat`). Iterate it for a :class:`ReplyDelta` per
    engine step and a last :class:`Finished` with the rest of the reply (the model's lock taken
    per step, never while the caller reads), or call :meth:`finish` for the whole generation
    under the lock. Each read runs the generation anew; the model loads on the first (or at
    :meth:`open`)."""

    def __init__(self, request: _Request, *, parse_tools: bool) -> None:
        self._request = request
        tool_prompt = request.tool_prompt
        self._prefill = tool_prompt.prefill if tool_prompt else ""
        self._single_call = bool(tool_prompt and tool_prompt.single_call)
        self.tools: tuple[str, ...] = (tuple(tool_names(tool_prompt.shown))
                                       if tool_prompt and parse_tools else ())
        self._opened: _Opened | None = None

    @property
    def engine(self) -> str:
        """The engine that runs (known once the model is loaded; the requested one before)."""
        return self._opened.engine if self._opened is not None else self._request.engine

    @property
    def constraint(self) -> Constraint | None:
        """The grammar every engine row is masked with (None: none)."""
        return self._request.tool_prompt.constraint if self._request.tool_prompt else None

    def open(self) -> ChatStream:
        """Load the model now (else on the first read) and render a tool prompt."""
        if self._opened is None:
            request = self._request
            lm, lock = _load(request.model, request.load_settings, request.passage_cache)
            tools = request.tool_prompt
            prompt = request.prompt if tools is None else render_prompt(
                lm, tools.turns, tools.shown, tools.prefill)
            self._opened = _Opened(lm, lock, prompt, _engine_for(request, lm))
        return self

    def finish(self) -> Finished:
        """The whole generation under the model's lock (nothing is yielded in between)."""
        opened = self._open()
        with opened.lock:
            result = self._start(opened).run()
        scanner = self._scanner()
        if scanner is not None:
            scanner.feed(result.text)
            scanner.close()
        return self._finished(result, scanner, None)

    def __iter__(self) -> Iterator[ChatEvent]:
        opened = self._open()
        with opened.lock:
            if abandoned():  # its consumer left while it queued: no prefill for nobody
                return
            stream = self._start(opened)
        scanner = self._scanner()
        for delta in step_locked(opened.lock, stream):
            if scanner is None:
                yield ReplyDelta(delta)
                continue
            text, calls = scanner.feed(delta)
            if text or calls:  # with tools, a step that decided nothing yields nothing
                yield ReplyDelta(text, tuple(calls))
        rest = ReplyDelta("")
        if scanner is not None:  # what the end of the reply decided
            text, calls = scanner.close()
            rest = ReplyDelta(text, tuple(calls))
        assert stream.result is not None
        yield self._finished(stream.result, scanner, rest)

    def _open(self) -> _Opened:
        opened = self.open()._opened
        assert opened is not None
        return opened

    def _start(self, opened: _Opened) -> TokenStream:
        """The engine's stream (called under the model's lock)."""
        request = self._request
        options = dict(request.options)
        masks: list[Any] = []  # every registered engine masks drafts and targets; one per call
        if self.constraint is not None:
            masks.append(grammar_mask(opened.lm, self.constraint))
        if request.penalty.active:
            from shared_core.engines.loop import encode_prompt  # torch: only once a call runs

            masks.append(RepetitionPenalty(request.penalty, encode_prompt(opened.lm, opened.prompt)))
        if masks:
            options["logits_mask"] = masks[0] if len(masks) == 1 else ChainedMasks(masks)
        generation = request.generation
        if request.tool_prompt is not None:  # rendered to ids: the engine sees no messages
            from shared_core.engines.loop import with_turn_stop

            generation = with_turn_stop(opened.lm, request.tool_prompt.turns, generation)
        return start_engine(opened.engine, opened.lm, opened.prompt, generation,
                            documents=request.documents,
                            engine_state=request.engine_state, **options)

    def _scanner(self) -> ReplyScanner | None:
        return (ReplyScanner(self.tools, self._prefill, single=self._single_call) if self.tools
                else None)

    def _finished(self, result: GenerationResult, scanner: ReplyScanner | None,
                  rest: ReplyDelta | None) -> Finished:
        """The last event; ``rest`` None: nothing was yielded before it (the whole reply)."""
        if scanner is None:
            reply = Reply(result.text, result.text, (), (), result)
        else:
            reply = Reply(result.text, scanner.content, tuple(scanner.calls),
                          tuple(scanner.invalid), result)
        report = CallReport.of(result, self.engine, self._request.model_name,
                               tool_calls=bool(reply.tool_calls), lm=self._open().lm)
        if rest is None:
            rest = ReplyDelta(reply.content, tuple(scanner.found) if scanner else ())
        return Finished(reply, report, rest)
