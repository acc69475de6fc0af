"""Client capabilities are declared (runtime-checkable Protocols in ``closedloop.models.base``), and
what each capability gates behaves by the declaration: a local ``hf:`` client has them all but a
weight loader of its own, a scripted client none; the weight loader refuses a client without one."""

from __future__ import annotations

import pytest

from closedloop.messages import AssistantMessage, MessageBase, ToolMessage, UserMessage, parse_messages
from closedloop.models.base import EndMarkers, LoadsWeights, LocalTokenizer, Pausable, ReportsBatches
from closedloop.models.hf import HFClient
from closedloop.models.scripted import ScriptedClient
from closedloop.models.weights import UnsupportedBackend, load_weights_into


def test_a_local_hf_client_declares_what_it_can_do(tiny_model_path):
    client = HFClient.from_pretrained(tiny_model_path)
    assert isinstance(client, Pausable) and isinstance(client, ReportsBatches)
    assert isinstance(client, LocalTokenizer) and isinstance(client, EndMarkers)
    assert not isinstance(client, LoadsWeights)  # its weights are copied in under paused(), not loaded by it
    with client.paused():
        assert client.weights_lock._is_owned()  # type: ignore[attr-defined]
    assert client.batch_stats()["batches"] == 0


def test_a_scripted_client_declares_nothing_and_weight_loads_refuse_it():
    client = ScriptedClient([AssistantMessage(content="hi")])
    assert not any(isinstance(client, cap) for cap in (Pausable, ReportsBatches, LoadsWeights, LocalTokenizer,
                                                       EndMarkers))
    with pytest.raises(UnsupportedBackend, match="no local weights"):
        load_weights_into(client, {})


def test_every_message_is_a_message_base():
    parsed = parse_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                             {"role": "tool", "tool_call_id": "c", "content": "d"}])
    assert all(isinstance(m, MessageBase) for m in parsed)
    assert isinstance(parsed[0], UserMessage) and isinstance(parsed[2], ToolMessage)
