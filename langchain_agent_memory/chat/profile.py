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

from ..engine import SHIPPED_MODELS, cached_snapshot, parse_repo_id, trained_context


def model_profile(model: str) -> ModelProfile:
    """The profile of ``model`` (a shipped name, an mlx-lm directory, a ``.gguf`` or a Hugging
    Face repo id); what cannot be read cheaply is left out (a repo not downloaded yet: its
    context length and whether it calls tools)."""
    known = _context_and_template(model)
    context, template = known or (None, None)
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
        tool_choice=True,  # forced calls are decoded under the tool's schema
        structured_output=True,  # decoded under the JSON schema: replies always parse
        temperature=True,
    )
    if known is not None:
        # Any model can be offered tools (in its template's format, else Hermes); a model
        # without a chat template (a base model) is not trained to call them.
        profile["tool_calling"] = template is not None
    if context:
        profile["max_input_tokens"] = context
    if template:  # a template that knows thinking: its reasoning is split out (``reasoning``)
        profile["reasoning_output"] = "<think>" in template or "<|channel|>analysis" in template
    return profile


def _context_and_template(model: str) -> tuple[int | None, str | None] | None:
    """The trained context length and the chat template ("" where it is not read here;
    None: no template, a base model); None where the model's files cannot be read here."""
    shipped = SHIPPED_MODELS.get(model)
    if shipped is not None:
        return shipped.context_length, "" if shipped.chat else None
    path = Path(model).expanduser()
    repo = None if path.exists() else parse_repo_id(model)
    if repo is not None:
        # Read from the Hugging Face cache only: constructing a chat model downloads nothing.
        path = cached_snapshot(*repo) or path
    try:
        if path.is_dir():
            return trained_context(path), _template(path)
        if path.is_file() and path.suffix == ".gguf":
            return _gguf_context_and_template(path)
    except (OSError, ValueError, KeyError):  # unreadable here: the engine says why on first use
        pass
    return None


def _template(model_dir: Path) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = model_dir / name
        if f.exists():
            value = json.loads(f.read_text()).get("chat_template")
            if value:
                return value if isinstance(value, str) else json.dumps(value)
    return None


def _gguf_context_and_template(path: Path) -> tuple[int | None, str | None]:
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    context = field(f"{arch}.context_length")
    template = field("tokenizer.chat_template")
    return (int(context) if context else None), (str(template) if template else None)
