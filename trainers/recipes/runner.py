"""One runner for every multi-stage pipeline: ``closedloop recipe run FILE|NAME [--quick] [--set ...]``.

A stage is a typed config and a function of the previous stages' outputs (:class:`StageKind`);
the runner resolves each stage's config (``${...}``, see :mod:`.spec`), validates it, runs it, and
records it in ``<out>/recipe.json``: status, kind, the resolved config and its hash, the seeds in it,
the outputs, the code's git commit, when and how long. Progress goes to the terminal and, as plain
timestamped lines, to ``<out>/recipe.log``.

Resume per stage: a re-run skips a stage whose record is ``completed`` with the same kind and
config hash, as long as every earlier stage was skipped too (once a stage runs again, the stages
after it do, since their inputs may have changed); ``from_stage`` re-runs from a named stage. A
stage that raises is recorded ``failed`` with the error; a Ctrl-C that a trainer turned into a saved
checkpoint (:class:`StageInterrupted`) is recorded ``interrupted`` and ends the run; a re-run starts
at that stage (a trainer config with ``resume: auto`` then continues from its checkpoint).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, TypeVar

from pydantic import BaseModel, ValidationError

from closedloop.trainers.recipes.spec import (STAGE_NAME, Recipe, RecipeError, StageSpec, load_recipe_file, one_line,
                                              params_model, resolve)

__all__ = ["StageKind", "StageContext", "StageInterrupted", "RecipeResult", "BUILTIN_STAGES", "ENTRY_POINT_GROUP",
           "load_recipe", "recipe_params", "available_recipes", "run_recipe"]

ENTRY_POINT_GROUP = "closedloop.recipes"
STATE_FILE = "recipe.json"
LOG_FILE = "recipe.log"

#: The built-in stage kinds, imported only when a recipe uses them.
BUILTIN_STAGES = {
    "base_model": "closedloop.trainers.recipes.stages:BASE_MODEL",
    "experts": "closedloop.trainers.recipes.stages:EXPERTS",
    "sft": "closedloop.trainers.recipes.stages:SFT",
    "grpo": "closedloop.trainers.recipes.stages:GRPO",
    "evaluate": "closedloop.trainers.recipes.stages:EVALUATE",
    "rft": "closedloop.trainers.rft:RFT_STAGE",
}

C = TypeVar("C", bound=BaseModel)


class StageInterrupted(RuntimeError):
    """A stage stopped on Ctrl-C after saving what resumes it (a trainer's checkpoint)."""


@dataclass(frozen=True)
class StageKind(Generic[C]):
    """A kind of stage: ``run(config, ctx)`` with ``config`` validated as ``config_class``, returning
    JSON-able outputs that later stages read as ``${stages.<name>.<key>}``."""

    config_class: type[C]
    run: Callable[[C, "StageContext"], dict[str, Any]]
    description: str = ""


@dataclass
class StageContext:
    """What a stage function gets besides its config."""

    name: str
    dir: Path  #: the stage's own folder, ``<out>/<name>`` (created)
    out: Path  #: the recipe's folder
    outputs: dict[str, dict[str, Any]]  #: finished stages' outputs, by name
    quick: bool
    log: Callable[[str], None]  #: a line to the terminal and the log file
    note: Callable[[str], None]  #: a line to the log file only (per-step metrics)


@dataclass
class RecipeResult:
    out: Path
    status: str  #: completed, interrupted
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def interrupted(self) -> bool:
        return self.status == "interrupted"


# --------------------------------------------------------------------------- finding recipes and kinds


def available_recipes() -> dict[str, Any]:
    """Recipes by name (the ``recipes`` kind of :mod:`closedloop.plugins`: entry points of group
    ``closedloop.recipes`` and in-process registrations); not loaded."""
    from closedloop import plugins

    return plugins.registry(ENTRY_POINT_GROUP).plugins()


def load_recipe(ref: str | Path | Recipe) -> Recipe:
    """A recipe from a YAML file path, or by the name of a ``closedloop.recipes`` entry point (whose
    object is a recipe file path or a :class:`Recipe`)."""
    if isinstance(ref, Recipe):
        return ref
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return load_recipe_file(path)
    known = available_recipes()
    if str(ref) not in known:
        raise RecipeError(f"no recipe file {ref} and no recipe named {str(ref)!r}; known: "
                          f"{', '.join(sorted(known)) or 'none (is closedloop installed?)'}")
    from closedloop import plugins

    obj = plugins.registry(ENTRY_POINT_GROUP).load(str(ref))
    return obj if isinstance(obj, Recipe) else load_recipe_file(obj)


def _module_from_file(path: Path, kind: str) -> Any:
    """The module of a ``file.py`` stage kind, executed once per file and process."""
    name = "closedloop_recipe_" + hashlib.sha256(str(path).encode()).hexdigest()[:12] + "_" + path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise RecipeError(f"stage kind {kind!r}: no file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _stage_kind(kind: str, recipe: Recipe) -> StageKind[Any]:
    target = BUILTIN_STAGES.get(kind, kind)
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name:
        raise RecipeError(f"stage kind {kind!r}: not one of {sorted(BUILTIN_STAGES)}, nor module:attr or file.py:attr")
    try:
        if module_name.endswith(".py"):
            module = _module_from_file((recipe.folder / module_name).resolve(), kind)
        else:
            module = importlib.import_module(module_name)
        obj = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise RecipeError(f"stage kind {kind!r}: {e}") from e
    if not isinstance(obj, StageKind):
        raise RecipeError(f"stage kind {kind!r} is {type(obj).__name__}, not a StageKind")
    return obj


# --------------------------------------------------------------------------- params


def recipe_params(recipe: Recipe, overrides: Mapping[str, Any] | None = None, *, quick: bool = False
                  ) -> dict[str, Any]:
    """The params: defaults, then ``quick:`` (with ``quick``), then ``overrides``, checked by type."""
    values = {**(recipe.quick if quick else {}), **dict(overrides or {})}
    unknown = sorted(set(values) - set(recipe.params))
    if unknown:
        raise RecipeError(f"recipe {recipe.name}: unknown param(s) {unknown}; valid: {', '.join(recipe.params)}")
    try:
        return params_model(recipe).model_validate(values).model_dump()
    except ValidationError as e:
        raise RecipeError(f"recipe {recipe.name}: {one_line(e)}") from None


def split_overrides(items: list[str], recipe: Recipe) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``--set`` items as (param values, per-stage config overrides): ``NAME=VALUE`` sets a param,
    ``STAGE.KEY.SUB=VALUE`` a key of that stage's config. Values are parsed as YAML."""
    from closedloop.trainers.config import parse_override

    params: dict[str, Any] = {}
    stages: dict[str, dict[str, Any]] = {}
    names = {s.name for s in recipe.stages}
    for item in items:
        key, value = parse_override(item, RecipeError)
        head, dot, rest = key.partition(".")
        if not dot:
            params[key] = value
        elif head in names:
            node = stages.setdefault(head, {})
            *path, last = rest.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        else:
            raise RecipeError(f"--set {key}: {head!r} is not a stage of recipe {recipe.name} ({', '.join(names)})")
    return params, stages


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


# --------------------------------------------------------------------------- records


def _code_version() -> dict[str, Any]:
    """The git commit the closedloop code runs from (and whether tracked files differ from it)."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha or None, "dirty": bool(dirty) if sha else None}


def _seeds(config: Any, prefix: str = "") -> dict[str, Any]:
    """Every setting named like a seed in a resolved config, by dotted key."""
    found: dict[str, Any] = {}
    if isinstance(config, Mapping):
        for k, v in config.items():
            key = f"{prefix}{k}"
            if "seed" in str(k) and not isinstance(v, (Mapping, list)):
                found[key] = v
            found.update(_seeds(v, key + "."))
    return found


def _digest(config: Any) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)  # a crash mid-write never leaves a half record


class _Log:
    def __init__(self, path: Path, console: Any) -> None:
        self.file = path.open("a", encoding="utf-8")
        self.console = console

    def note(self, text: str) -> None:
        stamp = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
        self.file.write(f"{stamp} {text}\n")
        self.file.flush()

    def log(self, text: str) -> None:
        self.note(text)
        self.console.print(f"[cyan]•[/cyan] {text}", highlight=False)

    def close(self) -> None:
        self.file.close()


# --------------------------------------------------------------------------- running


def _expand(spec: StageSpec, context: dict[str, Any]) -> list[tuple[str, StageSpec, dict[str, Any]]]:
    """(name, spec, extra context) per stage instance: one, or one per ``foreach`` item."""
    named: list[tuple[str, StageSpec, dict[str, Any]]]
    if spec.foreach is None:
        named = [(spec.name, spec, {})]
    else:
        items = resolve(spec.foreach, context)
        if not isinstance(items, (list, tuple)):
            raise RecipeError(f"stage {spec.name}: foreach must give a list, got {type(items).__name__}")
        named = [(str(resolve(spec.name, {**context, "item": item})) if "${" in spec.name else f"{spec.name}-{i}",
                  spec, {"item": item}) for i, item in enumerate(items)]
    for name, _, _ in named:
        if not STAGE_NAME.match(name):
            raise RecipeError(f"stage name {name!r}: use letters, digits, _ . - (it names a folder)")
    return named


def run_recipe(ref: str | Path | Recipe, *, params: Mapping[str, Any] | None = None, quick: bool = False,
               stage_overrides: Mapping[str, Mapping[str, Any]] | None = None, out: str | Path | None = None,
               from_stage: str | None = None, console: Any = None) -> RecipeResult:
    """Run a recipe (a file, an entry-point name or a :class:`Recipe`) with ``params`` over its
    defaults; see the module docstring for resume, records and logs."""
    from rich.console import Console

    recipe = load_recipe(ref)
    values = recipe_params(recipe, params, quick=quick)
    context: dict[str, Any] = {**values, "params": values, "quick": quick, "name": recipe.name}
    for key, expr in recipe.vars.items():
        context[key] = resolve(expr, context)
    if out is not None:
        root = Path(out)
    else:
        root = Path(str(resolve(recipe.out, context))) if recipe.out else Path("out") / recipe.name
    root.mkdir(parents=True, exist_ok=True)
    context["out"] = str(root)
    overrides = dict(stage_overrides or {})
    names = {s.name for s in recipe.stages}
    if set(overrides) - names:
        raise RecipeError(f"recipe {recipe.name}: no stage(s) {sorted(set(overrides) - names)}")
    if from_stage is not None and from_stage not in names and not any(s.foreach is not None for s in recipe.stages):
        raise RecipeError(f"--from {from_stage}: not a stage of {recipe.name}")
    threads = resolve(recipe.torch_threads, context)
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    run = _Run(recipe, root, values, quick, _Log(root / LOG_FILE, console or Console()))
    try:
        for spec in recipe.stages:
            run.rerun = run.rerun or spec.name == from_stage
            for name, stage, extra in _expand(spec, {**context, "stages": run.result.outputs, "seconds": run.seconds}):
                run.rerun = run.rerun or name == from_stage
                variables = {**context, **extra, "stages": run.result.outputs, "seconds": run.seconds,
                             "dir": str(root / name)}
                if not resolve(stage.when, variables):
                    run.log.note(f"{name}: left out (when: {stage.when})")
                    continue
                resolved = resolve(_merge(stage.config, overrides.get(spec.name, {})), variables)
                if not run.stage(name, stage, resolved):
                    return run.result
    finally:
        run.log.note(f"recipe {recipe.name}: {run.result.status}; ran {run.result.ran}, skipped {run.result.skipped}")
        run.log.close()
    return run.result


class _Run:
    """One run of a recipe: its records (``recipe.json``), log and result."""

    def __init__(self, recipe: Recipe, root: Path, params: dict[str, Any], quick: bool, log: _Log) -> None:
        self.recipe, self.root, self.quick, self.log = recipe, root, quick, log
        self.state_path = root / STATE_FILE
        self.previous: dict[str, Any] = (json.loads(self.state_path.read_text()).get("stages", {})
                                         if self.state_path.is_file() else {})
        self.records: dict[str, Any] = dict(self.previous)
        self.state = {"recipe": recipe.name, "source": recipe.source, "params": params, "stages": self.records}
        self.result = RecipeResult(out=root, status="completed")
        self.seconds: dict[str, float] = {}
        self.rerun = False  #: a stage ran in this invocation, so every later one runs too
        self._version: dict[str, Any] | None = None
        log.note(f"recipe {recipe.name} ({recipe.source}) params {json.dumps(params, default=str)}")

    def save(self) -> None:
        _write_json(self.state_path, self.state)

    def stage(self, name: str, stage: StageSpec, resolved: dict[str, Any]) -> bool:
        """Skip the stage (finished before with this config) or run and record it; False when a
        Ctrl-C stopped it (the run ends)."""
        kind = _stage_kind(stage.kind, self.recipe)
        try:
            config = kind.config_class.model_validate(resolved)
        except ValidationError as e:
            raise RecipeError(f"stage {name} ({stage.kind}): {one_line(e)}") from None
        digest = _digest(resolved)
        done = self.previous.get(name, {})
        if (not self.rerun and done.get("status") == "completed" and done.get("kind") == stage.kind
                and done.get("config_hash") == digest):
            self.result.outputs[name] = done.get("outputs", {})
            self.seconds[name] = float(done.get("seconds", 0.0))
            self.result.skipped.append(name)
            self.log.log(f"{name}: done before ({done.get('finished', '?')}), skipped")
            return True
        self.rerun = True  # every later stage runs again: its inputs may have changed
        self._version = self._version or _code_version()
        record: dict[str, Any] = {"kind": stage.kind, "status": "running", "config": resolved, "config_hash": digest,
                                  "seeds": _seeds(resolved), **self._version,
                                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self.records[name] = record
        self.save()
        self.log.log(f"{name}: {stage.kind}{' - ' + stage.description if stage.description else ''}")
        (self.root / name).mkdir(parents=True, exist_ok=True)
        ctx = StageContext(name=name, dir=self.root / name, out=self.root, outputs=self.result.outputs,
                           quick=self.quick, log=self.log.log, note=self.log.note)
        t0 = time.perf_counter()
        try:
            outputs = kind.run(config, ctx)
            json.dumps(outputs)  # outputs are records: JSON or an error now, not a corrupt recipe.json later
        except StageInterrupted as e:
            record.update(status="interrupted", error=str(e), seconds=time.perf_counter() - t0)
            self.log.log(f"{name}: interrupted ({e}); run the recipe again to continue")
            self.result.status = "interrupted"
            return False
        except BaseException as e:
            record.update(status="interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                          error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
            self.log.note(f"{name}: {record['status']}: {type(e).__name__}: {e}")
            raise
        finally:
            self.save()
        self.seconds[name] = time.perf_counter() - t0
        record.update(status="completed", outputs=outputs, seconds=self.seconds[name],
                      finished=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        self.save()
        self.result.outputs[name] = outputs
        self.result.ran.append(name)
        self.log.log(f"{name}: done in {self.seconds[name]:.0f}s")
        return True
