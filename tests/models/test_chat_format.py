import json

import pytest

from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, ToolMessage, UserMessage
from closedloop.models.chat_format import parse_completion, render_messages, select_tools, split_reasoning


def test_single_well_formed_call_becomes_tool_call_without_content():
    msg = parse_completion('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>')
    assert msg.content is None
    assert [c.name for c in msg.tool_calls] == ["add"]
    assert msg.tool_calls[0].parsed_arguments() == {"a": 3, "b": 4}


def test_several_calls_and_surrounding_text():
    text = ('Let me compute.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    msg = parse_completion(text)
    assert [c.name for c in msg.tool_calls] == ["add", "get_weather"]
    assert msg.tool_calls[1].parsed_arguments() == {"city": "Oslo"}
    assert msg.content == "Let me compute."
    assert msg.tool_calls[0].id != msg.tool_calls[1].id


def test_malformed_json_keeps_name_and_raw_arguments():
    msg = parse_completion('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": }}\n</tool_call>')
    (call,) = msg.tool_calls
    assert call.name == "add"
    assert call.function.arguments == '{"a": 3, "b": }'
    try:
        call.parsed_arguments()
    except json.JSONDecodeError:
        pass
    else:
        raise AssertionError("malformed arguments must stay malformed so the tool layer reports them")


def test_call_without_name_stays_content_and_never_raises():
    for text in ['<tool_call>{"arguments": {}}</tool_call>', "<tool_call>garbage", "<tool_call>", "", "}{",
                 "<think>", "</think>"]:
        msg = parse_completion(text)
        assert msg.tool_calls is None
    assert "garbage" in parse_completion("<tool_call>garbage").content


def test_unterminated_call_at_length_limit_is_salvaged():
    msg = parse_completion('<tool_call>\n{"name": "multiply", "arguments": {"a": 2')
    assert msg.tool_calls[0].name == "multiply"
    assert msg.tool_calls[0].function.arguments.startswith('{"a": 2')


def test_plain_text_has_no_calls_and_end_marker_is_removed():
    msg = parse_completion("The answer is 7.<|im_end|>")
    assert msg.content == "The answer is 7." and msg.tool_calls is None and msg.reasoning is None


def test_think_block_is_split_into_reasoning():
    msg = parse_completion('<think>\nadd them\n</think>\n<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert msg.reasoning == "add them"
    assert msg.tool_calls[0].name == "add" and msg.content is None
    # Template put <think> in the prompt: the completion starts inside the block.
    assert split_reasoning("plan</think>answer") == ("plan", "answer")
    # Generation cut mid-thought: everything is reasoning.
    assert split_reasoning("<think>still going") == ("still going", "")


def test_render_turns_arguments_into_dicts_and_keeps_malformed_raw():
    messages = [SystemMessage(content="sys"), UserMessage(content="hi"),
                AssistantMessage(content=None, tool_calls=[ToolCall.make("add", {"a": 1}),
                                                           ToolCall.make("add", '{"a": ')]),
                ToolMessage(tool_call_id="x", content="1", name="add")]
    out = render_messages(messages)
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[2]["tool_calls"][1]["function"]["arguments"] == '{"a": '
    assert out[2]["content"] == ""
    assert out[3] == {"role": "tool", "content": "1", "tool_call_id": "x", "name": "add"}


def test_select_tools_follows_tool_choice():
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]
    assert select_tools(tools, "none") is None
    assert select_tools(tools, "auto") == tools
    assert select_tools(tools, {"type": "function", "function": {"name": "b"}}) == [tools[1]]
    try:
        select_tools(tools, {"type": "function", "function": {"name": "zzz"}})
    except ValueError as e:
        assert "zzz" in str(e)
    else:
        raise AssertionError("unknown tool_choice name must be rejected")


@pytest.mark.parametrize("text,reasoning,visible", [
    ("<think>a</think>b", "a", "b"),
    ("a</think>b", "a", "b"),  # the template opened the block in the prompt (Qwen3)
    ("b<think>a", "a", "b"),  # generation stopped mid-thought
    ("x<think>a</think>y<think>b</think>z", "a\nb", "xyz"),  # every block, not only the first
    ("<think>a</think>b</think>c", "a\nb", "c"),
    ("plain", None, "plain"),
])
def test_one_reasoning_rule(text, reasoning, visible):
    from closedloop.evals.tau.orchestrator import strip_reasoning as tau_strip
    from closedloop.models.chat_format import split_reasoning, strip_reasoning

    assert split_reasoning(text) == (reasoning, visible)
    assert strip_reasoning(text) == tau_strip(text) == visible.strip()
