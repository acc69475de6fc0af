"""The information-gain clarifier: the IG reward with the tiny model as frozen scorer, the belief,
and the clarifier graph's ask-or-proceed decision."""

import math

import pytest
import torch

from closedloop.agents.clarifier.belief import Belief, BeliefTracker, should_ask
from closedloop.agents.clarifier.reward import (clarification_exchanges, information_gain,
                                                trajectory_information_gain)
from closedloop.agents.clarifier.scorer import GoalScorer
from closedloop.graphs.clarifier import ClarifierContext, graph
from closedloop.messages import AssistantMessage, Trajectory, UserMessage
from closedloop.models.base import SamplingParams
from closedloop.models.scripted import ScriptedClient
from closedloop.runtime import make_checkpointer, with_checkpointer
from closedloop.runtime.convert import as_closedloop

REQUEST = [UserMessage(content="I want to return an item.")]
QUESTION = "Which item do you mean?"
GOALS = ["return the kettle.", "return the lamp.", "return the watch."]


@pytest.fixture(scope="module")
def scorer(scorer_model_path):
    return GoalScorer.from_pretrained(scorer_model_path)


def test_ig_is_clearly_positive_when_the_answer_states_the_goal(scorer):
    for goal in GOALS:
        detail = goal.removeprefix("return ").rstrip(".")
        assert information_gain(scorer, REQUEST, QUESTION, f"It is {detail}.", goal) > 4.0


@pytest.mark.parametrize("answer", ["", "I am not sure.", REQUEST[0].content])  # empty, unhelpful, a repeat
def test_ig_is_near_zero_for_an_uninformative_answer(scorer, answer):
    for goal in GOALS:
        informative = information_gain(scorer, REQUEST, QUESTION, f"It is {goal.removeprefix('return ').rstrip('.')}.", goal)
        uninformative = information_gain(scorer, REQUEST, QUESTION, answer, goal)
        assert abs(uninformative) < 2.0
        assert informative - uninformative > 3.5


def test_ig_is_unchanged_by_a_policy_update(scorer_model_path):
    """The scorer snapshots its model: training the policy it came from does not move the reward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(str(scorer_model_path))
    tok = AutoTokenizer.from_pretrained(str(scorer_model_path))
    frozen = GoalScorer(policy, tok)
    args = (REQUEST, QUESTION, "It is the kettle.", GOALS[0])
    before = information_gain(frozen, *args)
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    batch = tok("The user's goal: return the lamp.", return_tensors="pt")
    for _ in range(3):
        loss = policy(**batch, labels=batch["input_ids"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert information_gain(frozen, *args) == pytest.approx(before, abs=1e-5)
    assert information_gain(GoalScorer(policy, tok), *args) != pytest.approx(before, abs=1e-3)  # the update was real


def test_the_scorer_scores_the_goal_as_the_model_writes_it(scorer):
    """Byte-level BPE puts the prefix's trailing space into the goal's first word (' return'): the
    goal is scored on the tokens of prefix + goal as one string, not as 'return' after a lone ' '
    (a sequence the model never writes, whose log-probability says nothing about the goal)."""
    tok = scorer.tokenizer
    context = scorer._context_text(REQUEST)
    assert context.endswith(": ")
    ctx, goal = scorer._split_ids(context, GOALS[0])
    assert ctx + goal == tok(context + GOALS[0], add_special_tokens=False)["input_ids"]
    assert tok.decode(goal) == " " + GOALS[0]
    with torch.no_grad():
        logp = torch.log_softmax(scorer.model(input_ids=torch.tensor([ctx + goal])).logits[0].float(), -1)
    expected = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(goal))
    assert scorer.logprob(REQUEST, GOALS[0]) == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="empty"):
        scorer.logprob(REQUEST, "")


def test_trajectory_ig_finds_each_exchange_and_batches(scorer):
    traj = Trajectory(messages=[*REQUEST, AssistantMessage(content=QUESTION), UserMessage(content="It is the lamp."),
                                AssistantMessage(content="Done. Anything else?"), UserMessage(content="No.")])
    assert [e.index for e in clarification_exchanges(traj.messages)] == [1, 3]
    gains = trajectory_information_gain(scorer, traj, GOALS[1])
    assert [i for i, _ in gains] == [1, 3]
    assert gains[0][1] == pytest.approx(information_gain(scorer, REQUEST, QUESTION, "It is the lamp.", GOALS[1]), abs=1e-3)


def test_belief_is_a_distribution_and_entropy_gates_asking(scorer):
    belief = BeliefTracker(scorer).belief(REQUEST, GOALS)
    assert math.isclose(sum(belief.probs), 1.0, rel_tol=1e-9) and 0.0 <= belief.normalized_entropy <= 1.0
    told = BeliefTracker(scorer).belief(REQUEST + [AssistantMessage(content=QUESTION),
                                                   UserMessage(content="It is the lamp.")], GOALS)
    assert told.map_goal == GOALS[1]
    assert told.as_dict()[GOALS[1]] > belief.as_dict()[GOALS[1]] + 0.3  # the answer moved mass onto the told goal
    assert should_ask(Belief(["a", "b"], [0.5, 0.5]), threshold=0.5)
    assert not should_ask(Belief(["a", "b"], [0.99, 0.01]), threshold=0.5)
    assert not should_ask(Belief(["a", "b"], [0.5, 0.5]), asked=1, budget=1)


async def test_clarifier_graph_asks_once_then_proceeds(scorer):
    policy = ScriptedClient([AssistantMessage(content="Which item would you like to return?"),
                             AssistantMessage(content="I have started the return.")])
    kept = with_checkpointer(graph, make_checkpointer("memory"))
    context = ClarifierContext(client=policy, scorer=scorer, candidates=lambda msgs: GOALS, threshold=0.0)
    cfg = {"configurable": {"thread_id": "c1"}}
    out = await kept.ainvoke({"messages": REQUEST}, cfg, context=context)
    assert out["messages"][-1].text.endswith("?") and out["scratch"]["decision"] == "ask"
    assert set(out["scratch"]["belief"]) == set(GOALS)
    out = await kept.ainvoke({"messages": [UserMessage(content="It is the lamp.")]}, cfg, context=context)
    assert out["scratch"]["decision"] == "proceed"  # budget of one question spent
    assert out["messages"][-1].text == "I have started the return."


async def test_clarifier_proceeds_when_confident(scorer):
    policy = ScriptedClient([AssistantMessage(content="Sure, done.")])
    out = await graph.ainvoke({"messages": REQUEST}, context=ClarifierContext(
        client=policy, scorer=scorer, candidates=lambda msgs: GOALS[:1]))
    assert out["scratch"]["decision"] == "proceed" and out["messages"][-1].text == "Sure, done."
    context = ClarifierContext(client=ScriptedClient([AssistantMessage(content="ok")]), scorer=scorer,
                               candidates=lambda msgs: GOALS, threshold=1.01)
    assert (await graph.ainvoke({"messages": REQUEST}, context=context))["scratch"]["decision"] == "proceed"


async def test_clarifier_templates_a_question_and_keeps_the_models_reply_out_of_training(scorer):
    policy = ScriptedClient([AssistantMessage(content="ok")])
    out = await graph.ainvoke({"messages": REQUEST}, context=ClarifierContext(
        client=policy, scorer=scorer, candidates=lambda msgs: GOALS, threshold=0.0))
    assert out["messages"][-1].text.startswith("Could you tell me which you mean")
    (turn,) = out["turns"]  # the model call, recorded as generated; the template has no turn
    assert turn.message.text == "ok" and not turn.trainable and turn.purpose == "ask_discarded"


async def test_the_goal_proposal_call_is_recorded_and_marked_not_for_training(scorer):
    """The clarifier's own candidate-proposal call on the policy lands in the turns, in call order,
    marked trainable=False; the question that follows is the policy's (trainable) action."""
    policy = ScriptedClient([AssistantMessage(content="\n".join(GOALS)),
                             AssistantMessage(content="Which item would you like to return?")])
    out = await graph.ainvoke({"messages": REQUEST}, context=ClarifierContext(client=policy, scorer=scorer,
                                                                             threshold=0.0))
    assert len(policy.calls) == 2 and set(out["scratch"]["belief"]) == set(GOALS)
    propose, ask = out["turns"]
    assert (propose.trainable, propose.purpose) == (False, "propose_goals")
    assert propose.message.text.splitlines() == GOALS
    assert (ask.trainable, ask.purpose) == (True, "policy") and ask.message.text.endswith("?")


async def test_token_view_of_a_real_clarifier_episode_skips_the_proposal(scorer, tiny_client):
    """With the real tiny model: the proposal turn carries its tokens (recorded, auditable) but a
    trainer's token view holds only the policy's turns."""
    out = await graph.ainvoke({"messages": REQUEST}, context=ClarifierContext(
        client=tiny_client, scorer=scorer, threshold=0.0, params=SamplingParams(temperature=0, max_tokens=24)))
    turns = out["turns"]
    assert turns[0].purpose == "propose_goals" and not turns[0].trainable and turns[0].completion_ids
    assert turns[0].logprob_spec is not None and turns[0].logprob_spec.backend == "hf"
    trainable = {i for i, t in enumerate(turns) if t.trainable}
    assert trainable, [t.purpose for t in turns]
    views = Trajectory(messages=as_closedloop(out["messages"]), turns=turns).token_view()
    used = {i for v in views for i in v.turn_index if i >= 0}
    assert used == trainable and 0 not in used
    everything = Trajectory(messages=as_closedloop(out["messages"]), turns=turns).token_view(include_untrainable=True)
    assert 0 in {i for v in everything for i in v.turn_index}


def test_clarifier_needs_a_scorer_for_remote_models():
    with pytest.raises(ValueError, match="needs a scorer"):
        ClarifierContext(client=ScriptedClient([]))
