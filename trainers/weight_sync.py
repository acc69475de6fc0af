"""Pushing the trainer's weights to the engine that samples its rollouts, after every update.

GRPO is on-policy: rollouts must come from the weights being trained. When they come from the
live policy (``HFClient.from_model``) that holds by construction; when they come from another
engine (``GRPOConfig.rollout_model``) the trainer pushes its weights there after the optimizer
step(s) of each GRPO step, before the next rollouts. Importance sampling (TRL's
``vllm_importance_sampling_correction``) then corrects only the small numerical mismatch between
engines, not a policy that lags by whole steps.

:func:`make_weight_sync` picks the push for the client the trainer samples from:

=====================================  =====================================================
live policy (``rollout_model`` unset)  :class:`LiveSync`: nothing to do, the client shares the module
``hf:PATH`` (a second local copy)      :class:`InProcessSync`: in-place copy under ``client.paused()``
``vllm:PATH`` (vLLM in-process)        :class:`InProcessSync` via :meth:`VLLMClient.load_weights`:
                                       TRL's colocate sync (``model_runner.model.load_weights`` per
                                       tensor, then ``reset_prefix_cache``); the engine must run in
                                       this process (``make_rollout_client`` builds it so)
``openai:NAME@URL``, ``closedloop      :class:`ClosedloopServerSync`: the merged weights are saved
serve --allow-weight-updates``         under ``output_dir/weight_sync/`` (safetensors + config,
                                       overwritten each step) and the path is posted to the
                                       server's admin endpoint ``POST /closedloop/v1/load_weights``;
                                       the server must see the trainer's filesystem (same machine)
``openai:NAME@URL``, a vLLM server     :class:`VLLMServerSync`: TRL's way (see below). Untested
in dev mode (``trl vllm-serve``)       without a GPU
=====================================  =====================================================

A real vLLM server: TRL (1.16) syncs a ``vllm serve`` process (``trl vllm-serve`` is now a thin
wrapper that runs ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config
'{"backend": "nccl"}' --logprobs-mode processed_logprobs``) over NCCL: its
``trl.generation.vllm_client.VLLMClient`` joins the server's workers as an extra rank
(``init_communicator``, through vLLM's dev-mode ``/init_weight_transfer_engine``), then each
update announces the tensors (``/start_weight_update``, ``/update_weights`` with names, dtypes
and shapes), broadcasts them (``update_named_params``; ``update_named_param`` for one) and
finishes (``/finish_weight_update``), then ``/reset_prefix_cache``. :class:`VLLMServerSync` drives
that same client; it needs ``trl``, ``vllm`` and a CUDA device on the trainer's side and has
not been run here without a GPU. Other OpenAI-compatible servers (SGLang, OpenAI) have no way
to take our weights: :func:`make_weight_sync` raises ``NotImplementedError`` naming the
alternatives instead of training on a policy that never changes.

Weights pushed are always full, merged weights under Hugging Face names: a LoRA model's deltas
are added without touching the live model (:func:`named_weights`), as TRL merges before it syncs.
With several processes (DDP) a remote engine is pushed to by the main process while the others
wait; sharded parameters (FSDP, ZeRO-3) are not gathered here, unlike TRL.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

from closedloop.models.base import LoadsWeights, ModelClient

log = logging.getLogger("closedloop.trainers.weight_sync")

#: The admin endpoints of ``closedloop serve`` (see :mod:`closedloop.server.app`).
STATUS_PATH = "/closedloop/v1/weights"
LOAD_PATH = "/closedloop/v1/load_weights"
SYNC_DIR = "weight_sync"


class WeightSync(Protocol):
    """Pushes the trainer's weights to the rollout engine."""

    kind: str

    def push(self, model: Any, step: int) -> None:
        """Make the engine sample from ``model``'s current weights (the unwrapped trainer model,
        possibly a LoRA ``PeftModel``) from now on; ``step`` is the GRPO step just finished."""

    def close(self) -> None:
        """Release what the sync holds (files, communicators)."""


# --------------------------------------------------------------------------- weights


def _is_peft(model: Any) -> bool:
    from closedloop.trainers.checkpoint import _is_peft as is_peft

    return is_peft(model)


def named_weights(model: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every weight under its Hugging Face name, LoRA merged.

    As TRL's ``_iter_named_params``: ``named_parameters()`` (tied weights once) without wrapper
    prefixes (``_checkpoint_wrapped_module.``); for a PeftModel, the base model's parameters with
    each LoRA delta added (computed aside, the live model is not merged and unmerged), adapter
    tensors and ``original_module`` copies left out, ``modules_to_save.default.`` stripped.
    """
    if _is_peft(model):
        from closedloop.trainers.checkpoint import merged_state_dict

        merged = merged_state_dict(model)
        base = model.get_base_model()
        seen: set[str] = set()
        for name, _ in base.named_parameters():
            if ".lora_" in name or "lora_embedding" in name or "original_module" in name:
                continue
            key = name.replace(".base_layer", "")
            out = key.replace("modules_to_save.default.", "")
            if out in seen:
                continue
            seen.add(out)
            tensor = merged.get(key, merged.get(out))
            if tensor is None:
                raise KeyError(f"merged weights lack {key}")
            yield out.replace("_checkpoint_wrapped_module.", ""), tensor.detach()
        return
    for name, param in model.named_parameters():
        yield name.replace("_checkpoint_wrapped_module.", ""), param.detach()


def save_weights(model: Any, directory: Path) -> Path:
    """The merged weights as a Hugging Face directory (``config.json`` + safetensors), replacing
    what was there; written aside and renamed, so the directory is never half-written."""
    from closedloop.trainers.checkpoint import merged_state_dict

    directory = Path(directory)
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    if _is_peft(model):
        model.get_base_model().save_pretrained(staging, state_dict=merged_state_dict(model))
    else:
        model.save_pretrained(staging)
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    return directory


# --------------------------------------------------------------------------- implementations


class LiveSync:
    """Rollouts from the live policy: the client holds the trainer's module, nothing to push."""

    kind = "live"

    def push(self, model: Any, step: int) -> None:
        return None

    def close(self) -> None:
        return None


class InProcessSync:
    """A second engine in this process (``hf:`` copy or ``vllm:``): load the tensors into it."""

    def __init__(self, client: ModelClient) -> None:
        self.client = client
        self.kind = "vllm" if isinstance(client, LoadsWeights) else "hf"
        if self.kind == "vllm" and getattr(client, "engine_model", lambda: None)() is None:
            raise NotImplementedError(
                "this vLLM engine runs its model in another process, so the trainer cannot load weights into it; "
                "build it with VLLMClient(path, weight_updates=True) (make_rollout_client does) or serve it with "
                "`trl vllm-serve` / `closedloop serve --allow-weight-updates` and use an openai: spec")

    def push(self, model: Any, step: int) -> None:
        t0 = time.perf_counter()
        if self.kind == "vllm":
            count = self.client.load_weights(named_weights(model))  # type: ignore[attr-defined]
        else:
            from closedloop.models.weights import load_into_hf

            count = load_into_hf(self.client, dict(named_weights(model)))
        log.debug("step %d: pushed %d tensors to %s in %.2fs", step, count, self.kind, time.perf_counter() - t0)

    def close(self) -> None:
        return None


def server_root(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port`` (where the admin endpoints live)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class ClosedloopServerSync:
    """``closedloop serve --allow-weight-updates``: save the merged weights under ``output_dir``
    and post the directory to the server, which reloads them in place (blocking until done)."""

    kind = "closedloop-server"

    def __init__(self, root: str, output_dir: str | Path, *, timeout_s: float = 600.0) -> None:
        self.root = root
        self.directory = (Path(output_dir) / SYNC_DIR).resolve()
        self.timeout_s = timeout_s

    def push(self, model: Any, step: int) -> None:
        import httpx

        save_weights(model, self.directory)
        r = httpx.post(self.root + LOAD_PATH, json={"path": str(self.directory), "step": step},
                       timeout=self.timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"the rollout server at {self.root} refused the weights of step {step} "
                               f"({r.status_code}): {_error_message(r)}")

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class VLLMServerSync:
    """A ``vllm serve`` in dev mode with an NCCL weight-transfer engine (``trl vllm-serve``),
    synced as TRL 1.16's ``VLLMGeneration.sync_weights`` does in server mode.

    Untested without a GPU: written against ``trl.generation.vllm_client.VLLMClient`` (1.16) and
    not yet run here; the NCCL group needs CUDA on the trainer's side.
    """

    kind = "vllm-server"

    def __init__(self, root: str, *, device: Any = "cuda", group_port: int = 51216,
                 connection_timeout: float = 60.0) -> None:
        try:
            from trl.generation.vllm_client import VLLMClient as TRLVLLMClient

            client = TRLVLLMClient(base_url=root, group_port=group_port, connection_timeout=connection_timeout)
        except ImportError as e:  # trl missing, or trl without vllm (its client checks on construction)
            raise NotImplementedError("syncing a vLLM server needs trl and vllm on the trainer's side "
                                      f"(pip install 'trl[vllm]') and a CUDA device: {e}") from e
        self.device = device
        self.client = client
        self.client.init_communicator(device=device)
        self._metadata: list[tuple[str, str, list[int]]] | None = None

    def push(self, model: Any, step: int) -> None:
        import torch

        if self._metadata is None:
            self._metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named_weights(model)]
        device = torch.device(self.device)
        self.client.update_named_params(self._metadata, ((n, t.to(device)) for n, t in named_weights(model)))
        self.client.reset_prefix_cache()

    def close(self) -> None:
        self.client.close_communicator()


def _error_message(r: Any) -> str:
    try:
        return str(r.json()["error"]["message"])
    except Exception:  # noqa: BLE001 - not our server's error shape
        return r.text[:500]


# --------------------------------------------------------------------------- choosing


def make_rollout_client(spec: str, **kwargs: Any) -> ModelClient:
    """The client for ``GRPOConfig.rollout_model``: a ``vllm:`` engine is built in-process
    (``weight_updates=True``) so the trainer can load weights into it; any other spec is the
    ordinary client (``openai:`` keeps one connection pool per event loop, so each rollout
    batch's ``asyncio.run`` is fine)."""
    from closedloop.models import make_client, parse_spec

    backend = parse_spec(spec).backend
    if backend == "vllm":
        kwargs.setdefault("weight_updates", True)
    return make_client(spec, **kwargs)


def _probe_server(root: str, timeout_s: float) -> str:
    """``"closedloop"`` or ``"vllm"``: which weight-update protocol the server at ``root`` speaks."""
    import httpx

    alternatives = ("use the live policy (leave rollout_model unset), a vllm: rollout_model (in-process), "
                    "`closedloop serve --model hf:PATH --allow-weight-updates`, or a vLLM server in dev mode with an "
                    "NCCL weight-transfer engine (`trl vllm-serve`)")
    try:
        r = httpx.get(root + STATUS_PATH, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach the rollout server at {root} to set up weight sync: {e}") from e
    try:
        status = r.json() if r.status_code == 200 else {}
    except ValueError:
        status = {}
    if isinstance(status, dict) and status.get("object") == "closedloop.weights":
        if not status.get("weight_updates"):
            raise ValueError(f"the closedloop server at {root} does not accept weights: restart it with "
                             "`closedloop serve ... --allow-weight-updates` (the trainer pushes its weights after each "
                             "update; without them rollouts would come from the initial policy)")
        return "closedloop"
    try:
        info = httpx.get(root + "/server_info", params={"config_format": "json"}, timeout=timeout_s)
        version = httpx.get(root + "/version", timeout=timeout_s)
    except httpx.HTTPError:
        info = version = None  # type: ignore[assignment]
    if info is not None and info.status_code == 200:
        return "vllm"
    if version is not None and version.status_code == 200:
        raise NotImplementedError(f"the vLLM server at {root} does not expose its weight-transfer endpoints: run it "
                                  "as `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config "
                                  "'{\"backend\": \"nccl\"}' --logprobs-mode processed_logprobs` (what `trl "
                                  f"vllm-serve` runs); or {alternatives}")
    raise NotImplementedError(f"the server at {root} takes no weight updates that closedloop knows; {alternatives}")


def make_weight_sync(client: ModelClient, config: Any, *, accelerator: Any = None,
                     timeout_s: float = 10.0) -> WeightSync:
    """The push for ``client``, given a GRPO config (``rollout_model``, ``output_dir``).

    Fails before training starts when the engine cannot take weights (with the alternatives in
    the message), rather than training against rollouts from a policy that never changes.
    """
    spec = getattr(config, "rollout_model", None)
    if not spec:
        return LiveSync()
    from closedloop.models import parse_spec

    s = parse_spec(spec)
    if s.backend in ("hf", "vllm"):
        return InProcessSync(client)
    if s.base_url is None:
        raise NotImplementedError(f"{spec} is OpenAI's hosted API, which cannot take trained weights; use an "
                                  "OpenAI-compatible server you run (closedloop serve --allow-weight-updates, or "
                                  "trl vllm-serve) or a vllm: rollout_model")
    root = server_root(s.base_url)
    if _probe_server(root, timeout_s) == "closedloop":
        return _MainOnly(ClosedloopServerSync(root, config.output_dir), accelerator)
    device = getattr(accelerator, "device", None) or "cuda"
    return _MainOnly(VLLMServerSync(root, device=device) if _is_main(accelerator) else LiveSync(), accelerator)


def _is_main(accelerator: Any) -> bool:
    return accelerator is None or bool(getattr(accelerator, "is_main_process", True))


class _MainOnly:
    """A remote engine is pushed to once, by the main process; the others wait for it, so no
    rank starts its next rollouts on the old weights."""

    def __init__(self, inner: WeightSync, accelerator: Any) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.accelerator = accelerator

    def push(self, model: Any, step: int) -> None:
        if _is_main(self.accelerator):
            self.inner.push(model, step)
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def close(self) -> None:
        if _is_main(self.accelerator):
            self.inner.close()


__all__ = ["ClosedloopServerSync", "InProcessSync", "LiveSync", "VLLMServerSync", "WeightSync",
           "make_rollout_client",
           "make_weight_sync", "named_weights", "save_weights", "server_root"]
