"""A thinking model's reasoning, split from its answer (as ChatOllama does: the reasoning
goes to ``additional_kwargs["reasoning_content"]``, and to a ``reasoning`` content block
for ``output_version="v1"``).

Two shapes are recognised:

- ``<think>...</think>`` before the answer (Qwen 3, DeepSeek-R1, QwQ); a template whose
  generation prompt opens the tag itself (``opened``) has replies that start inside it;
- gpt-oss's channels: ``<|channel|>analysis<|message|>...<|end|>`` is reasoning, the
  ``final`` channel is the answer (``commentary`` holds tool calls: see ``tool_formats``).

``split`` works on a partial reply too (a stream): text that may still become a tag is
held back, so the two parts only ever grow.

>>> split("<think>2+2 is 4.</think>\\n\\nIt is 4.")
('2+2 is 4.', 'It is 4.')
>>> split("2+2 is 4.</think>It is 4.", opened=True)
('2+2 is 4.', 'It is 4.')
>>> split("<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>4")
('Simple.', '4')
>>> split("<thi", partial=True)
('', '')
"""

from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_ANALYSIS = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)(?:<\|end\|>|$)", re.DOTALL)
_HEADER = re.compile(
    r"<\|start\|>assistant|<\|channel\|>\w+(?: to=[\w.\-]+)?(?: <\|constrain\|>\w+)?<\|message\|>"
)
_ENDS = ("<|end|>", "<|return|>", "<|call|>")


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside ``<think>`` (the reply starts reasoning)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN) or tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


def split(text: str, opened: bool = False, partial: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a reply; with ``partial``, of a reply still being generated."""
    if text.lstrip().startswith("<|channel|>") or (partial and "<|channel|>".startswith(text.lstrip())):
        return _split_channels(text, partial)
    body = text if not opened else THINK_OPEN + text
    head = body.lstrip()
    if partial and head and THINK_OPEN.startswith(head) and head != THINK_OPEN:
        return "", ""  # may be the opening tag
    if not head.startswith(THINK_OPEN):
        return "", text
    inner = head[len(THINK_OPEN) :]
    end = inner.find(THINK_CLOSE)
    if end == -1:
        return (inner[: safe_end(inner, THINK_CLOSE)] if partial else inner).strip(), ""
    return inner[:end].strip(), inner[end + len(THINK_CLOSE) :].lstrip()


def _split_channels(text: str, partial: bool) -> tuple[str, str]:
    reasoning = "".join(m for m in _ANALYSIS.findall(text)).strip()
    final_at = text.find("<|channel|>final<|message|>")
    if final_at != -1:
        answer = text[final_at + len("<|channel|>final<|message|>") :]
        for end in _ENDS:
            answer = answer.split(end, 1)[0]
        return _held_any(reasoning, partial), _held_any(answer, partial)
    # No final channel (yet): what is not analysis stays (a commentary tool call).
    rest = _ANALYSIS.sub("", text)
    rest = "" if partial else rest
    return _held_any(reasoning, partial), rest.strip()


def safe_end(text: str, tag: str) -> int:
    """End of the part of ``text`` that cannot be the start of ``tag`` (a stream holds the
    rest back until it knows)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _held_any(text: str, partial: bool) -> str:
    if not partial:
        return text
    cut = text.rfind("<|")
    return text[:cut] if cut != -1 and "|>" not in text[cut:] else text


def strip_headers(text: str) -> str:
    """gpt-oss channel headers left in an answer (no final channel, no call)."""
    return _HEADER.sub("", text).strip()
