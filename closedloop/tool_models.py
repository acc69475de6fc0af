"""Which models a tool argument may name: local checkpoints inside the working root, and what the operator allows.

A model spec in a tool argument (``cgp_probe_hf(model=...)``, ``culture_mt_judge(judge_model=...)``)
is chosen by whoever writes the calling model's prompt. Unchecked, ``openai:m@http://attacker/v1``
makes the tool send this process's ``OPENAI_API_KEY`` to that URL, and ``hf:/any/dir`` loads (and,
through its errors, probes) any directory on the machine. So every tool parameter that names a
model is typed :data:`ModelArg`, whose value passes :func:`check_model` while the arguments are
validated, before the tool runs (a refusal is an ``invalid_arguments`` error for the caller):

- ``hf:<dir>`` and ``vllm:<dir>``: a checkpoint directory inside the working root
  (:func:`closedloop.paths.resolve_path`), handed to the tool as an absolute path. Every path
  outside the root gets the same message, whether or not it exists.
- everything else (OpenAI-compatible endpoints, hub ids) only when the operator allowed it, with
  ``$CLOSEDLOOP_TOOL_MODELS`` (comma-separated) or ``--allow-model`` of ``closedloop tool call``
  and ``closedloop mcp serve``. Entries:

  ``openai:<model glob>``             the configured endpoint (``OPENAI_BASE_URL``, else OpenAI's)
  ``openai:<model glob>@<base URL>``  exactly that base URL (no glob in the URL)
  ``hf:<hub id glob>``, ``vllm:...``  hub ids (never a path: ``/``, ``~``, ``.``, ``..`` are refused)

Keys never follow a URL the caller chose: the OpenAI client takes ``OPENAI_API_KEY`` from the
environment, and the only URLs a tool argument can reach are the operator's. Refusals never list
the allowed entries (an MCP client must not learn the operator's endpoints).
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator

from closedloop import tool_model_entries
from closedloop.tool_model_entries import MODELS_ENV

if TYPE_CHECKING:
    from closedloop.models import ModelSpec

__all__ = ["MODELS_ENV", "ModelArg", "ModelNotAllowed", "allow_model", "allowed_models", "check_model"]

_LOCAL_BACKENDS = ("hf", "vllm")
_MAX_SPEC = 4200  # a backend, a path of at most 4096 characters, a URL
# A hub id: ``name`` or ``org/name``, never something a filesystem would read as a path.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


class ModelNotAllowed(ValueError):
    """A model spec in a tool argument names something the operator did not allow."""


def allow_model(entry: str) -> str:
    """Allow one more entry for the rest of this process (what ``--allow-model`` does)."""
    entry = _checked_entry(entry)
    if entry not in tool_model_entries.ADDED:
        tool_model_entries.ADDED.append(entry)
    return entry


def allowed_models() -> list[str]:
    """The operator's entries: ``$CLOSEDLOOP_TOOL_MODELS`` and those added with :func:`allow_model`."""
    return [_checked_entry(e) for e in tool_model_entries.given_entries()]


def _checked_entry(entry: str) -> str:
    from closedloop.models import parse_spec

    entry = entry.strip()
    try:
        spec = parse_spec(entry)
    except ValueError as e:
        raise ValueError(f"{MODELS_ENV} / --allow-model entry: {e}") from None
    if spec.base_url is not None and any(c in spec.base_url for c in "*?["):
        raise ValueError(f"{MODELS_ENV} / --allow-model entry {entry!r}: the base URL must be exact (no glob)")
    return entry


def check_model(value: str) -> str:
    """The spec a tool may use for ``value``, or :class:`ModelNotAllowed` with a message for the caller.

    A local checkpoint comes back as ``<backend>:<absolute directory>``; an allowed entry unchanged.
    """
    from closedloop.models import parse_spec
    from closedloop.paths import PathOutsideRoot, resolve_path
    from closedloop.redact import redact_spec

    if len(value) > _MAX_SPEC:  # before parsing: parse errors quote the spec
        raise ModelNotAllowed(f"a model spec of {len(value)} characters is not a usable model (at most {_MAX_SPEC})")
    spec = parse_spec(value)  # a malformed spec: ValueError, with any key in it redacted
    shown = _shown(redact_spec(value) or "")
    if spec.backend in _LOCAL_BACKENDS:
        try:
            directory = resolve_path(spec.model, name="model")
        except PathOutsideRoot as e:  # a hub id never resolves outside (it would be a link in the root)
            raise ModelNotAllowed(str(e)) from None
        else:
            if directory.is_dir():
                return f"{spec.backend}:{directory}"
            if not _is_hub_id(spec.model):
                raise ModelNotAllowed(f"model {shown}: no checkpoint directory there (inside the working root)")
    if any(_matches(spec, entry) for entry in allowed_models()):
        return value
    what = ("a remote endpoint" if spec.backend == "openai" else "a hub model (downloaded, not a local directory)")
    raise ModelNotAllowed(f"model {shown} names {what}, which tools may only use when the operator allows it "
                          f"({MODELS_ENV} or --allow-model); use a local checkpoint directory inside the "
                          f"working root")


def _matches(spec: ModelSpec, entry: str) -> bool:
    from closedloop.models import parse_spec

    allowed = parse_spec(entry)
    if allowed.backend != spec.backend or not fnmatchcase(spec.model, allowed.model):
        return False
    if spec.backend == "openai":
        return _url(spec.base_url) == _url(allowed.base_url)
    return _is_hub_id(spec.model)


def _url(url: str | None) -> str | None:
    return None if url is None else url.rstrip("/")


def _is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.startswith(".")


def _shown(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _validate(value: str) -> str:
    return check_model(value)


# A tool parameter naming a model: ``def my_tool(model: ModelArg, ...)``. The JSON schema stays a string.
ModelArg = Annotated[str, AfterValidator(_validate)]
