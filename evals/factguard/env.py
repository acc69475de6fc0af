"""``factguard``: the FactGuard task as an environment (see :mod:`closedloop.env`), for GRPO and evaluation.

One episode = one video. The opening messages are the stage-1 system prompt and the sample (frames
of the whole video as one 2×2 overview image when ``vision``, the transcript, the metadata). The
agent answers, or calls ``factprobe`` / ``clipscout`` (executed here; ClipScout once per episode);
after tool results the environment adds the ClipScout grid (``vision``) and the stage-2
instruction, and the next reply is the answer. An answer ends the episode with the decision-aware
reward (:class:`~closedloop.agents.factguard.DecisionReward`): components ``acc``, ``format``,
``risk``, ``tool`` and ``turn_cost``. ``max_turns`` replies without an answer end it unfinished
(scored as no answer).

Samples come from a data directory (:func:`~closedloop.evals.factguard.data.load_samples`),
``split`` picks the temporal train or test part, and the episode's seed picks the sample, so a
trainer's seeds enumerate the data. Evidence: the directory's ``corpus.duckdb`` (BM25), or a web
backend from the environment (:func:`~closedloop.tools.factprobe.backend_from_env`).
"""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from closedloop.agents.factguard import STAGE1_SYSTEM_PROMPT, DecisionReward, Verdict, parse_verdict, sample_prompt
from closedloop.evals.envs.base import BuiltinEnv, EnvOptions
from closedloop.evals.factguard.data import Sample, load_samples, temporal_split
from closedloop.graphs.factguard import stage2_messages
from closedloop.messages import AssistantMessage, ImagePart, SystemMessage, TextPart, ToolCall, ToolMessage, UserMessage, _Message
from closedloop.tools.clipscout import make_clipscout_tool, read_frames, sample_times, tile_2x2, video_duration
from closedloop.tools.factprobe import LocalCorpus, SearchBackend, backend_from_env, make_factprobe_tool

__all__ = ["FactGuardEnv", "FactGuardOptions", "overview_image", "samples_for", "transcribe"]


class FactGuardOptions(EnvOptions):
    data_dir: str
    level: int = Field(1, ge=1, le=1, description="one level (the registry passes it to every environment)")
    dataset: str | None = None
    split: Literal["train", "test", "all"] = "train"
    test_fraction: float = Field(0.15, gt=0, lt=1)
    vision: bool = False  # the model reads images: overview frames and the ClipScout grid are shown
    max_turns: int = Field(3, ge=1)
    turn_cost: float = Field(0.0, ge=0)
    search_k: int = Field(3, ge=1)
    max_side: int = Field(448, ge=16)
    system_prompt: str | None = STAGE1_SYSTEM_PROMPT
    reward: DecisionReward = DecisionReward()
    asr: str | None = Field(None, description="hf:<speech model> that transcribes videos without a transcript")
    evidence_in_prompt: bool = Field(False, description="put FactProbe's report on the claim in the first message "
                                                       "and offer no tools (a one-stage variant for small models)")
    expert_unsettled_fake: float = Field(
        0.0, ge=0, le=1, description="probability that the scripted teacher answers 'fake' when the evidence does "
                                     "not settle the claim (drawn per episode seed; 0: always 'real')")


@functools.lru_cache(maxsize=8)
def samples_for(data_dir: str, dataset: str | None, split: str, test_fraction: float) -> tuple[Sample, ...]:
    samples = load_samples(data_dir, dataset)
    if split == "all":
        return tuple(samples)
    train, test = temporal_split(samples, test_fraction)
    return tuple(train if split == "train" else test)


@functools.lru_cache(maxsize=4)
def _recognizer(spec: str) -> Any:
    from closedloop.models.asr import SpeechRecognizer

    return SpeechRecognizer(spec)


@functools.lru_cache(maxsize=4096)
def transcribe(video: str, spec: str) -> str:
    """A video's transcript from the ASR expert (once per video and model); '' for a silent video."""
    from closedloop.models.asr import NoAudioError

    try:
        return _recognizer(spec).transcribe(video)
    except NoAudioError:
        return ""


@functools.lru_cache(maxsize=64)
def _backend(data_dir: str) -> SearchBackend:
    index = Path(data_dir) / "corpus.duckdb"
    return LocalCorpus(index) if index.exists() else backend_from_env()


def overview_image(video: str, max_side: int) -> Any:
    """Four frames spread over the whole video, tiled 2×2: how the agent first sees it."""
    return tile_2x2(read_frames(video, sample_times(0.0, video_duration(video))), max_side)


class FactGuardEnv(BuiltinEnv):
    name: ClassVar[str] = "factguard"
    Options: ClassVar[type[EnvOptions]] = FactGuardOptions
    reward_components: ClassVar[tuple[str, ...]] = ("acc", "format", "risk", "tool", "turn_cost")

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o: FactGuardOptions = self.options  # type: ignore[assignment]
        self.samples = samples_for(str(Path(o.data_dir).resolve()), o.dataset, o.split, o.test_fraction)
        if not self.samples:
            raise ValueError(f"factguard: no samples in the {o.split} split of {o.data_dir}")
        self._tmp = tempfile.TemporaryDirectory(prefix="closedloop-factguard-")
        self.sample: Sample | None = None
        self.used_tools: list[str] = []
        self.verdict: Verdict | None = None

    def _setup(self, rng: random.Random) -> list[_Message]:
        o: FactGuardOptions = self.options  # type: ignore[assignment]
        # The seed enumerates the samples (seed i -> sample i mod n), so trainers cover the data.
        self.sample = self.samples[self.seed % len(self.samples)]  # type: ignore[operator]
        self.used_tools, self.verdict = [], None
        probe = make_factprobe_tool(_backend(str(Path(o.data_dir).resolve())), k=o.search_k)
        evidence = None
        if o.evidence_in_prompt:
            query = self.sample.claim or self.sample.metadata[:200] or "video claim"
            evidence = _backend(str(Path(o.data_dir).resolve())).search(query, o.search_k)
        else:
            self.registry.register(probe)
        if self.sample.video and not o.evidence_in_prompt:
            self.registry.register(make_clipscout_tool(self.sample.video, out_dir=self._tmp.name,
                                                       max_side=o.max_side))
        transcript = self.sample.transcript
        if transcript is None and o.asr and self.sample.video:
            transcript = transcribe(self.sample.video, o.asr)
        text = sample_prompt(self.sample.metadata, transcript)
        if evidence is not None:
            from closedloop.tools.factprobe import report

            text = f"{report(self.sample.claim or '', evidence, max_snippet=120)}\n{text}"
        user: UserMessage
        if o.vision and self.sample.video:
            buf = Path(self._tmp.name) / f"overview-{self.sample.id}.png"
            overview_image(self.sample.video, o.max_side).save(buf)
            user = UserMessage(content=[ImagePart.from_path(buf), TextPart(text=text)])
        else:
            user = UserMessage(content=text)
        return ([SystemMessage(content=o.system_prompt)] if o.system_prompt else []) + [user]

    def _max_turns(self) -> int:
        return self.options.max_turns  # type: ignore[attr-defined]

    async def _act(self, message: AssistantMessage) -> tuple[list[_Message], dict[str, float], bool, dict[str, Any]]:
        o: FactGuardOptions = self.options  # type: ignore[assignment]
        assert self.sample is not None
        if message.tool_calls:
            done = await self._run_calls(message.tool_calls)
            self.used_tools += [c.name for c, r in done if c.name in self.registry]
            results = [self._tool_message(c, r) for c, r in done]
            for m, (c, _) in zip(results, done):
                m.name = m.name or c.name
            return [*results, *stage2_messages(results, attach_frames=o.vision)], {}, False, {}
        verdict = parse_verdict(message.text, message.reasoning)
        self.verdict = verdict
        r = o.reward.score(verdict.label, self.sample.label, well_formed=verdict.well_formed,
                           used_tool=bool(self.used_tools))
        info = {"label": self.sample.label, "predicted": verdict.label, "sample": self.sample.id,
                "success": float(verdict.label == self.sample.label)}
        return [], r.components(), True, info

    def _truncation_rewards(self) -> dict[str, float]:
        o: FactGuardOptions = self.options  # type: ignore[assignment]
        assert self.sample is not None
        return o.reward.score(None, self.sample.label, well_formed=False, used_tool=bool(self.used_tools)).components()

    def _episode_info(self) -> dict[str, Any]:
        return {"tools_used": list(self.used_tools)}

    def expert_action(self) -> AssistantMessage:
        """A teacher: search the claim once; answer from a decisive report, else "real" (flagging
        needs evidence), or "fake" with probability ``expert_unsettled_fake``. Trajectories of it are
        SFT data."""
        assert self.sample is not None
        reports = [m.content for m in self.messages if isinstance(m, ToolMessage) and isinstance(m.content, str)]
        if self.options.evidence_in_prompt:  # type: ignore[attr-defined]
            reports = [m.text for m in self.messages if isinstance(m, UserMessage)]
        elif not reports:
            query = self.sample.claim or self.sample.metadata[:200] or "video claim"
            return AssistantMessage(content="<think>The claim is unverified; I search for evidence.</think>",
                                    tool_calls=[ToolCall.make("factprobe", {"query": query})])
        text = " ".join(reports).lower()
        claim = (self.sample.claim or "").lower()
        # Only a report about this very claim settles it (a search also returns near misses).
        if claim and f"false: {claim}" in text:
            label, why = "fake", "a fact check says false"
        elif claim and f"confirmed: {claim}" in text:
            label, why = "real", "a report confirms it"
        else:
            # An unsettled claim: "real" (flagging needs evidence), or, with expert_unsettled_fake = p, a
            # calibrated teacher that says "fake" with probability p, so that a policy imitating it stays
            # uncertain exactly where the risk weights should decide (seeded by the episode, so several
            # passes over the data give one sample both answers).
            p = self.options.expert_unsettled_fake  # type: ignore[attr-defined]
            fake = p > 0 and random.Random(f"factguard-expert-{self.seed}").random() < p
            label, why = ("fake" if fake else "real"), "no report on this claim"
        return AssistantMessage(content=f"<think>{why}</think><answer>{label}</answer>")

    def close(self) -> None:
        super().close()
        self._tmp.cleanup()
