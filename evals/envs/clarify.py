"""``clarify``: find a hidden goal among N candidates by asking questions.

Why this environment: the information-gain clarifier (``agents/clarifier``) estimates how much a
question tells it about the user's goal with a learned scorer. Here the same quantity is exact,
so a trainer can reward information gain per turn and an experiment can count uninformative
questions without any model in the loop.

An episode: a catalogue of ``n_candidates`` items of one category, each a distinct combination of
``n_attributes`` attribute values (colour, size, material, ...), is shown in the system prompt;
the user's opening request names only the category ("I'm looking for a jacket."). One item is the
hidden goal. The agent has two tools:

- ``ask(attribute)``: the rule-based user answers truthfully with the goal's value for that
  attribute ("The colour I want is red."). Questions are tool calls over a fixed attribute set,
  not free text, so that the answer, and therefore the posterior and the information gain, is
  exact. An unknown attribute is a tool error (the episode continues, the turn is paid).
- ``submit(candidate_id)``: ends the episode; success when it is the goal. An id not in the
  catalogue is a tool error and the episode continues.

A text reply without tool calls gets a user nudge and the episode continues.

Options for small models (defaults keep the levels above unchanged): ``attribute_values`` replaces
the attribute → values table (e.g. words a tiny tokenizer holds as single tokens, and a fixed pair
of attributes, so a policy never has to spell a name it has not seen); ``item_ids="values"`` names
each item by its values joined with spaces in the catalogue's attribute order (``red small``)
instead of ``c1..cN``, so a policy that has asked every attribute can submit by copying the
answers, without the catalogue lookup a 2-layer model does not learn in a few hundred SFT steps
(the question policy is then what matters); ``expert_noise`` makes the scripted expert a
realistic, imperfect clarifier (some demonstrations contain uninformative questions, so SFT
starts with some to remove).

Belief: with a uniform prior over the catalogue and truthful answers, the posterior is uniform over
the candidates consistent with every answer so far (:func:`posterior`). The information gain of a
question is the realised entropy drop ``H(before) − H(after)`` in nats (:func:`information_gain`):
``ln(n_before / n_after)``. It is 0 for a question whose answer every remaining candidate shares
(an *uninformative* question, including any repeated question), ``ln 2`` for one that halves the
remaining set, and the gains of an episode that identifies the goal sum to ``ln N``. The expert
(and anyone choosing before hearing the answer) uses the expected gain
(:func:`expected_information_gain`, the entropy of the answer's distribution).

Reward components (``info["rewards"]``): ``success`` (``success_weight`` on a correct submit),
``info_gain`` (``info_gain_weight`` × this step's realised gain; 0 when the weight is 0, the
default), ``turn_cost`` (``-turn_cost`` every step). A step that asks nothing (a submit, a text
reply) has no information gain at all rather than a gain of 0: it reports ``info_gain`` as 0.0 (so
every step has the same keys) and names it in ``info["inapplicable_rewards"]``, so that a trainer
crediting ``info_gain`` per turn can compare questions only with questions
(:mod:`closedloop.trainers.advantages`, ``missing="exclude"``). A step with a question that fails
(an unknown attribute) did ask: its gain is 0.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from pydantic import Field, model_validator

from closedloop.evals.envs.base import BuiltinEnv, EnvOptions, system_and_user
from closedloop.messages import AssistantMessage, ToolCall, ToolMessage, UserMessage, _Message
from closedloop.tool import Tool

__all__ = ["ClarifyEnv", "ClarifyOptions", "Candidate", "LEVELS", "ATTRIBUTES", "consistent", "posterior", "entropy",
           "information_gain", "expected_information_gain", "best_question"]

Answers = Mapping[str, str]

# level -> (n_candidates, n_attributes, n_values per attribute)
LEVELS: dict[int, tuple[int, int, int]] = {1: (4, 2, 3), 2: (8, 3, 3), 3: (16, 4, 3), 4: (32, 5, 4)}
ATTRIBUTES: dict[str, list[str]] = {
    "colour": ["red", "blue", "green", "black", "white", "yellow"],
    "size": ["small", "medium", "large", "extra large"],
    "material": ["cotton", "wool", "leather", "linen", "denim", "silk"],
    "pattern": ["plain", "striped", "checked", "dotted"],
    "brand": ["Acme", "Zenith", "Orion", "Nova", "Vega"],
    "price": ["budget", "mid-range", "premium", "luxury"],
    "style": ["classic", "sporty", "casual", "formal"],
}
CATEGORIES = ["jacket", "shirt", "backpack", "scarf", "hat", "sweater", "bag", "dress"]


@dataclass(frozen=True)
class Candidate:
    id: str
    attributes: dict[str, str]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.attributes.items())


# --------------------------------------------------------------------------- exact belief and IG


def consistent(candidates: Sequence[Mapping[str, str]], answers: Answers) -> list[int]:
    """Indices of the candidates whose attributes agree with every answer."""
    return [i for i, c in enumerate(candidates) if all(c.get(k) == v for k, v in answers.items())]


def posterior(candidates: Sequence[Mapping[str, str]], answers: Answers) -> list[float]:
    """P(goal = i | answers) under a uniform prior and truthful answers: uniform over the consistent set."""
    alive = consistent(candidates, answers)
    if not alive:
        raise ValueError(f"no candidate is consistent with the answers {dict(answers)}")
    p = 1.0 / len(alive)
    alive_set = set(alive)
    return [p if i in alive_set else 0.0 for i in range(len(candidates))]


def entropy(probs: Sequence[float]) -> float:
    """Shannon entropy in nats."""
    return -sum(p * math.log(p) for p in probs if p > 0)


def information_gain(candidates: Sequence[Mapping[str, str]], answers: Answers, attribute: str, value: str) -> float:
    """Realised gain (nats) of learning ``attribute = value`` after ``answers``: H(before) − H(after).

    A repeated question (same attribute, same truthful value) gains 0. An answer inconsistent with
    every remaining candidate cannot come from a truthful user and raises ``ValueError``.
    """
    before = entropy(posterior(candidates, answers))
    after_answers = {**answers, attribute: value}
    if answers.get(attribute, value) != value:
        raise ValueError(f"{attribute} was already answered {answers[attribute]!r}, not {value!r}")
    return before - entropy(posterior(candidates, after_answers))


def expected_information_gain(candidates: Sequence[Mapping[str, str]], answers: Answers, attribute: str) -> float:
    """Expected gain (nats) of asking ``attribute`` before hearing the answer: the mutual information
    of the answer and the goal, i.e. the entropy of the answer's distribution under the posterior
    (the answer is a function of the goal)."""
    alive = consistent(candidates, answers)
    counts = Counter(candidates[i].get(attribute) for i in alive)
    return entropy([c / len(alive) for c in counts.values()])


def best_question(candidates: Sequence[Mapping[str, str]], answers: Answers, attributes: Sequence[str]) -> str | None:
    """The attribute of maximal expected gain (first in ``attributes`` order on ties), or None when
    no question can split the remaining candidates."""
    best, best_gain = None, 1e-12
    for a in attributes:
        gain = expected_information_gain(candidates, answers, a)
        if gain > best_gain:
            best, best_gain = a, gain
    return best


# --------------------------------------------------------------------------- environment


class ClarifyOptions(EnvOptions):
    """Options of :class:`ClarifyEnv` (``make_env("clarify", **options)``); ``n_candidates``,
    ``n_attributes`` and ``n_values`` override the level's values."""

    level: int = Field(1, ge=1, le=max(LEVELS), description=f"difficulty: (N, attributes, values) = {LEVELS}")
    n_candidates: int | None = Field(None, ge=2, description="N, the catalogue size")
    n_attributes: int | None = Field(None, ge=1, le=len(ATTRIBUTES), description="attributes per candidate")
    n_values: int | None = Field(None, ge=2, le=4, description="values each attribute takes in a catalogue")
    max_turns: int | None = Field(None, ge=1, description="actions before truncation; None: n_attributes + 2")
    success_weight: float = Field(1.0, description="reward for submitting the hidden goal")
    turn_cost: float = Field(0.05, description="cost per action (subtracted every step)")
    info_gain_weight: float = Field(0.0, description="reward per nat of realised information gain, per step")
    attribute_values: dict[str, list[str]] | None = Field(
        None, description="attribute -> possible values, replacing the built-in table ATTRIBUTES; a catalogue "
                          "draws n_attributes of these attributes and n_values of each one's values")
    item_ids: Literal["index", "values"] = Field(
        "index", description="item ids: 'index' c1..cN; 'values' the item's values joined by spaces in the "
                             "catalogue's attribute order ('red small')")
    expert_noise: float = Field(0.0, ge=0.0, le=1.0, description="probability that each question of the scripted "
                                "expert is a uniformly random attribute (possibly a repeat or one that does not "
                                "split the remaining items: uninformative) instead of the max-IG one")
    system_prompt: str = Field(
        "You help a customer find the {category} they want in this catalogue. Ask about one attribute at a time "
        "with ask, and call submit with the item's id once you know it.\nCatalogue:\n{catalogue}",
        description="template with {category} and {catalogue}")

    def shape(self) -> tuple[int, int, int]:
        n, k, v = LEVELS[self.level]
        return self.n_candidates or n, self.n_attributes or k, self.n_values or v

    def table(self) -> dict[str, list[str]]:
        return dict(self.attribute_values) if self.attribute_values is not None else ATTRIBUTES

    @model_validator(mode="after")
    def _check_shape(self) -> "ClarifyOptions":
        n, k, v = self.shape()
        if v ** k < n:
            raise ValueError(f"{n} distinct candidates need n_values ** n_attributes >= {n}, got {v}**{k}")
        table = self.table()
        if len(table) < k:
            raise ValueError(f"attribute_values has {len(table)} attributes, fewer than n_attributes={k}")
        for name, values in table.items():
            if not name.strip() or name != name.strip().lower():
                raise ValueError(f"attribute names are lower-case words without surrounding spaces, got {name!r}")
            if len(set(values)) < v or len(set(values)) != len(values) or not all(x.strip() for x in values):
                raise ValueError(f"attribute {name!r} needs at least n_values={v} distinct non-empty values, "
                                 f"got {values}")
        return self


class ClarifyEnv(BuiltinEnv):
    """Hidden-goal identification with exact information gain; see the module docstring."""

    name = "clarify"
    Options = ClarifyOptions
    reward_components = ("success", "info_gain", "turn_cost")
    options: ClarifyOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.candidates: list[Candidate] = []
        self.attributes: list[str] = []
        self.goal: Candidate | None = None

    # ------------------------------------------------------------------ episode

    def _setup(self, rng: random.Random) -> list[_Message]:
        n, k, v = self.options.shape()
        self.category = rng.choice(CATEGORIES)
        table = self.options.table()
        self.attributes = rng.sample(list(table), k)
        values = {a: rng.sample(table[a], v) for a in self.attributes}
        combos = list(itertools.product(*(values[a] for a in self.attributes)))
        chosen = rng.sample(combos, n)
        by_values = self.options.item_ids == "values"
        self.candidates = [Candidate(" ".join(combo) if by_values else f"c{i + 1}", dict(zip(self.attributes, combo)))
                           for i, combo in enumerate(chosen)]
        self.goal = rng.choice(self.candidates)
        self.answers: dict[str, str] = {}
        self.questions = self.uninformative = 0
        self.total_info_gain = 0.0
        self.submitted: str | None = None
        self.success = False
        self._register_tools()
        catalogue = "\n".join(f"{c.id}: {c.describe()}" for c in self.candidates)
        system = self.options.system_prompt.format(category=self.category, catalogue=catalogue)
        request = rng.choice(["I'm looking for a {c}.", "I want to buy a {c}.", "Can you help me find a {c}?"])
        return system_and_user(system, request.format(c=self.category))

    def _register_tools(self) -> None:
        attrs = ", ".join(self.attributes)

        async def ask(attribute: str) -> str:
            """Ask the customer which value they want for one attribute.

            Args:
                attribute: One of the catalogue's attributes.
            """
            return self._ask(attribute)

        async def submit(candidate_id: str) -> str:
            """Submit the item the customer wants; this ends the conversation.

            Args:
                candidate_id: The item's id in the catalogue, such as 'c3'.
            """
            return self._submit(candidate_id)

        # the example id in the schema matches the catalogue's ids (no docstring at all under python -OO)
        if self.options.item_ids == "values" and submit.__doc__:
            submit.__doc__ = submit.__doc__.replace("'c3'", repr(self.candidates[-1].id))

        self.registry.register(Tool(ask, description=f"Ask the customer which value they want for one attribute "
                                                     f"({attrs}).", timeout_s=None))
        self.registry.register(Tool(submit, timeout_s=None))

    @property
    def _rows(self) -> list[dict[str, str]]:
        return [c.attributes for c in self.candidates]

    def remaining(self) -> list[Candidate]:
        """The candidates consistent with every answer so far (the posterior's support)."""
        return [self.candidates[i] for i in consistent(self._rows, self.answers)]

    def _ask(self, attribute: str) -> str:
        assert self.goal is not None
        key = attribute.strip().lower()
        if key not in self.attributes:
            raise ValueError(f"unknown attribute {attribute!r}; the catalogue's attributes are {self.attributes}")
        value = self.goal.attributes[key]
        gain = information_gain(self._rows, self.answers, key, value)
        self.answers[key] = value
        self.questions += 1
        self.uninformative += gain <= 1e-12
        self._step_gain += gain
        return f"The {key} I want is {value}."

    def _submit(self, candidate_id: str) -> str:
        assert self.goal is not None
        ids = [c.id for c in self.candidates]
        cid = candidate_id.strip()
        if cid not in ids:
            raise ValueError(f"no item {candidate_id!r} in the catalogue; ids are {ids[0]}..{ids[-1]}")
        self.submitted = cid
        self.success = cid == self.goal.id
        return "Yes, that is the one I want." if self.success else "No, that is not the one I want."

    def _max_turns(self) -> int:
        return self.options.max_turns or self.options.shape()[1] + 2

    def _episode_info(self) -> dict[str, Any]:
        n = len(self.remaining())
        return {"level": self.options.level, "n_candidates": len(self.candidates), "attributes": list(self.attributes),
                "questions": self.questions, "uninformative_questions": self.uninformative,
                "remaining": n, "entropy": math.log(n), "total_info_gain": self.total_info_gain,
                "submitted": self.submitted, "success": self.success, "goal": self.goal.id if self.goal else None}

    async def _act(self, message: AssistantMessage):
        self._step_gain = 0.0
        if not message.tool_calls:
            nudge = "Please ask about one attribute with the ask tool, or submit the item's id with submit."
            return [UserMessage(content=nudge)], {}, False, {"info_gain": 0.0, "inapplicable_rewards": ["info_gain"]}
        new: list[_Message] = []
        asked = False  # an ask call ran (a failed one included)
        for call in message.tool_calls:
            if self.submitted is not None:  # calls after the submit in the same message are not run
                new.append(ToolMessage(tool_call_id=call.id, name=call.name, content="Error: not run: an item was "
                                       "already submitted", error="not run: an item was already submitted"))
                continue
            asked = asked or call.name == "ask"
            result = await self.registry.call(call)
            new.append(result.to_message(call.id))
        self.total_info_gain += self._step_gain
        rewards = {"info_gain": self.options.info_gain_weight * self._step_gain,
                   "success": self.options.success_weight if self.success else 0.0}
        extra: dict[str, Any] = {"info_gain": self._step_gain}
        if not asked:  # a submit (or any other call) asks nothing: no information gain, rather than a gain of 0
            extra["inapplicable_rewards"] = ["info_gain"]
        return new, rewards, self.submitted is not None, extra

    # ------------------------------------------------------------------ expert

    def expert_action(self) -> AssistantMessage:
        """Ask the question of maximal expected gain until one candidate remains, then submit it.

        With ``expert_noise`` p, each question is instead, with probability p, a uniformly random
        attribute (seeded by the episode's seed and turn, so expert trajectories are reproducible)."""
        if self.goal is None or self.done:
            raise RuntimeError("clarify: no episode in progress")
        alive = self.remaining()
        if len(alive) > 1:
            attribute = best_question(self._rows, self.answers, self.attributes)
            assert attribute is not None  # distinct candidates: some attribute splits any set of two or more
            noise = random.Random(f"clarify-expert/{self.seed}/{self.turns}")
            if self.options.expert_noise and noise.random() < self.options.expert_noise:
                attribute = noise.choice(self.attributes)
            call = ToolCall.make("ask", {"attribute": attribute}, id=f"call_{self.turns}_0")
        else:
            call = ToolCall.make("submit", {"candidate_id": alive[0].id}, id=f"call_{self.turns}_0")
        return AssistantMessage(content="", tool_calls=[call])
