"""Tool calling's text side: the Hermes `<tool_call>` format parsed back into OpenAI calls, what
may stream as content before a call, and how tools and calls reach a chat template."""

import json

import pytest

from tutorserve.models.tokenizer import Tokenizer
from tutorserve.server.tools import (
    AutoToolCalls,
    NamedToolCall,
    RequiredToolCalls,
    ToolPolicy,
    parse_tool_calls,
    template_messages,
    tool_policy,
)

HINT = {"type": "function", "function": {"name": "hint", "parameters": {"type": "object"}}}


def test_parse_tool_calls_keeps_text_and_malformed_blocks():
    text = (
        'Let me check.<tool_call>\n{"name": "hint", "arguments": {"level": 2}}\n</tool_call>'
        "<tool_call>not json</tool_call>"
        '<tool_call>{"name": "grade", "arguments": {"g": "é"}}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.<tool_call>not json</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("hint", {"level": 2}),
        ("grade", {"g": "é"}),
    ]
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls("  just text ") == ("just text", [])
    assert parse_tool_calls('<tool_call>{"name": "x"}</tool_call>')[0] is None


@pytest.mark.parametrize(
    ("text", "streamable"),
    [
        ("Hello", 5),
        ("Hello <tool", 6),  # may be the start of a tag: held back
        ("Hello <tool_call>{", 6),
        ("a < b", 5),
        ("x<", 1),
    ],
)
def test_auto_streams_content_up_to_a_possible_tag(text, streamable):
    assert AutoToolCalls().streamable(text) == streamable


def test_policies_are_chosen_from_tools_and_tool_choice():
    assert type(tool_policy(None, "auto", True)) is ToolPolicy
    assert type(tool_policy([HINT], "none", True)) is ToolPolicy
    assert type(tool_policy([HINT], None, True)) is AutoToolCalls
    required = tool_policy([HINT], "required", False)
    assert type(required) is RequiredToolCalls and required.constraint["maxItems"] == 1
    named = tool_policy([HINT], {"type": "function", "function": {"name": "hint"}}, True)
    assert type(named) is NamedToolCall and named.constraint == {"type": "object"}
    assert named.finish('{"a": 1}')[1][0]["function"] == {"name": "hint", "arguments": '{"a": 1}'}
    with pytest.raises(ValueError, match="not among"):
        tool_policy([HINT], {"type": "function", "function": {"name": "nope"}}, True)
    assert required.finish('[{"name": "hint", "par')[1] == []  # cut short: no calls


MESSAGES = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Help"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "hint", "arguments": '{"l": 1}'}}]},
    {"role": "tool", "content": "Try 2", "tool_call_id": "c1"},
]  # fmt: skip


def test_a_template_without_tools_gets_them_as_text():
    out = template_messages(MESSAGES, [HINT], native=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be kind.\n\n# Tools")
    assert json.dumps(HINT) in out[0]["content"]
    call = '<tool_call>\n{"name": "hint", "arguments": {"l": 1}}\n</tool_call>'
    assert out[2] == {"role": "assistant", "content": call}
    assert out[3] == {"role": "user", "content": "<tool_response>\nTry 2\n</tool_response>"}


def test_a_template_with_tools_renders_them_itself():
    from tokenizers import Tokenizer as Fast
    from tokenizers import models

    template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}]{% endfor %}{% endfor %}"
    )
    tok = Tokenizer(Fast(models.BPE()), bos_token_id=None, eos_token_ids=[], chat_template=template)
    text = tok.apply_chat_template(template_messages(MESSAGES, [HINT], native=True), tools=[HINT])
    assert text.startswith("[tool hint]<system>Be kind.")
    assert '[call hint {"l": 1}]' in text and "<tool>Try 2" in text
