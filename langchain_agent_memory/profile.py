"""What a model can do, in LangChain's ``ModelProfile`` terms (``ChatAgentMemory.profile``,
read by LangChain's middleware: summarization and trimming use ``max_input_tokens``).

Read from the model's files without loading it: the profile is resolved when the chat
model is constructed, which must stay cheap (the engine loads on first use).

>>> p = model_profile("smollm2-135m")
>>> p["max_input_tokens"], p["tool_calling"], p["image_inputs"]
(8192, True, False)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from langchain_core.language_models.model_profile import ModelProfile

from .engine.model.loading import SHIPPED_MODELS, trained_context


def model_profile(model: str) -> ModelProfile:
    """The profile of ``model`` (a shipped name, an mlx-lm directory or a ``.gguf``); what
    cannot be read cheaply is left out."""
    context, chat = _context_and_chat(model)
    profile = ModelProfile(
        name=model,
        open_weights=True,
        text_inputs=True,
        image_inputs=False,
        audio_inputs=False,
        video_inputs=False,
        pdf_inputs=False,
        text_outputs=True,
        image_outputs=False,
        audio_outputs=False,
        video_outputs=False,
        # Any model can be offered tools (in its template's format, else Hermes); a model
        # without a chat template (a base model) is not trained to call them.
        tool_calling=chat,
        tool_choice=True,  # forced calls are decoded under the tool's schema
        structured_output=True,  # decoded under the JSON schema: replies always parse
        temperature=True,
    )
    if context:
        profile["max_input_tokens"] = context
    return profile


def _context_and_chat(model: str) -> tuple[int | None, bool]:
    shipped = SHIPPED_MODELS.get(model)
    if shipped is not None:
        return shipped.context_length, shipped.chat
    path = Path(model).expanduser()
    try:
        if path.is_dir():
            return trained_context(path), _has_chat_template(path)
        if path.is_file() and path.suffix == ".gguf":
            return _gguf_context_and_chat(path)
    except (OSError, ValueError, KeyError):  # unreadable here: the engine says why on first use
        pass
    return None, True


def _has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").exists() or (model_dir / "chat_template.json").exists():
        return True
    config = model_dir / "tokenizer_config.json"
    return config.exists() and bool(json.loads(config.read_text()).get("chat_template"))


def _gguf_context_and_chat(path: Path) -> tuple[int | None, bool]:
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    context = field(f"{arch}.context_length")
    return (int(context) if context else None), field("tokenizer.chat_template") is not None
