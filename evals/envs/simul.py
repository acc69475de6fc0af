"""``simul``: simultaneous translation of a synthetic language pair, one source word per step.

Why this environment: paper 7 (Hibiki-Zero) trains a simultaneous translator in two stages,
supervised training on *delayed* targets (high latency) and then GRPO with a reward that pays for
translations that are both correct and early. This is that setting in text, small enough for the
tiny model to learn offline on two CPU cores.

The language pair. A source sentence is ``S O V .`` (subject, object, verb: verb-final) and its
translation is ``S' V' O' .`` (verb-second), word by word through a fixed lexicon
(:data:`LEXICON`, words that are single tokens of the tiny model's tokenizer). The subject can be
translated as soon as it arrives; the verb and object only once the verb (the last word) has
arrived: the reordering is what makes waiting sometimes necessary and sometimes wasteful.

An episode is ``level`` sentences in a row. Step ``t`` (1-based) shows source word ``t`` as a user
message (after the last word: ``(end)``, for ``tail`` more steps); the agent answers with the
target words it commits to now (space-separated), or with an empty message to wait. Emitted words
cannot be taken back. The episode ends when the source has been read and ``level`` periods have
been emitted, or after ``len(source) + tail`` steps.

Reward (paid on the last step; components ``quality`` and ``lag`` in ``info["rewards"]``), per
source sentence ``k`` and averaged over sentences:

- ``quality``: ``quality_weight`` × sentence BLEU / 100 (``sacrebleu``, ``tokenize="none"``,
  effective order) of the target words assigned to sentence ``k`` (emitted words are split into
  sentences at their periods) against its reference, where every word emitted after the
  sentence's deadline ``e_k + delta`` (``e_k``: the step its period arrived) is replaced by a
  placeholder that matches nothing. Late words still count in the hypothesis length: dropping
  them instead would *raise* BLEU when a late word is wrong, and the reward would then pay for
  emitting garbage later.
- ``lag``: ``-lag_weight`` × DAL / ``|x_k|`` (differentiable average lagging, Cherry & Foster
  2019, on the steps since the sentence started, so words emitted after the source ended keep
  costing), with LAAL's length-adaptive rate γ = max(|y|, |y*|)/|x|: with plain DAL, writing many
  (wrong) words at once lowers the lag, and a first GRPO run learned exactly that.

Both terms are monotone: delaying any emission (same words, later steps) can only turn words into
placeholders (BLEU's hypothesis length and n-gram totals are unchanged, its matches can only
fall) and can only raise DAL, so the reward never increases when the same content is emitted
later (property-tested in ``tests/evals/envs/test_simul.py``). AL and LAAL (SimulEval's
definitions; LAAL uses ``max(|y|, |y*|)``) and the end offset are reported in ``info`` but are
not in the reward: AL's cut-off at the first word written after the whole source makes it
non-monotone in delays.

Policies for comparison: :func:`wait_k_emissions` (the wait-k schedule of Ma et al. 2019 with a
lexicon translator, which writes a guess for a word whose source has not arrived yet), and the
environment's scripted expert (``expert``: ``delayed`` waits for each sentence's end, plus up to
``expert_extra_delay`` random silent steps: the SFT data; ``oracle`` writes every word at the
earliest step it is known; ``wait-k``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Sequence

from pydantic import Field

from closedloop.evals.envs.base import BuiltinEnv, EnvOptions
from closedloop.messages import AssistantMessage, SystemMessage, UserMessage, _Message

__all__ = ["SimulEnv", "SimulOptions", "SentencePair", "LEXICON", "make_sentence", "PLACEHOLDER", "END_MARK",
           "sentence_bleu", "deadline_bleu", "average_lagging", "length_adaptive_average_lagging",
           "differentiable_average_lagging", "SentenceScore", "EpisodeScore", "score_emissions", "wait_k_emissions",
           "oracle_emissions", "delayed_emissions", "split_sentences"]

# source word -> target word, by role. All are single tokens of the tiny model's tokenizer.
LEXICON: dict[str, dict[str, str]] = {
    "subject": {"Paris": "robot", "Rome": "lamp", "Oslo": "mug", "Lima": "sofa", "Cairo": "kettle"},
    "object": {"sunny": "watch", "rainy": "jacket", "cloudy": "battery", "windy": "blender", "snowy": "keyboard"},
    "verb": {"add": "get", "call": "tell", "test": "help", "charge": "cancel"},
}
PLACEHOLDER = "<late>"   # a late word in the hypothesis: counts in its length, matches nothing
END_MARK = "(end)"       # the user message of the steps after the source has been read
_PERIOD = "."

SYSTEM_PROMPT = ("Translate the source words into the target language as they arrive. Reply with the target "
                 "words you are sure of, or with nothing to wait.")


@dataclass(frozen=True)
class SentencePair:
    """One source sentence ``S O V .`` and its reference ``S' V' O' .``; ``align[i]``: the (1-based)
    source position whose arrival makes target word ``i`` known."""

    source: tuple[str, ...]
    target: tuple[str, ...]
    align: tuple[int, ...]


def make_sentence(rng: random.Random) -> SentencePair:
    s, o, v = (rng.choice(sorted(LEXICON[r])) for r in ("subject", "object", "verb"))
    target = (LEXICON["subject"][s], LEXICON["verb"][v], LEXICON["object"][o], _PERIOD)
    # S' needs S (1); V' and O' need V (3: O' follows V' in the target, written once V is known); "." needs "." (4)
    return SentencePair((s, o, v, _PERIOD), target, (1, 3, 3, 4))


# --------------------------------------------------------------------------- quality


@lru_cache(maxsize=1)
def _bleu() -> Any:
    from sacrebleu.metrics import BLEU

    return BLEU(tokenize="none", effective_order=True)


def sentence_bleu(hypothesis: Sequence[str], reference: Sequence[str]) -> float:
    """sacrebleu sentence BLEU (0..100) of word lists (no re-tokenisation, effective order)."""
    if not hypothesis:
        return 0.0
    return float(_bleu().sentence_score(" ".join(hypothesis), [" ".join(reference)]).score)


def deadline_bleu(words: Sequence[str], times: Sequence[int], reference: Sequence[str], deadline: int) -> float:
    """BLEU of ``words`` with every word emitted after ``deadline`` replaced by :data:`PLACEHOLDER`."""
    return sentence_bleu([w if t <= deadline else PLACEHOLDER for w, t in zip(words, times)], reference)


# --------------------------------------------------------------------------- latency


def _check(delays: Sequence[float], src_len: int) -> None:
    if src_len <= 0:
        raise ValueError("source length must be positive")
    if any(b < a for a, b in zip(delays, delays[1:])):
        raise ValueError(f"delays must be non-decreasing (words are emitted in order), got {list(delays)}")


def average_lagging(delays: Sequence[float], src_len: int, ref_len: int | None = None) -> float:
    """AL (Ma et al. 2019, as SimulEval): ``delays[i]`` = source words read when target word i+1 was
    written (clip to ``src_len`` first); rate γ = |y|/|x| (LAAL: ``max(|y|, |y*|)/|x|``); averaged up
    to the first word written after the whole source was read."""
    _check(delays, src_len)
    if not delays:
        return 0.0
    gamma = max(len(delays), ref_len or 0) / src_len
    total, tau = 0.0, 0
    for i, d in enumerate(delays):
        total += d - i / gamma
        tau = i + 1
        if d >= src_len:
            break
    return total / tau


def length_adaptive_average_lagging(delays: Sequence[float], src_len: int, ref_len: int) -> float:
    """LAAL (Papi et al. 2022): AL with γ = max(|y|, |y*|)/|x|, so over-long outputs are not rewarded."""
    return average_lagging(delays, src_len, ref_len)


def differentiable_average_lagging(delays: Sequence[float], src_len: int, ref_len: int | None = None) -> float:
    """DAL (Cherry & Foster 2019): g'_1 = g_1, g'_i = max(g_i, g'_{i−1} + 1/γ), mean of g'_i − (i−1)/γ
    over every written word, γ = |y|/|x|. Non-decreasing in every delay (no cut-off), hence the
    reward's lag. ``ref_len`` gives the length-adaptive rate γ = max(|y|, |y*|)/|x| (as LAAL does
    for AL), so writing extra words early cannot lower the lag."""
    _check(delays, src_len)
    if not delays:
        return 0.0
    gamma = max(len(delays), ref_len or 0) / src_len
    prev, total = -math.inf, 0.0
    for i, d in enumerate(delays):
        cur = d if i == 0 else max(d, prev + 1 / gamma)
        total += cur - i / gamma
        prev = cur
    return total / len(delays)


# --------------------------------------------------------------------------- scoring an episode


@dataclass
class SentenceScore:
    bleu: float
    dal: float
    al: float
    laal: float
    words: int


@dataclass
class EpisodeScore:
    """Per-sentence scores and the reward terms (means over sentences)."""

    sentences: list[SentenceScore]
    quality: float
    lag: float
    end_offset: float
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        n = max(len(self.sentences), 1)
        return {"bleu": sum(s.bleu for s in self.sentences) / n, "dal": sum(s.dal for s in self.sentences) / n,
                "al": sum(s.al for s in self.sentences) / n, "laal": sum(s.laal for s in self.sentences) / n,
                "end_offset": self.end_offset, "words": float(sum(s.words for s in self.sentences))}


def split_sentences(words: Sequence[str], n: int) -> list[list[int]]:
    """Indices of the emitted words assigned to each of ``n`` sentences: cut after each period; words
    after the n-th period go to the last sentence (they lower its precision)."""
    out: list[list[int]] = [[] for _ in range(n)]
    k = 0
    for i, w in enumerate(words):
        out[min(k, n - 1)].append(i)
        if w == _PERIOD:
            k += 1
    return out


def score_emissions(emissions: Sequence[tuple[int, str]], sentences: Sequence[SentencePair], *, delta: int = 1,
                    quality_weight: float = 1.0, lag_weight: float = 0.5) -> EpisodeScore:
    """Score ``(step, word)`` emissions (steps non-decreasing; step t = source word t has arrived)."""
    if not sentences:
        raise ValueError("no sentences to score")
    words = [w for _, w in emissions]
    times = [t for t, _ in emissions]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError("emission steps must be non-decreasing")
    groups = split_sentences(words, len(sentences))
    scores: list[SentenceScore] = []
    start = 0  # steps before this sentence's first source word
    for pair, idx in zip(sentences, groups):
        n_src = len(pair.source)
        end = start + n_src
        hyp = [words[i] for i in idx]
        rel = [times[i] - start for i in idx]
        bleu = deadline_bleu(hyp, [times[i] for i in idx], pair.target, end + delta)
        clipped = [min(max(r, 0), n_src) for r in rel]
        scores.append(SentenceScore(bleu=bleu, dal=differentiable_average_lagging(rel, n_src, len(pair.target))
                                    if rel else float(n_src),
                                    al=average_lagging(clipped, n_src) if rel else float(n_src),
                                    laal=length_adaptive_average_lagging(clipped, n_src, len(pair.target))
                                    if rel else float(n_src), words=len(hyp)))
        start = end
    n = len(scores)
    quality = quality_weight * sum(s.bleu for s in scores) / 100 / n
    lag = -lag_weight * sum(s.dal / len(p.source) for s, p in zip(scores, sentences)) / n
    end_offset = float(times[-1] - start) if times else 0.0
    return EpisodeScore(scores, quality, lag, end_offset)


# --------------------------------------------------------------------------- reference policies


def _schedule(sentences: Sequence[SentencePair], when: Any) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    start = 0
    for k, pair in enumerate(sentences):
        for i, w in enumerate(pair.target):
            t, word = when(k, pair, i, w)
            out.append((start + t, word))
        start += len(pair.source)
    out.sort(key=lambda x: x[0])  # stable: target order kept within a step
    return out


def oracle_emissions(sentences: Sequence[SentencePair]) -> list[tuple[int, str]]:
    """Every reference word at the earliest step it is known (the lowest lag at full quality)."""
    return _schedule(sentences, lambda k, p, i, w: (p.align[i], w))


def delayed_emissions(sentences: Sequence[SentencePair], extra: Sequence[int] | None = None) -> list[tuple[int, str]]:
    """The SFT targets: each sentence's whole translation when its last source word arrives, plus
    ``extra[k]`` silent steps (Hibiki's silence insertion)."""
    ex = list(extra or [0] * len(sentences))
    return _schedule(sentences, lambda k, p, i, w: (len(p.source) + ex[k], w))


def wait_k_emissions(sentences: Sequence[SentencePair], k: int) -> list[tuple[int, str]]:
    """Wait-k per sentence: target word i (1-based) is written after min(k + i − 1, |x|) source words;
    a word whose source has not arrived is guessed as the first lexicon word of its role (the
    translator has no future context), so small k costs BLEU under reordering."""
    if k < 1:
        raise ValueError("k must be >= 1")
    roles = ("subject", "verb", "object", None)
    guesses = {r: next(iter(sorted(LEXICON[r].values()))) for r in roles if r}

    def when(_k: int, p: SentencePair, i: int, w: str) -> tuple[int, str]:
        t = min(k + i, len(p.source))
        if p.align[i] <= t:
            return t, w
        role = roles[i]
        return t, guesses[role] if role else w

    return _schedule(sentences, when)


# --------------------------------------------------------------------------- environment


class SimulOptions(EnvOptions):
    """Options of :class:`SimulEnv` (``make_env("simul", **options)``)."""

    level: int = Field(2, ge=1, le=8, description="sentences per episode")
    delta: int = Field(1, ge=0, description="steps after a sentence's last source word before its deadline")
    tail: int = Field(2, ge=1, description="steps after the source has been read (user message '(end)')")
    quality_weight: float = Field(1.0, description="weight of the mean sentence BLEU/100")
    lag_weight: float = Field(0.5, ge=0, description="weight of the mean DAL / source length (subtracted)")
    turn_cost: float = Field(0.0, description="cost per step (0: the lag term already prices time)")
    expert: Literal["delayed", "oracle", "wait-k"] = Field("delayed", description="scripted policy of expert_action")
    expert_k: int = Field(2, ge=1, description="k of the wait-k expert")
    expert_extra_delay: int = Field(0, ge=0, description="delayed expert: up to this many extra silent steps per "
                                                         "sentence, drawn from the episode seed")
    system_prompt: str | None = Field(SYSTEM_PROMPT, description="None or '' for no system message")


class SimulEnv(BuiltinEnv):
    """Simultaneous translation, one source word per step; see the module docstring."""

    name = "simul"
    Options = SimulOptions
    reward_components = ("quality", "lag", "turn_cost")
    options: SimulOptions

    def _setup(self, rng: random.Random) -> list[_Message]:
        self.sentences = [make_sentence(rng) for _ in range(self.options.level)]
        self.source = [w for s in self.sentences for w in s.source]
        extra = [rng.randint(0, self.options.expert_extra_delay) for _ in self.sentences]
        o = self.options
        plan = {"delayed": lambda: delayed_emissions(self.sentences, extra),
                "oracle": lambda: oracle_emissions(self.sentences),
                "wait-k": lambda: wait_k_emissions(self.sentences, o.expert_k)}[o.expert]()
        self._plan = plan
        self.emissions: list[tuple[int, str]] = []
        self.score: EpisodeScore | None = None
        sys_msgs = [SystemMessage(content=o.system_prompt)] if o.system_prompt else []
        return sys_msgs + [UserMessage(content=self.source[0])]

    def _max_turns(self) -> int:
        return len(self.source) + self.options.tail

    def _periods(self) -> int:
        return sum(w == _PERIOD for _, w in self.emissions)

    def _finish(self) -> dict[str, float]:
        self.score = score_emissions(self.emissions, self.sentences, delta=self.options.delta,
                                     quality_weight=self.options.quality_weight, lag_weight=self.options.lag_weight)
        return {"quality": self.score.quality, "lag": self.score.lag}

    def _truncation_rewards(self) -> dict[str, float]:
        return self._finish()

    def _episode_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"source_len": len(self.source), "emitted": len(self.emissions)}
        if self.score is not None:
            info.update(self.score.metrics())
        return info

    async def _act(self, message: AssistantMessage):
        t = self.turns
        words = (message.text or "").split()
        self.emissions.extend((t, w) for w in words)
        if t >= len(self.source) and self._periods() >= len(self.sentences):
            return [], self._finish(), True, {}
        if t >= self._max_turns():
            return [], {}, False, {}  # the base class truncates; _truncation_rewards scores
        nxt = self.source[t] if t < len(self.source) else END_MARK
        return [UserMessage(content=nxt)], {}, False, {}

    def expert_action(self) -> AssistantMessage:
        """The scripted policy's words for the current step (empty: wait)."""
        if self.done or not self.source:
            raise RuntimeError("simul: no episode in progress")
        t = self.turns + 1
        return AssistantMessage(content=" ".join(w for s, w in self._plan if s == t or (t == self._max_turns()
                                                                                          and s > t)))
