"""Messages, turns and trajectories: OpenAI wire format and lossless JSON."""

import json

import pytest
from pydantic import ValidationError

from closedloop.messages import (AssistantMessage, MissingTokensError, AudioPart, ImagePart, SystemMessage, TextPart, ToolCall,
                                 ToolMessage, Trajectory, Turn, Usage, UserMessage, parse_messages)


def test_multimodal_content_matches_openai_parts(tmp_path):
    img = tmp_path / "x.png"
    img.write_bytes(b"\x89PNGfake")
    msg = UserMessage(content=[TextPart(text="what is this?"), ImagePart.from_path(img),
                               ImagePart.from_url("https://example.org/a.jpg", detail="low"),
                               AudioPart.from_bytes(b"RIFF", format="wav")])
    wire = msg.to_openai()
    assert wire["content"][0] == {"type": "text", "text": "what is this?"}
    assert wire["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert wire["content"][2] == {"type": "image_url", "image_url": {"url": "https://example.org/a.jpg", "detail": "low"}}
    assert wire["content"][3] == {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    # and back: the wire dicts validate into the same typed message
    assert parse_messages([wire])[0] == msg


def test_parse_rejects_unknown_role_and_fields():
    with pytest.raises(ValidationError):
        parse_messages([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValidationError):
        parse_messages([{"role": "user", "content": "hi", "bogus": 1}])


def test_tool_call_arguments_keep_malformed_json():
    call = ToolCall.make("add", '{"a": 1,')
    assert call.function.arguments == '{"a": 1,'
    with pytest.raises(json.JSONDecodeError):
        call.parsed_arguments()
    assert ToolCall.make("add", {"a": 1}).parsed_arguments() == {"a": 1}


def test_reasoning_and_tool_error_are_not_sent_on_the_wire():
    assert "reasoning" not in AssistantMessage(content="hi", reasoning="secret").to_openai()
    assert "error" not in ToolMessage(tool_call_id="c", content="Error: x", error="x").to_openai()


def test_turn_validates_token_lengths_and_fills_mask():
    t = Turn(message=AssistantMessage(content="x"), prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-1.0, -2.0])
    assert t.loss_mask == [0, 0, 0, 1, 1]
    with pytest.raises(ValidationError):
        Turn(message=AssistantMessage(content="x"), prompt_ids=[1], completion_ids=[4, 5], logprobs=[-1.0])
    with pytest.raises(ValidationError):
        Turn(message=AssistantMessage(content="x"), prompt_ids=[1], completion_ids=[4], loss_mask=[1])


def test_trajectory_round_trips_json_losslessly():
    traj = Trajectory(
        messages=[SystemMessage(content="sys"), UserMessage(content=[TextPart(text="hi"), ImagePart.from_bytes(b"i")]),
                  AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 1, "b": 2})], reasoning="think"),
                  ToolMessage(tool_call_id="c1", name="add", content="3")],
        turns=[Turn(message=AssistantMessage(content="3"), prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5],
                    usage=Usage(prompt_tokens=2, completion_tokens=1, cost_usd=0.001))],
        rewards={"success": 1.0}, step_rewards=[0.5, None], metadata={"task": "t1"})
    back = Trajectory.from_json(traj.to_json())
    assert back == traj
    assert back.to_json() == traj.to_json()
    assert back.usage.total_tokens == 3


def test_token_view_merges_continuing_turns_and_splits_rewritten_context():
    a = Turn(message=AssistantMessage(content="a"), prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1])
    b = Turn(message=AssistantMessage(content="b"), prompt_ids=[1, 2, 3, 9, 9], completion_ids=[4, 5], logprobs=[-0.2, -0.3])
    c = Turn(message=AssistantMessage(content="c"), prompt_ids=[7, 8], completion_ids=[6], logprobs=[-0.4])
    views = Trajectory(turns=[a, b, c]).token_view()
    assert len(views) == 2
    assert views[0].input_ids == [1, 2, 3, 9, 9, 4, 5]
    assert views[0].loss_mask == [0, 0, 1, 0, 0, 1, 1]
    assert views[0].logprobs == [0.0, 0.0, -0.1, 0.0, 0.0, -0.2, -0.3]
    assert views[1].input_ids == [7, 8, 6] and views[1].loss_mask == [0, 0, 1]
    with pytest.raises(ValueError):
        Trajectory(turns=[Turn(message=AssistantMessage(content="x"))]).token_view()


def test_token_view_honours_recorded_masks_and_turn_indices():
    # Turn a's last completion token was marked untrainable (e.g. a truncated stop marker).
    a = Turn(message=AssistantMessage(content="a"), prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.1, -0.2],
             loss_mask=[0, 0, 1, 0])
    b = Turn(message=AssistantMessage(content="b"), prompt_ids=[1, 2, 3, 4, 9], completion_ids=[5], logprobs=[-0.3])
    (view,) = Trajectory(turns=[a, b]).token_view()
    assert view.input_ids == [1, 2, 3, 4, 9, 5]
    assert view.loss_mask == [0, 0, 1, 0, 0, 1]
    assert view.logprob_mask == [0, 0, 1, 0, 0, 1]
    assert view.turn_index == [-1, -1, 0, -1, -1, 1]


def test_token_view_never_invents_logprobs():
    a = Turn(message=AssistantMessage(content="a"), prompt_ids=[1], completion_ids=[2, 3], logprobs=None,
             unavailable={"logprobs": "the server does not return them"})
    b = Turn(message=AssistantMessage(content="b"), prompt_ids=[1, 2, 3, 7], completion_ids=[4], logprobs=[-0.5])
    (view,) = Trajectory(turns=[a, b]).token_view()  # default: mask missing logprobs out
    assert view.loss_mask == [0, 1, 1, 0, 1]
    assert view.logprob_mask == [0, 0, 0, 0, 1]
    assert view.logprobs[-1] == -0.5
    with pytest.raises(MissingTokensError, match="server does not return them"):
        Trajectory(turns=[a, b]).token_view(missing_logprobs="refuse")


def test_token_view_skips_untrainable_helper_calls():
    helper = Turn(message=AssistantMessage(content="goals"), prompt_ids=[5, 5], completion_ids=[6], logprobs=[-1.0],
                  trainable=False, purpose="propose_goals")
    a = Turn(message=AssistantMessage(content="a"), prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1])
    b = Turn(message=AssistantMessage(content="b"), prompt_ids=[1, 2, 3, 4], completion_ids=[8], logprobs=[-0.2])
    views = Trajectory(turns=[a, helper, b]).token_view()
    assert [v.input_ids for v in views] == [[1, 2, 3, 4, 8]]
    assert views[0].turn_index == [-1, -1, 0, -1, 2]
    assert len(Trajectory(turns=[a, helper, b]).token_view(include_untrainable=True)) == 3
    no_ids = Turn(message=AssistantMessage(content="x"), unavailable={"token_ids": "no token ids from this server"})
    with pytest.raises(MissingTokensError, match="no token ids from this server"):
        Trajectory(turns=[no_ids]).token_view()
