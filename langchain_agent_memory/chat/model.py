"""``ChatAgentMemory``: a LangChain chat model whose every agent keeps its KV cache.

Drop-in where ``ChatOllama()`` would go::

    from langchain_agent_memory import ChatAgentMemory

    llm = ChatAgentMemory()  # embedded default model, 4-bit KV, ~/.cache/langchain-agent-memory
    llm.invoke("Hello")

Each call is rendered to text with the model's chat template (``prompt.render``) and runs
on the shared engine of its (model, cache directory, KV format), whose agent cache is
picked by ``namespace.agent_namespace``: an explicit ``agent_id``, else the LangGraph
thread and node. The engine matches the text against that agent's cache, prefills only
what is new, and keeps the reply's keys and values for the next turn.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import timedelta
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import (
    Runnable,
    RunnableLambda,
    RunnableMap,
    RunnablePassthrough,
    ensure_config,
)
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from ..engine import (
    MAX_FREE_STRING_CHARS,
    Engine,
    EngineConfig,
    GenerationParams,
    GrammarConstraint,
    json_schema_grammar,
    parse_age,
    parse_size,
    shared_engine,
    validate_agent_id,
)
from . import prompt, reasoning
from .counting import count_message_tokens
from .errors import langchain_errors, refuse_unknown_arguments, refuse_unknown_call_options
from .fan_out import per_item_configs
from .namespace import agent_namespace
from .profile import model_profile
from .replies import (
    ChatRequest,
    StreamShaper,
    chat_result,
    choice_name,
    forced_tools,
    json_schema_of,
    ls_format,
    whole_reply,
)
from .tool_formats import tool_format

#: ``tool_choice`` values that force some tool call.
_ANY_TOOL = ("any", "required", True)


class ChatAgentMemory(BaseChatModel):
    """Chat model on a local MLX model with a persistent KV cache per agent.

    Args:
        model: a shipped model name (``smollm2-135m``, ``gemma3-270m``), a Hugging Face repo
            id of an mlx-lm model (``mlx-community/gemma-3-1b-it-qat-4bit``, downloaded once),
            an mlx-lm model directory or a ``.gguf`` file; default ``AGENT_MEMORY_MODEL`` or
            ``smollm2-135m``.
        agent_id: the cache to use; default: per LangGraph thread and node (see
            ``namespace``), ``"default"`` outside a graph. Per call: ``agent_id=`` kwarg.
        temperature, top_p, top_k, min_p, seed: sampling (``temperature=0``: greedy; ``top_k=0``
            and ``min_p=0``: off).
        max_tokens: most tokens to generate per call.
        stop: stop sequences (the stop text and anything after it are not returned or kept).
        kv_bits: 4 (default, ``k6v4-rot-h4``: 0.34x the 16-bit bytes), 8, or None for
            16-bit KV; ``kv_format`` names any preset (``cache.KV_PRESETS``) instead.
        cache_dir: where caches live; default ``AGENT_MEMORY_CACHE_DIR``.
        store, blocks: share caches between workers on several hosts: records in PostgreSQL
            (``store="postgresql://..."``), blocks in S3-compatible storage
            (``blocks="s3://bucket/prefix?endpoint=..."``), ``cache_dir`` the local tier in
            front; default ``AGENT_MEMORY_STORE`` / ``AGENT_MEMORY_BLOCKS`` (none: local only).
        lazy_store: a shared store that does not answer at start: serve from ``cache_dir``
            and upload once it answers (True), or fail with the cause (False); default
            ``AGENT_MEMORY_LAZY_STORE``.
        hot_budget_mb: memory for the in-memory block tier (shared per engine); default by
            device (512 on the CPU, 1/16 of a GPU's memory).
        hot_bytes, tool_ttl_s: the hot tier's bounds (``EngineConfig``); under an
            ``AgentMemorySaver`` the graph's schedule says which agents leave it first.
        max_disk_bytes, cache_ttl: bound the model's stored caches (``"5GB"``; ``"7d"``):
            agents least recently used (or unused for longer) are evicted, never one a call
            is using, and their next call prefills (shared per engine: the latest given
            wins); default ``AGENT_MEMORY_MAX_DISK_BYTES`` / ``AGENT_MEMORY_CACHE_TTL``.
        timeout: seconds after which decoding stops (``finish_reason="timeout"``).
        max_string_chars: in constrained output (structured output, a forced tool call),
            the most characters of a JSON string whose schema sets no ``maxLength``,
            ``pattern``, ``format``, ``enum`` or ``const`` (default 200: a small model can
            loop inside a string until ``max_tokens`` cuts the object short); None: no cap.

    Per call (``invoke(..., **kwargs)`` or ``bind``): ``agent_id``, ``model``,
    ``temperature``, ``max_tokens``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``tools``, ``tool_choice``,
    ``chat_template_kwargs``, ``max_string_chars``, ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``wait_for_save``.
    """

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    model: str | None = None
    agent_id: str | None = None
    temperature: float = 0.0
    max_tokens: int = Field(default=256, ge=1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    #: Against repeats (small models loop without them), over the last 20 tokens:
    #: ``repetition_penalty`` multiplies (> 1 discourages, e.g. 1.1), ``presence_penalty`` and
    #: ``frequency_penalty`` subtract (OpenAI's); None or 0: off.
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    #: ``context_length=N``: this model's calls hold at most N tokens (prompt and reply),
    #: under the engine's own (the model's trained context): a longer prompt raises
    #: ``ContextLengthError``. Read ``context_length`` for the bound in force.
    context_limit: int | None = Field(default=None, ge=2, alias="context_length")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    kv_bits: Literal[4, 8] | None = 4
    kv_format: str | None = None
    cache_dir: str | None = None
    store: str | None = None
    blocks: str | None = None
    lazy_store: bool | None = None
    hot_budget_mb: int | None = Field(default=None, ge=0)
    hot_bytes: int | None = Field(default=None, ge=0)
    tool_ttl_s: float = Field(default=30.0, ge=0)
    max_disk_bytes: int | str | None = None
    cache_ttl: float | str | timedelta | None = None
    timeout: float | None = Field(default=None, gt=0)
    max_string_chars: int | None = Field(default=MAX_FREE_STRING_CHARS, ge=1)
    max_retries: int = Field(default=0, ge=0)  # accepted for compatibility: nothing to retry locally
    #: Accepted for compatibility (code written for hosted chat models): a local model needs no key.
    api_key: SecretStr | None = Field(default=None, exclude=True)
    #: Split a thinking model's reasoning (``<think>``, gpt-oss's analysis channel) out of
    #: ``content`` into ``additional_kwargs["reasoning_content"]`` (False: leave it in).
    reasoning: bool = True
    #: Extra variables for the chat template, e.g. ``{"enable_thinking": False}`` (Qwen 3).
    chat_template_kwargs: dict[str, Any] | None = None
    #: ``invoke`` streams (callbacks' ``on_llm_new_token`` fire for each piece).
    streaming: bool = False
    #: Return each reply once its cache is saved: ``response_metadata["cache_saved"]`` True,
    #: ``"local"`` (its upload to a shared store pending) or False, not ``"pending"``.
    wait_for_save: bool = False

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, values: Any) -> Any:
        return refuse_unknown_arguments(cls, values)  # ``temprature=0.7``: named, not ignored

    @field_validator("agent_id")
    @classmethod
    def _valid_agent_id(cls, value: str | None) -> str | None:
        return None if value is None else validate_agent_id(value)

    @field_validator("max_disk_bytes")
    @classmethod
    def _valid_size(cls, value: int | str | None) -> int | None:
        return None if value is None else parse_size(value)

    @field_validator("cache_ttl")
    @classmethod
    def _valid_ttl(cls, value: float | str | timedelta | None) -> float | None:
        return None if value is None else parse_age(value)

    # ------------------------------------------------------------------ identity

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """``dumpd`` / ``dumps`` write the constructor arguments; ``load`` rebuilds the model
        (``valid_namespaces=["langchain_agent_memory"]``, ``allowed_objects=[ChatAgentMemory]``)."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_agent_memory", "chat", "model"]

    @property
    def _llm_type(self) -> str:
        return "agent-memory"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "kv_format": self.kv_format or self.kv_bits,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
        }

    @property
    def model_name(self) -> str:
        from ..config import get_settings

        return self.model or get_settings().model

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "agent-memory"
        params["ls_model_name"] = kwargs.get("model") or self.model_name
        params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _resolve_model_profile(self) -> ModelProfile | None:
        profile = model_profile(self.model_name)
        if profile is not None and self.context_limit is not None:  # what a trimming middleware reads
            held = profile.get("max_input_tokens")
            profile = {
                **profile,
                "max_input_tokens": min(held, self.context_limit) if held else self.context_limit,
            }
        return profile

    @property
    def context_length(self) -> int:
        """Most tokens (prompt and reply) one call can hold; a longer prompt raises
        ``ContextLengthError``, a ``langchain_core.exceptions.ContextOverflowError``."""
        engine = self.engine.context_length
        return engine if self.context_limit is None else min(engine, self.context_limit)

    def penalties(self) -> dict[str, float | None]:
        """The penalties this model applies by default (``GenerationParams`` fields)."""
        return {
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }

    # ------------------------------------------------------------------ token counting

    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s token ids in the model's own tokenizer (no special tokens added)."""
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """Tokens the model reads for ``messages`` (and ``tools``) from scratch, the few of a
        call's generation prompt not included: counts of parts add up (``counting``)."""
        return count_message_tokens(self.engine, messages, [convert_to_openai_tool(t) for t in tools or ()])

    @property
    def engine(self) -> Engine:
        """The shared engine (created on first use: construction stays cheap)."""
        return self._engine_for(self.model)

    def flush(self) -> None:
        """Wait until every reply so far is saved (caches are written on the engine's save
        thread after a reply leaves: ``response_metadata["cache_saved"] == "pending"``);
        raises the first save that failed since the last ``flush`` (``CacheWriteError``:
        the agent's previous cache is intact)."""
        self.engine.flush()

    def engine_config(self, model: str | None = None) -> EngineConfig:
        """The engine's settings for this model (or ``model``): arguments > ``AGENT_MEMORY_*``."""
        return EngineConfig.resolve(
            model or self.model, cache_dir=self.cache_dir, kv_bits=self.kv_bits, kv_format=self.kv_format,
            hot_budget_bytes=None if self.hot_budget_mb is None else self.hot_budget_mb << 20,
            hot_bytes=self.hot_bytes, tool_ttl_s=self.tool_ttl_s, store=self.store, blocks=self.blocks,
            max_disk_bytes=self.max_disk_bytes, cache_ttl=self.cache_ttl, lazy_store=self.lazy_store,
        )  # fmt: skip

    def _engine_for(self, model: str | None) -> Engine:
        return shared_engine(self.engine_config(model))

    # ------------------------------------------------------------------ batches: an agent per item

    def batch(  # type: ignore[override]
        self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any
    ) -> list[Any]:
        """Every item on its own agent (``fan_out``): they decode together, their shared
        prefix is prefilled once; an explicit ``agent_id`` runs them on it in turn."""
        configs = per_item_configs(inputs, config, self.agent_id, kwargs)
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    async def abatch(  # type: ignore[override]
        self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any
    ) -> list[Any]:
        configs = per_item_configs(inputs, config, self.agent_id, kwargs)
        return await super().abatch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    def batch_as_completed(  # type: ignore[override]
        self, inputs: Sequence[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any
    ) -> Iterator[tuple[int, Any]]:
        configs = per_item_configs(inputs, config, self.agent_id, kwargs)
        yield from super().batch_as_completed(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    async def abatch_as_completed(  # type: ignore[override]
        self, inputs: Sequence[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any
    ) -> AsyncIterator[tuple[int, Any]]:
        configs = per_item_configs(inputs, config, self.agent_id, kwargs)
        batch = super().abatch_as_completed(inputs, configs, return_exceptions=return_exceptions, **kwargs)
        async for item in batch:
            yield item

    # ------------------------------------------------------------------ one call

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, kwargs: dict[str, Any]
    ) -> ChatRequest:
        refuse_unknown_call_options(kwargs)  # ``invoke(..., temprature=0.2)``: named, not ignored
        engine = self._engine_for(kwargs.get("model", self.model))
        metadata = getattr(run_manager, "metadata", None) or ensure_config().get("metadata", {})
        agent = agent_namespace(kwargs.get("agent_id") or self.agent_id, metadata)
        tools: list[dict[str, Any]] = kwargs.get("tools") or []
        choice = kwargs.get("tool_choice")
        if choice == "none":
            tools = []
        fmt = kwargs.get("response_format")
        schema = None
        if fmt is not None:
            schema = fmt.get("schema", {"type": "object"}) if isinstance(fmt, dict) else {"type": "object"}
        template_kwargs = {**(self.chat_template_kwargs or {}), **(kwargs.get("chat_template_kwargs") or {})}
        text = prompt.render(engine.tokenizer, messages, tools or None, schema, **template_kwargs)
        fmt = tool_format(engine.tokenizer)
        stops = [*(self.stop or []), *(stop or [])]
        if not engine.tokenizer.chat_template:
            stops.append(prompt.TRANSCRIPT_TURN_END)
        constraint = None
        forced = forced_tools(tools, choice)
        cap = kwargs.get("max_string_chars", self.max_string_chars)
        if forced:  # one call, in the model's own format, valid under the tool's schema
            constraint = GrammarConstraint(engine.tokenizer, fmt.grammar(forced, cap))
        elif schema is not None:
            constraint = GrammarConstraint(engine.tokenizer, json_schema_grammar(schema, cap))
        params = GenerationParams(
            max_tokens=kwargs.get("max_tokens", self.max_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            top_k=kwargs.get("top_k", self.top_k),
            min_p=kwargs.get("min_p", self.min_p),
            **{k: kwargs.get(k, v) for k, v in self.penalties().items()},
            context_length=self.context_limit,
            seed=kwargs.get("seed", self.seed),
            stop=stops,
            constraint=constraint,
            timeout_s=self.timeout,
            # a LangGraph run resumed from an older checkpoint: a checkpointer rewinds to it
            metadata={"checkpoint_id": metadata["checkpoint_id"]} if metadata.get("checkpoint_id") else {},
            wait_for_save=kwargs.get("wait_for_save", self.wait_for_save),
        )
        thinks = self.reasoning and not forced and schema is None  # constrained replies do not think
        opened = thinks and reasoning.prompt_opens_thinking(text)
        names = tuple(t["function"]["name"] for t in forced)
        return ChatRequest(engine, agent, text, params, fmt if tools else None, names, thinks, opened)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        req = self._request(messages, stop, run_manager, kwargs)
        with langchain_errors():
            return chat_result(req, req.engine.generate(req.agent, req.text, req.params))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        req = self._request(messages, stop, run_manager, kwargs)
        with langchain_errors():
            return chat_result(req, await req.engine.agenerate(req.agent, req.text, req.params))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        req = self._request(messages, stop, run_manager, kwargs)
        shaper = StreamShaper(req)
        with langchain_errors():
            for chunk in req.engine.stream(req.agent, req.text, req.params):
                for out in shaper.feed(chunk.text, chunk.result):
                    if run_manager and out.text:
                        run_manager.on_llm_new_token(out.text, chunk=out)
                    yield out

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        req = self._request(messages, stop, run_manager, kwargs)
        shaper = StreamShaper(req)
        with langchain_errors():
            async for chunk in req.engine.astream(req.agent, req.text, req.params):
                for out in shaper.feed(chunk.text, chunk.result):
                    if run_manager and out.text:
                        await run_manager.on_llm_new_token(out.text, chunk=out)
                    yield out

    # ------------------------------------------------------------------ tools and structure

    def bind(self, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        refuse_unknown_call_options(kwargs)  # ``.bind(temprature=...)`` fails here, not at the call
        return super().bind(**kwargs)

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer ``tools`` (rendered in the system message, see ``prompt``). ``tool_choice``:
        ``"auto"``/None (the model decides), ``"none"``, ``"any"``/``"required"`` (some
        tool), a tool name or ``{"type": "function", "function": {"name": ...}}`` — a forced
        call is decoded under the tool's JSON schema, so it is always a valid call."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = {t["function"]["name"] for t in formatted}
        wanted = choice_name(tool_choice)
        if wanted is not None and wanted not in names:
            raise ValueError(
                f"tool_choice names {wanted!r}, which is not among the bound tools {sorted(names)}"
            )
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Replies parsed into ``schema`` (a Pydantic class, TypedDict, JSON schema or
        OpenAI tool dict). Every method decodes under the schema, so the output parses:
        ``json_schema`` (default: the reply is the JSON object), ``function_calling`` (a
        forced tool call), ``json_mode`` (a JSON object, decoded under ``schema`` too
        unless it is a bare ``{"type": "object"}``: describe the object in the prompt)."""
        kwargs.pop("strict", None)  # decoding is always constrained: every reply is strict
        if kwargs:
            raise ValueError(f"unexpected arguments: {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser: Runnable[Any, Any]
        if method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **ls_format(schema, method))
            if is_pydantic:
                parser = PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
            else:
                parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        elif method in ("json_schema", "json_mode"):
            # json_mode is decoded like json_schema when the schema says more than "an
            # object": stricter than a JSON mode, and the reply always parses into the schema.
            json_schema = json_schema_of(schema)
            llm = self.bind(
                response_format={"type": "json_schema", "schema": json_schema}, **ls_format(schema, method)
            )
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise ValueError(
                f"method must be 'json_schema', 'function_calling' or 'json_mode'; got {method!r}"
            )
        # A reply cut off by max_tokens is an error, not a "repaired" partial object.
        parser = RunnableLambda(whole_reply) | parser
        if not include_raw:
            return llm | parser
        assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | assign.with_fallbacks([fallback], exception_key="parsing_error")
