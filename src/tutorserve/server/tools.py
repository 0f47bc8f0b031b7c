"""Tool calling in the Hermes format that Qwen2.5 and many open models are trained on.

The tools reach the model through its chat template when the template has a tool format;
otherwise through a system message of ours written the way those templates write it. The model
answers with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, parsed back into
OpenAI `tool_calls`. `tool_choice: "required"` or a named function is not left to the model:
the reply is constrained to a JSON schema (vLLM's choice of shapes: an array of
`{"name", "parameters"}` objects, or the named function's parameters).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPEN_TAG = "<tool_call>"

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, native: bool
) -> list[dict[str, Any]]:
    """OpenAI messages as a chat template takes them. `native`: the template renders tools,
    assistant `tool_calls` (arguments as objects, the HF convention) and `tool` messages itself;
    otherwise they are written out as text in the Hermes format."""
    out = []
    for m in messages:
        calls = [
            {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
            for c in m.get("tool_calls") or []
        ]
        if native:
            hf_calls = [{"type": "function", "function": c} for c in calls]
            out.append(m | ({"tool_calls": hf_calls} if calls else {}))
        elif m["role"] == "assistant" and calls:
            blocks = [f"{OPEN_TAG}\n{json.dumps(c)}\n</tool_call>" for c in calls]
            text = "\n".join([*([m["content"]] if m.get("content") else []), *blocks])
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        else:
            out.append(m)
    if tools and not native:
        listing = _INSTRUCTIONS.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _arguments(arguments: str) -> Any:
    """A call's arguments as the template wants them: an object (kept as the string if it is
    not JSON, so a client's odd history still renders)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A reply's text outside `<tool_call>` blocks (None if empty) and its calls. A block that
    is not a JSON object with a string `name` stays in the text, as the model wrote it."""
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        try:
            body = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(tool_call(body["name"], body.get("arguments", {})))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """`tool_choice: "required"`: one or more calls of the given tools."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": _parameters(t),
                    },
                    "required": ["name", "parameters"],
                }
                for t in tools
            ]
        },
    }


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return _parameters(tool)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def calls_from_required(text: str) -> list[dict[str, Any]]:
    """The calls in a reply constrained by `required_schema`."""
    return [tool_call(c["name"], c["parameters"]) for c in json.loads(text)]


class ToolPolicy:
    """What a request's `tools` and `tool_choice` make of its reply: the constraint on it, how
    much of its text may stream as content so far, and the content and calls it ends as."""

    constraint: dict[str, Any] | None = None  # a JSON schema the reply must match
    offers_tools = False  # whether the prompt lists the tools

    def streamable(self, text: str) -> int:
        return len(text)

    def finish(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return text, []


class AutoToolCalls(ToolPolicy):
    """The model decides; text up to a `<tool_call>` tag streams as content."""

    offers_tools = True

    def streamable(self, text: str) -> int:
        cut = text.find(OPEN_TAG)
        if cut != -1:
            return cut
        # Hold back a tail that may be the start of a tag.
        for k in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
            if OPEN_TAG.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def finish(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse_tool_calls(text)


class RequiredToolCalls(ToolPolicy):
    offers_tools = True

    def __init__(self, tools: list[dict[str, Any]], parallel: bool) -> None:
        self.constraint = required_schema(tools) | ({} if parallel else {"maxItems": 1})

    def streamable(self, text: str) -> int:
        return 0

    def finish(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        try:
            return None, calls_from_required(text)
        except ValueError:  # cut short by max_tokens: not JSON yet
            return text, []


class NamedToolCall(ToolPolicy):
    offers_tools = True

    def __init__(self, tool: dict[str, Any]) -> None:
        self.name = tool["function"]["name"]
        self.constraint = named_schema(tool)

    def streamable(self, text: str) -> int:
        return 0

    def finish(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return None, [tool_call(self.name, text)]


def tool_policy(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool
) -> ToolPolicy:
    """OpenAI's defaults: `auto` when there are tools, `none` when there are none. ValueError for
    a named function that is not among the tools."""
    if not tools or choice == "none":
        return ToolPolicy()
    if choice is None or choice == "auto":
        return AutoToolCalls()
    if choice == "required":
        return RequiredToolCalls(tools, parallel)
    name = choice["function"]["name"]
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return NamedToolCall(tool)
