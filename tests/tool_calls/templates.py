"""Chat templates in the tool-call formats the served families use,
written for these tests (the families' own templates render the same
shapes): a Qwen-style (hermes) one, a Llama-3.1-style (JSON) one and a
Qwen3.5-style (XML tags, ``qwen3_coder``) one."""

from __future__ import annotations

from pathlib import Path

HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, reply with a JSON object within <tool_call></tool_call> tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{- c.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_JSON_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\n"
    "To call a function, reply with JSON only, in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}"
    "{%- for c in m.tool_calls %}"
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' }}{{- c.function.arguments | tojson }}{{- '}' }}"
    "{%- if not loop.last %}{{- '; ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|eom_id|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n# Tools\n\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nTo call a function reply with:\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls %}"
    "{{- '\n<tool_call>\n<function=' + c.function.name + '>\n' }}"
    "{%- for k, v in c.function.arguments | items %}"
    "{{- '<parameter=' + k + '>\n' + (v if v is string else v | tojson) + '\n</parameter>\n' }}"
    "{%- endfor %}"
    "{{- '</function>\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


# SmolLM2's template: every message's role and content, nothing else (no tools, no calls).
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tool_model_dir(folder: Path, template: str) -> Path:
    """The frontend tests' tiny tokenizer folder with ``template`` as its chat template."""
    from transformers import AutoTokenizer

    from tests.frontend.conftest import make_tokenizer_dir

    make_tokenizer_dir(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder
