"""A trainer's config as it may leave the process: JSON-able, credentials redacted. A leaf (it imports
only :mod:`closedloop.redact`), so checkpoints can write it without importing the config module
that imports them."""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel

__all__ = ["redacted_config"]


def redacted_config(config: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    """A config as JSON-able values with credentials redacted, by the run store's rules
    (:mod:`closedloop.redact`: sensitive keys, URL userinfo, key shapes). Everything a trainer
    writes outside the store goes through it: ``train_config.json`` of each checkpoint, the config
    shown in TensorBoard, W&B and trackio. (A ``rollout_model`` of ``openai:m@http://user:key@host``
    or an ``env_options`` holding an ``api_key`` would otherwise land there verbatim.)"""
    from closedloop.redact import redact

    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)
    return dict(redact(data))
