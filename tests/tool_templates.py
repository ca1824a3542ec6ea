"""Chat templates written in four families' tool syntaxes, and a tokenizer stand-in that
renders one: what tool-format tests give ``tool_format`` (random-weight models' tokenizers
get these templates in tests/integration/test_tool_formats.py)."""

from __future__ import annotations

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


class TemplateTokenizer:
    """Enough of a tokenizer for ``tool_format``: a template that jinja renders."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: list, tools: list | None = None, **kwargs: object) -> str:
        import jinja2

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return env.from_string(self.chat_template).render(
            messages=messages, tools=tools, bos_token="", add_generation_prompt=True, raise_exception=None
        )
