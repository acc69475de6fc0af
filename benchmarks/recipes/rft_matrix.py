"""The last stage of ``rft_matrix.yaml``: every protocol's evaluation matrix in one ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from closedloop.trainers.recipes import StageContext, StageKind


class Summary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    modes: list[str]
    path: str


def _summary(config: Summary, ctx: StageContext) -> dict[str, Any]:
    summary = {mode: ctx.outputs[mode]["matrix"] for mode in config.modes}
    Path(config.path).write_text(json.dumps(summary, indent=2))
    return {"path": config.path}


SUMMARY = StageKind(Summary, _summary, "summary.json")
