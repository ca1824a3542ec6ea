"""Each model's own tool-call format (``tool_formats``): random-weight models of four
families, each given a chat template written here in its family's tool syntax, get their
tools through the template, forced calls decoded in that syntax (so even random weights
produce a valid call), calls and results written back as the template expects; SmolLM2's
plain ChatML keeps the Hermes fallback."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from langchain_agent_memory import ChatAgentMemory, prompt
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.model.random_model import SMALL_CONFIGS, write_random_model
from langchain_agent_memory.tool_formats import HERMES, tool_format

QWEN = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{{- bos_token }}{#- calls may start with <|python_tag|> and end with <|eom_id|> #}
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}\
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
<|start_header_id|>system<|end_header_id|>

Environment: ipython
{{ system_message }}<|eot_id|>
{%- for message in messages %}
{%- if loop.first and tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, respond with a JSON for a function call: \
{"name": function name, "parameters": dictionary of argument name and its value}.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", \
"parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{ bos_token }}{%- for message in messages %}
{%- if message.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}\
[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'system' %}[SYSTEM_PROMPT]{{ message.content }}[/SYSTEM_PROMPT]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][\
{%- for tc in message.tool_calls %}{% if tc.id is not string or tc.id | length != 9 %}\
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}\
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}\
{% if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif message.role == 'assistant' %}{{ message.content }}</s>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif %}{%- endfor %}"""

HARMONY = """<|start|>system<|message|>You are a helpful assistant.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for t in tools %}// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}} // namespace functions<|end|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}{% for tc in message.tool_calls %}\
<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json\
<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif message.role == 'tool' %}<|start|>functions.{{ message.name }} to=assistant<|channel|>\
commentary<|message|>{{ message.content | tojson }}<|end|>
{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>\
{{ message.content }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

#: family -> (template, format name, what the rendered tool listing contains)
CASES = {
    "qwen3": (QWEN, "json_tools", "<tools>"),
    "llama": (LLAMA3, "llama3", "Given the following functions"),
    "mistral": (MISTRAL, "mistral", "[AVAILABLE_TOOLS]"),
    "gpt_oss": (HARMONY, "harmony", "namespace functions"),
}


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def family_model(tmp_path_factory: pytest.TempPathFactory, smollm: LoadedModel) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tool-formats")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            out = write_random_model(SMALL_CONFIGS[family], root / family, smollm.path, seed=3)
            config_path = out / "tokenizer_config.json"
            config = json.loads(config_path.read_text())
            config["chat_template"] = CASES[family][0]
            config_path.write_text(json.dumps(config))
            (out / "chat_template.jinja").unlink(missing_ok=True)
            built[family] = out
        return built[family]

    return get


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_family_calls_tools_in_its_own_format(
    family: str, family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    _, fmt_name, listing = CASES[family]
    llm = ChatAgentMemory(model=str(family_model(family)), cache_dir=str(tmp_path), max_tokens=300)
    tok = llm.engine.tokenizer
    fmt = tool_format(tok)
    assert fmt.name == fmt_name and fmt.native
    question = [SystemMessage("You check the weather."), HumanMessage("Weather in Paris?")]
    rendered = prompt.render(tok, question, [_openai(get_weather)])
    assert listing in rendered and "get_weather" in rendered
    assert prompt.TOOLS_PREAMBLE not in rendered  # the template's listing, not the Hermes fallback
    # A forced call: decoded in the family's syntax, so it parses even from random weights.
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(question)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather", reply
    assert isinstance(reply.tool_calls[0]["args"].get("city"), str)
    # The call and its result go back through the template (Mistral's 9-character ids too).
    result = ToolMessage("sunny, 24 C", tool_call_id=reply.tool_calls[0]["id"], name="get_weather")
    history = [*question, reply, result]
    again = llm.bind_tools([get_weather]).invoke(history, max_tokens=4)
    assert again.usage_metadata is not None and again.usage_metadata["input_tokens"] > 0


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def test_replies_parse_in_each_format() -> None:
    fmts = {f: tool_format(_FakeTokenizer(CASES[f][0])) for f in CASES}
    samples = {
        "qwen3": f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>",
        "llama": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "gpt_oss": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + '{"city": "Oslo"}<|call|>',
    }
    for family, text in samples.items():
        content, calls, invalid = fmts[family].parse(text)
        assert [(c["name"], c["args"]) for c in calls] == [("get_weather", {"city": "Oslo"})], family
        assert not invalid and "get_weather" not in content
    # prose is prose
    assert fmts["llama"].parse("{curly} is not a call")[1] == []
    assert fmts["qwen3"].parse("no call here") == ("no call here", [], [])


def test_smollm2_keeps_the_hermes_fallback(smollm: LoadedModel) -> None:
    assert tool_format(smollm.tokenizer) is HERMES
    rendered = prompt.render(smollm.tokenizer, [HumanMessage("Weather?")], [_openai(get_weather)])
    assert prompt.TOOLS_PREAMBLE in rendered


def _openai(t: object) -> dict:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(t)  # type: ignore[arg-type]


class _FakeTokenizer:
    """Enough of a tokenizer for ``tool_format``: a template that jinja renders."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: list, tools: list | None = None, **kwargs: object) -> str:
        import jinja2

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return env.from_string(self.chat_template).render(
            messages=messages, tools=tools, bos_token="", add_generation_prompt=True, raise_exception=None
        )


def test_ai_messages_without_calls_render_as_text(
    family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    llm = ChatAgentMemory(model=str(family_model("qwen3")), cache_dir=str(tmp_path), max_tokens=2)
    rendered = prompt.render(
        llm.engine.tokenizer, [HumanMessage("Hi"), AIMessage("Hello!"), HumanMessage("Bye")]
    )
    assert "Hello!" in rendered and "<tool_call>" not in rendered.split("Hello!")[1]
