"""Reloading a served model's weights in place from a saved Hugging Face directory.

A trainer whose rollouts come from a ``closedloop serve`` process (``openai:NAME@URL``) pushes
its weights after each update by writing them as a Hugging Face directory (``config.json`` plus
``model*.safetensors``) and posting the path to the server's admin endpoint
(``POST /closedloop/v1/load_weights``, see :mod:`closedloop.server.app`). This module reads and
checks such a directory and copies it into the served model.

Everything is checked before anything is copied (names, shapes, architecture), so a bad
directory is refused whole and the server keeps serving the weights it had: a half-loaded model
would answer with neither the old policy nor the new one. The copy runs while the client is
``paused()``: a batch in progress finishes on the old weights, later ones see the new ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from closedloop.models.base import LoadsWeights, Pausable


class WeightsError(ValueError):
    """The directory cannot be loaded into the served model (the caller's mistake: a 4xx)."""


class UnsupportedBackend(Exception):
    """The served client has no weights this server can replace (``openai:`` proxies, test doubles)."""


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index} is not a safetensors index: {e}") from None
        files = [directory / s for s in shards]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightsError(f"{directory} lacks shards its index names: {absent[:3]}")
        return files
    return sorted(directory.glob("*.safetensors"))


def read_hf_weights(path: str, *, model_type: str | None = None) -> dict[str, Any]:
    """The tensors of a Hugging Face model directory, checked to be one.

    ``path`` must be absolute (a relative path would resolve against the server's working
    directory, not the trainer's) and hold ``config.json`` and safetensors weights; with
    ``model_type`` given, the config's must match it.
    """
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_absolute():
        raise WeightsError(f"path {path!r} must be absolute (it is read by the server, not the caller)")
    if not p.exists():
        raise WeightsError(f"{path} does not exist on the server's filesystem")
    if not p.is_dir():
        raise WeightsError(f"{path} is not a directory; expected a Hugging Face model directory")
    config = p / "config.json"
    if not config.is_file():
        raise WeightsError(f"{path} is not a Hugging Face model directory: it has no config.json")
    try:
        cfg = json.loads(config.read_text())
    except ValueError as e:
        raise WeightsError(f"{config} is not valid JSON: {e}") from None
    if model_type is not None and isinstance(cfg, dict) and cfg.get("model_type") not in (None, model_type):
        raise WeightsError(f"{path} holds a {cfg.get('model_type')!r} model; this server serves a {model_type!r} "
                           "model")
    files = _safetensors_files(p)
    if not files:
        raise WeightsError(f"{path} holds no *.safetensors weights (save with safetensors, the default)")
    state: dict[str, Any] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - a corrupt file is the caller's, reported by name
            raise WeightsError(f"cannot read {f}: {type(e).__name__}: {e}") from None
    return state


def served_model_type(client: Any) -> str | None:
    """The served model's ``config.model_type`` where the backend exposes it (an engine process
    reports it as ``client.model_type``: its model lives in the child)."""
    model = getattr(client, "model", None)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        return getattr(cfg, "model_type", None)
    declared = getattr(client, "model_type", None)
    return declared if isinstance(declared, str) else None


def _check_against(model: Any, state: dict[str, Any]) -> None:
    """Every tensor names a weight of ``model`` with its shape, and every weight is given (a tied
    output layer may be left out, as ``save_pretrained`` does)."""
    own = model.state_dict()
    unexpected = sorted(k for k in state if k not in own)
    tied = {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    missing = sorted(k for k in own if k not in state and k not in tied and not k.endswith("rotary_emb.inv_freq"))
    if unexpected or missing:
        raise WeightsError(f"the weights do not fit the served model: unexpected {unexpected[:5]}, "
                           f"missing {missing[:5]}")
    wrong = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
             if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        k, got, want = wrong[0]
        raise WeightsError(f"{len(wrong)} tensors have the wrong shape, e.g. {k}: {got}, the served model has {want}")


def load_into_hf(client: Any, state: dict[str, Any]) -> int:
    """Copy ``state`` into an ``hf:`` client's model in place (dtype and device converted),
    under ``client.paused()``; returns the number of tensors copied."""
    import torch

    model = client.model
    _check_against(model, state)
    with client.paused(), torch.no_grad():
        model.load_state_dict(state, strict=False)
    return len(state)


def load_weights_into(client: Any, state: dict[str, Any]) -> int:
    """Load ``state`` (Hugging Face names) into whatever engine ``client`` wraps.

    ``vllm:`` clients load through :meth:`VLLMClient.load_weights` (TRL's colocate path);
    ``hf:`` clients by an in-place copy; anything else raises :class:`UnsupportedBackend`.
    """
    if isinstance(client, LoadsWeights):
        return int(client.load_weights(state.items()))
    model = getattr(client, "model", None)
    if model is not None and callable(getattr(model, "state_dict", None)) and isinstance(client, Pausable):
        return load_into_hf(client, state)
    raise UnsupportedBackend(f"the served backend ({getattr(client, 'spec', type(client).__name__)}) has no local "
                             "weights to replace; weight updates need an hf: or vllm: model")


__all__ = ["UnsupportedBackend", "WeightsError", "load_into_hf", "load_weights_into", "read_hf_weights",
           "served_model_type"]
