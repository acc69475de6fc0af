"""Experts configured, not coded (LLM Orchestration, paper 4).

A YAML file names the experts and what runs each one; swapping a model or a tool is an edit of
that file, never of the controller::

    controller: {model: "hf:/models/controller"}
    experts:
      vision: {kind: model, model: "hf:/models/vlm", modality: image, description: "reads images"}
      llm:    {kind: model, model: "openai:gpt-4o-mini", modality: text, description: "general knowledge"}
      calc:   {kind: tool, tool: "arithmetic:add", modality: text, description: "adds two numbers (JSON args)"}
      asr:    {kind: asr, model: "hf:/models/whisper", modality: audio, description: "transcribes speech"}
    tts: {engine: tone}            # or espeak-ng (when installed)

Kinds: ``model`` (any model spec; a VLM gets the image beside the question), ``tool`` (a tool of
a ``closedloop.tools`` module; the query is its JSON arguments, or the text of its single string
argument), ``asr`` (a speech-to-text checkpoint, :class:`closedloop.models.asr.SpeechRecognizer`; audio
decoded with PyAV). :class:`ExpertPool` counts every call, so a memory hit is visible as a call
that did not happen.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from closedloop.messages import AudioPart, ImagePart, TextPart, UserMessage, _Message
from closedloop.models.base import ModelClient, SamplingParams

if TYPE_CHECKING:
    from closedloop.tool import Tool

__all__ = ["ExpertSpec", "TTSSpec", "OrchestratorConfig", "ExpertPool", "load_config"]


class ExpertSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["model", "tool", "asr"]
    modality: Literal["image", "audio", "video", "text"] = "text"
    model: str | None = None
    tool: str | None = None  # "<tool module>:<tool name>"
    description: str = ""
    max_tokens: int = Field(128, ge=1)
    system_prompt: str | None = None


class TTSSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: Literal["tone", "espeak-ng"] = "tone"
    voice: str | None = None
    rate: int = 16_000


class OrchestratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    controller: dict[str, Any] = Field(default_factory=dict)
    experts: dict[str, ExpertSpec]
    tts: TTSSpec = TTSSpec()

    def modalities(self) -> dict[str, str]:
        return {name: e.modality for name, e in self.experts.items()}


def load_config(path: str | Path) -> OrchestratorConfig:
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with 'experts'")
    cfg = OrchestratorConfig.model_validate(data)
    for name, e in cfg.experts.items():
        if e.kind in ("model", "asr") and not e.model:
            raise ValueError(f"{path}: expert {name!r} ({e.kind}) needs 'model'")
        if e.kind == "tool" and (not e.tool or ":" not in e.tool):
            raise ValueError(f"{path}: expert {name!r} needs 'tool: <module>:<tool>'")
    return cfg


class ExpertPool:
    """The configured experts, built lazily, with a call counter."""

    def __init__(self, config: OrchestratorConfig, *, clients: dict[str, ModelClient] | None = None) -> None:
        self.config = config
        self._clients: dict[str, ModelClient] = dict(clients or {})
        self._tools: dict[str, Any] = {}
        self._asr: dict[str, Any] = {}
        self.calls: Counter[str] = Counter()

    @property
    def specs(self) -> dict[str, ExpertSpec]:
        return self.config.experts

    def describe(self) -> str:
        return "\n".join(f'- {n} (reads {e.modality}): {e.description or e.kind}' for n, e in self.specs.items())

    def client(self, name: str) -> ModelClient:
        if name not in self._clients:
            from closedloop.models import make_client

            self._clients[name] = make_client(self.specs[name].model)  # type: ignore[arg-type]
        return self._clients[name]

    async def run(self, name: str, query: str, media: ImagePart | AudioPart | None = None) -> str:
        """One expert call; returns its output as text (the memory record's summary)."""
        spec = self.specs[name]
        self.calls[name] += 1
        if spec.kind == "model":
            content: list[Any] = [TextPart(text=query)] + ([media] if media is not None else [])
            msgs: list[_Message] = [] if not spec.system_prompt else [UserMessage(content=spec.system_prompt)]
            turn = await self.client(name).generate(
                msgs + [UserMessage(content=content if media is not None else query)],
                params=SamplingParams(temperature=0.0, max_tokens=spec.max_tokens))
            return (turn.message.text or "").strip()
        if spec.kind == "tool":
            return await self._run_tool(name, spec, query)
        return await asyncio.to_thread(self._transcribe, name, spec, media)

    async def _run_tool(self, name: str, spec: ExpertSpec, query: str) -> str:
        from closedloop import plugins

        if name not in self._tools:
            module, tool_name = spec.tool.split(":", 1)  # type: ignore[union-attr]
            tools = {t.name: t for t in cast("list[Tool]", plugins.load("closedloop.tools", module))}
            if tool_name not in tools:
                raise ValueError(f"expert {name!r}: module {module!r} has no tool {tool_name!r}")
            self._tools[name] = tools[tool_name]
        t = self._tools[name]
        try:
            args = json.loads(query)
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            params = list(t.parameters.get("properties", {}))
            args = {params[0]: query} if len(params) == 1 else query
        return (await t.run(args)).content

    def _transcribe(self, name: str, spec: ExpertSpec, media: Any) -> str:
        import base64

        from closedloop.models.asr import SpeechRecognizer

        if not isinstance(media, AudioPart):
            raise ValueError("the ASR expert needs an audio source (source=\"audio:N\")")
        if name not in self._asr:
            self._asr[name] = SpeechRecognizer(spec.model)  # type: ignore[arg-type]
        return self._asr[name].transcribe(base64.b64decode(media.input_audio.data))
