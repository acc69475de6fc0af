"""LLM Orchestration (paper 4): the control-token grammar and re-prompting, the memory hit, an
expert swap by configuration, and barge-in cancelling speech."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

from closedloop.agents.orchestrator import GrammarError, load_config, parse_program
from closedloop.agents.orchestrator.experts import ExpertPool
from closedloop.agents.orchestrator.interaction import Player, Session, ToneTTS
from closedloop.graphs.orchestrator import APOLOGY, OrchestratorContext, graph
from closedloop.memory.cross_modal import CrossModalMemory, MemoryRecord
from closedloop.messages import AssistantMessage, ImagePart, TextPart, UserMessage
from closedloop.models.scripted import ScriptedClient

EXPERTS = {"vision": "image", "llm": "text", "asr": "audio"}


def png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((32, 32, 3)) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


# ------------------------------------------------------------------ grammar


def test_grammar_parses_programs():
    prog = parse_program('<call expert="vision" source="image:0">what animal?</call>\n'
                         '<call expert="llm">is it dangerous?</call><speak>A cat; harmless.</speak>',
                         EXPERTS, {"image": 1})
    assert [a.kind for a in prog] == ["call", "call", "speak"]
    assert (prog[0].expert, prog[0].source, prog[0].query) == ("vision", "image:0", "what animal?")
    assert [a.kind for a in parse_program("<listen/>", EXPERTS, {})] == ["listen"]
    assert [a.kind for a in parse_program(" <interrupt /> ", EXPERTS, {})] == ["interrupt"]


@pytest.mark.parametrize("text,reason", [
    ("Sure! <speak>hi</speak>", "text outside control tokens"),
    ('<call expert="painter">draw</call>', "unknown expert 'painter'"),
    ('<call expert="vision">what?</call>', 'give source="image:N"'),
    ('<call expert="vision" source="image:1">what?</call>', "does not exist"),
    ('<call expert="vision" source="audio:0">what?</call>', "reads image, not audio"),
    ("<speak>a</speak><speak>b</speak>", "must be the last action"),
    ("<speak> </speak>", "<speak> is empty"),
    ("", "no control tokens"),
])
def test_grammar_rejects_with_a_reason(text, reason):
    with pytest.raises(GrammarError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse_program(text, EXPERTS, {"image": 1, "audio": 1})


# ------------------------------------------------------------------ graph: re-prompting, memory, swap


class EchoVision(ScriptedClient):
    """A stand-in vision model that reports the size of the image it got (its call count is the test)."""

    def __init__(self):
        super().__init__(lambda msgs: AssistantMessage(content="a picture"))


def config(tmp_path, vision_model: str, name="experts.yaml"):
    path = tmp_path / name
    path.write_text(f"""
controller: {{model: scripted}}
experts:
  vision: {{kind: model, model: "{vision_model}", modality: image, description: reads images}}
  calc: {{kind: tool, tool: "arithmetic:add", modality: text, description: adds numbers}}
tts: {{engine: tone}}
""")
    return load_config(path)


def image_question(data: bytes, text="What is in this picture?") -> UserMessage:
    return UserMessage(content=[TextPart(text=text), ImagePart.from_bytes(data)])


def test_invalid_tokens_are_reprompted_and_counted(tmp_path):
    cfg = config(tmp_path, "hf:unused")
    controller = ScriptedClient([AssistantMessage(content="I think it is a cat."),
                                 AssistantMessage(content='<call expert="calc">{"a": 2, "b": 3}</call>'),
                                 AssistantMessage(content="<speak>It is 5.</speak>")])
    context = OrchestratorContext(client=controller, experts=ExpertPool(cfg))
    out = asyncio.run(graph.ainvoke({"messages": [UserMessage(content="2+3?")], "scratch": {}}, context=context))
    assert out["scratch"]["reprompts"] == 1 and out["scratch"]["final"] == {"kind": "speak", "text": "It is 5."}
    assert "Invalid control tokens: text outside control tokens" in controller.calls[1][-1].text
    assert "-> 5" in controller.calls[2][-1].text  # the tool expert's output came back
    stubborn = ScriptedClient([AssistantMessage(content="no")], cycle=True)
    out = asyncio.run(graph.ainvoke({"messages": [UserMessage(content="?")], "scratch": {}},
                                    context=OrchestratorContext(client=stubborn, experts=cfg, max_reprompts=2)))
    assert out["scratch"]["reprompts"] == 3 and out["scratch"]["final"]["text"] == APOLOGY


def asking_controller():
    """Asks the vision expert about image:0 when the turn has an image and no results yet, then speaks."""
    def reply(msgs):
        last = msgs[-1].text
        if last.startswith("Expert results:"):
            return AssistantMessage(content=f"<speak>{last.split('-> ', 1)[1]}</speak>")
        return AssistantMessage(content='<call expert="vision" source="image:0">What is in this picture?</call>')
    return ScriptedClient(reply)


def test_repeated_question_about_the_same_image_is_answered_from_memory(tmp_path):
    vision = EchoVision()
    pool = ExpertPool(config(tmp_path, "hf:unused"), clients={"vision": vision})
    memory = CrossModalMemory(tmp_path / "memory.duckdb")
    context = OrchestratorContext(client=asking_controller(), experts=pool, memory=memory)

    def ask(data, text="What is in this picture?"):
        return asyncio.run(graph.ainvoke({"messages": [image_question(data, text)], "scratch": {}}, context=context))

    first = ask(png(0))
    assert pool.calls["vision"] == 1 and first["scratch"]["final"]["text"] == "a picture"
    again = ask(png(0), "what is in this picture")  # same bytes, same question up to case/punctuation
    assert pool.calls["vision"] == 1 and again["scratch"]["memory_hits"] == 1
    ask(png(1))  # another image: a real call
    assert pool.calls["vision"] == 2 and len(memory) == 2
    [rec] = memory.search("picture of something", k=1)
    assert rec.expert == "vision" and rec.modality == "image"
    memory.close()
    assert len(CrossModalMemory(tmp_path / "memory.duckdb")) == 2  # it persists


def test_swapping_an_expert_is_configuration_only(tmp_path, tiny_vlm_path, tiny_model_path):
    from closedloop.models.tiny_vlm import build_tiny_vlm

    other = build_tiny_vlm(tmp_path / "other-vlm", tiny_model_path, seed=1)  # another vision tower
    outputs = {}
    for name, spec in (("a", f"hf:{tiny_vlm_path}"), ("b", f"hf:{other}")):
        controller = asking_controller()
        pool = ExpertPool(config(tmp_path, spec, f"{name}.yaml"))
        asyncio.run(graph.ainvoke({"messages": [image_question(png(0))], "scratch": {}},
                                  context=OrchestratorContext(client=controller, experts=pool)))
        outputs[name] = (pool.client("vision").spec, pool.calls["vision"], controller.calls[0])
    assert outputs["a"][0] != outputs["b"][0] and outputs["a"][1] == outputs["b"][1] == 1
    assert outputs["a"][2] == outputs["b"][2]  # the controller saw exactly the same first prompt


# ------------------------------------------------------------------ barge-in


def test_barge_in_cancels_speech_and_yields_the_turn(tmp_path):
    controller = ScriptedClient(lambda msgs: AssistantMessage(
        content="<speak>" + ("a long answer " * 20) + "</speak>" if "long" in msgs[-1].text else "<speak>ok</speak>"))
    context = OrchestratorContext(client=controller, experts=ExpertPool(config(tmp_path, "hf:unused")))
    heard: list[bytes] = []
    session = Session(graph, context, tts=ToneTTS(), player=Player(chunk_ms=10, sink=heard.append))

    async def run():
        await session.ask("tell me something long")
        total = sum(1 for _ in range(0, len(ToneTTS().synthesize("a long answer " * 20)), 320))
        while session.player.played < 3:
            await asyncio.sleep(0.005)
        state = await session.ask("stop, another question")  # barge-in: the user talks over the answer
        played_when_cut = len(heard)
        await asyncio.sleep(0.05)
        return total, played_when_cut, state

    total, played_when_cut, state = asyncio.run(run())
    assert session.interrupted == 1 and len(session.barge_in_latencies_s) == 1
    assert 3 <= played_when_cut < total  # the first answer was cut off mid-way
    assert state["scratch"]["final"]["text"] == "ok"  # and the new turn was answered


def test_memory_records_roundtrip(tmp_path):
    m = CrossModalMemory()
    r = m.add(MemoryRecord(modality="audio", source="ab" * 32, expert="asr", query="transcribe", summary="hello"))
    assert m.lookup("ab" * 32, expert="asr").summary == "hello" and m.lookup("cd" * 32) is None
    assert m.by_source("ab" * 32)[0].id == r.id and m.hits == 1
