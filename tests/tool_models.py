"""Tiny checkpoints whose chat templates define tool calls, for the tests of tools (the golden ones' templates have
none): tiny-qwen2 with Qwen2.5's way (its tokenizer given <tool_call> and </tool_call> as added tokens that are not
special, as Qwen2.5's are; a template in the style of Qwen2.5's: the tools in the system turn, calls as
<tool_call> blocks, results as <tool_response> in a user turn) and tiny-llama3 with LLaMA-3.1's JSON tool calling (the
tools in the first user turn, a call as {"name", "parameters"}, one per turn, results in an ipython turn). The
templates are written here, after the formats those models' templates render; the weights are the golden ones
(random: their replies are whatever the grammar lets them be)."""

from __future__ import annotations

import json
import os
from pathlib import Path

HERMES_TEMPLATE = """
{%- set system = messages[0].content if messages[0].role == 'system' else none -%}
{%- if tools -%}
<|im_start|>system
{{ system if system is not none else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif system is not none -%}
<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls -%}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{ '\n' + message.content }}{% endif %}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson
    + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

LLAMA31_TEMPLATE = """
{{- bos_token }}
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}
{%- else %}{% set system = '' %}{% endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{ 'Environment: ipython\\n\\n' }}{% endif %}
{{- system + '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + {'output': message.content} | tojson + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- if message.tool_calls | length > 1 %}{{ raise_exception('one tool call a turn') }}{% endif %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + message.tool_calls[0].function.name
    + '", "parameters": ' + message.tool_calls[0].function.arguments | tojson + '}<|eot_id|>' }}
{%- elif loop.first and tools %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with a JSON for a function '
    'call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format {"name": function '
    'name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
{%- for tool in tools %}{{ tool | tojson(indent=4) + '\\n\\n' }}{% endfor %}
{{- message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}
"""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}, "strict": True}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Time in a zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
                       "required": ["tz"], "additionalProperties": False}}},
]


def _linked(source: Path, target: Path, names) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (source / name).exists():
            os.symlink(source / name, target / name)


def hermes_model(golden: Path, target: Path) -> Path:
    """tiny-qwen2 with Qwen2.5's tool calling (see the module docstring)."""
    import tokenizers

    source = golden / "tiny-qwen2"
    _linked(source, target, ("config.json", "generation_config.json", "model.safetensors"))
    tok = tokenizers.Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_tokens([tokenizers.AddedToken("<tool_call>", special=False, normalized=False),
                    tokenizers.AddedToken("</tool_call>", special=False, normalized=False)])
    tok.save(str(target / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE.strip()}))
    return target


def llama31_model(golden: Path, target: Path) -> Path:
    """tiny-llama3 with LLaMA-3.1's JSON tool calling (see the module docstring)."""
    source = golden / "tiny-llama3"
    _linked(source, target, ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA31_TEMPLATE.strip()}))
    return target
