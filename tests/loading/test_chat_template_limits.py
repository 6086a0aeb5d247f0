"""Every operation that can build a large value in a chat template is bounded before it runs (issue 34, item 4):
filters, `+`, `~`, str methods; while real templates (ChatML, Llama-3 style) still render."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from leanlm.loading.chat_template import ChatTemplateError, render_chat_template

MESSAGES = [{"role": "system", "content": " Be terse. "}, {"role": "user", "content": "2+2?"}]

OVER_100 = {
    "center": "{% set x = 'a'|center(1000) %}",
    "list +": "{% set x = [1, 2, 3] * 20 %}{% set y = x + x %}",
    "str +": "{% set x = 'a' * 60 %}{% set y = x + x %}",
    "~": "{% set x = 'a' * 60 %}{% set y = x ~ x %}",
    "join": "{% set x = ('a' * 50)|list|join('xxxx') %}",
    "str.join": "{% set x = 'xxxxxxxxxx'.join(['a'] * 20) %}",
    "format": "{% set x = '%s%s%s'|format('a' * 40, 'a' * 40, 'a' * 40) %}",
    "str.format": "{% set x = '{0}{0}{0}'.format('a' * 40) %}",
    "%": "{% set x = '%s%s%s' % ('a' * 40, 'a' * 40, 'a' * 40) %}",
    "indent": "{% set x = ('a\n' * 40)|indent(10) %}",
    "replace": "{% set x = ('a' * 50)|replace('a', 'bbbbb') %}",
    "str.replace": "{% set x = ('a' * 50).replace('a', 'bbbbb') %}",
    "wordwrap": "{% set x = ('a ' * 45)|wordwrap(1, wrapstring='xxxxxxxx') %}",
    "batch": "{% set x = [1]|batch(1000, 0)|list %}",
    "tojson": "{% set x = [[[1, 2, 3]]]|tojson(indent=100) %}",
    "expandtabs": "{% set x = ('\t' * 10).expandtabs(50) %}",
    "block": "{% set x %}{% for i in range(50) %}aaa{% endfor %}{% endset %}",
    "printed list": "{% set l = ['a' * 50, 'a' * 50] %}{{ [l, l] }}",
}


@pytest.mark.parametrize("source", OVER_100.values(), ids=OVER_100.keys())
def test_each_operation_is_refused_past_the_limit_before_it_runs(source):
    with pytest.raises(ChatTemplateError, match="100-character limit"):
        render_chat_template(source, MESSAGES, max_chars=100)


def test_the_same_operations_under_the_limit_render():
    source = (
        "{{ 'a'|center(3) }}|{{ ([1] + [2])|join(',') }}|{{ 'x' ~ 'y' + 'z' }}|{{ '%s-%s'|format(1, 2) }}|"
        "{{ 'a\nb'|indent(2) }}|{{ 'aa'|replace('a', 'bc') }}|{{ '{}!'.format('hi') }}|{{ [1, 2]|tojson(indent=1) }}"
    )
    assert render_chat_template(source, MESSAGES, max_chars=200) == " a |1,2|xyz|1-2|a\n  b|bcbc|hi!|[\n 1,\n 2\n]"


def test_a_doubling_loop_stops_at_the_limit_in_bounded_time_and_memory():
    """Before: `~` was unchecked, each doubling one C call the time limit cannot interrupt; 256 MiB in 0.3 s."""
    source = "{% set ns = namespace(x='a') %}{% for i in range(100) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}"
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ChatTemplateError, match="limit"):
            render_chat_template(source, MESSAGES)  # the default 8M-character limit
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 2.0
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated"


def test_a_filter_is_not_folded_into_a_constant_at_compile_time():
    """Jinja evaluates constant filter calls while compiling, outside any render's limit."""
    source = "{% set x = 'a'|center(150) %}ok"
    assert render_chat_template(source, MESSAGES, max_chars=200) == "ok"
    with pytest.raises(ChatTemplateError, match="100-character limit"):
        render_chat_template(source, MESSAGES, max_chars=100)  # same source: compiled once, cached


# Llama-3's shape: a namespace flag, `|trim`, `+` and `~` on short strings, loop.first, a system message.
LLAMA3_STYLE = (
    "{{- bos_token }}{% set ns = namespace(system='') %}"
    "{% if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content']|trim %}"
    "{% set messages = messages[1:] %}{% endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + ns.system + '<|eot_id|>' }}"
    "{% for message in messages %}{% if loop.first %}{% set prefix = '' %}{% else %}{% set prefix = '\\n' %}{% endif %}"
    "{{- prefix ~ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content']|trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_a_llama3_style_template_renders():
    text = render_chat_template(LLAMA3_STYLE, MESSAGES, bos_token="<s>", max_chars=1000)
    assert text == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# Qwen2.5's shape: tools rendered with tojson, tool calls, `loop.last`, `.startswith`, string `+`.
QWEN_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{{- messages[0]['content'] if messages[0]['role'] == 'system' "
    "else 'You are Qwen.' }}{{- '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not tools) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    '{%- for tool_call in message.tool_calls %}{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.function.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_qwen_style_template_with_tools_renders():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = render_chat_template(QWEN_STYLE, messages, tools=tools, max_chars=2000)
    assert text == (
        "<|im_start|>system\n Be terse. \n\n# Tools\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools><|im_end|>\n'
        "<|im_start|>user\n2+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
