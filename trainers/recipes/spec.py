"""What a recipe file says: its params, derived vars and stages, and the ``${...}`` expressions
that tie them together.

A recipe is YAML (the format is documented in ``trainers/README.md``, "Recipes")::

    name: demo
    description: the closed loop end to end
    params:                       # the knobs: --set NAME=VALUE; --list-keys shows them
      out: {default: out/demo, help: Output folder.}
      sft_steps: {default: 12, help: SFT optimizer steps.}
    quick: {sft_steps: 8}         # what --quick overrides
    vars:                         # values derived once from the params (in order)
      store_path: ${store or out ~ '/runs.duckdb'}
    out: ${out}                   # the recipe's folder: stage folders, recipe.json, recipe.log
    stages:
      - name: sft
        kind: sft                 # a built-in stage kind, module:attr, or file.py:attr (beside the recipe)
        when: ${sft_steps > 0}    # optional: the stage is left out when false
        config: {sft: {model: ${stages.base.model_dir}, output_dir: ${dir}, max_steps: ${sft_steps}}}

``${expr}`` is a Jinja expression (sandboxed: no attribute access to Python internals) over the
params (also as one mapping, ``params``), the vars, ``out``, ``quick``, ``stages`` (each finished stage's outputs, by name),
``seconds`` (each finished stage's duration), ``dir`` (the stage's own folder, ``<out>/<name>``)
and ``item`` (in a ``foreach`` stage). A string that is one expression keeps the value's type
(``${sft_steps}`` is an int); expressions inside a longer string are formatted into it. Why Jinja:
it is already a dependency (chat templates), its expressions are Python-like (``max(1, n // 20)``,
``a or b``, ``x if quick else y``) and its sandbox evaluates them without ``eval``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from closedloop.trainers.config import read_yaml_mapping

STAGE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

__all__ = ["STAGE_NAME", "RecipeError", "ParamSpec", "StageSpec", "Recipe", "load_recipe_file", "evaluate_expression", "resolve",
           "params_model", "one_line"]


class RecipeError(ValueError):
    """A recipe that cannot be run as given: a bad file, param, expression or stage config."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ParamSpec(_Strict):
    """One knob of a recipe: its default (whose type the value must have) and what it means."""

    default: Any = Field(None, description="The value when not set; null: any type.")
    help: str = Field("", description="What the param does (closedloop recipe run FILE --list-keys).")


class StageSpec(_Strict):
    """One stage as written: its kind, its config (with expressions), and when or how often it runs."""

    name: str = Field(..., min_length=1, description="Unique name, its folder under out (letters, digits, _ . -; "
                                                    "${...} allowed in a foreach stage).")
    kind: str = Field(..., description="Built-in kind (base_model, experts, sft, grpo, evaluate, rft), "
                                       "package.module:attr, or file.py:attr relative to the recipe file.")
    config: dict[str, Any] = Field(default_factory=dict, description="The kind's typed config; ${...} allowed.")
    when: Any = Field(True, description="Run only when this is true (an expression over params and stages).")
    foreach: Any = Field(None, description="A list (or an expression giving one): one stage per item, named "
                                           "name-<i> unless the name has ${...}; `item` is the element.")
    description: str = Field("", description="A line for the log.")


class Recipe(_Strict):
    """A parsed recipe file (see the module docstring)."""

    name: str = Field(..., description="The recipe's name.")
    description: str = Field("", description="What it runs, in a line.")
    params: dict[str, ParamSpec] = Field(default_factory=dict, description="The knobs.")
    quick: dict[str, Any] = Field(default_factory=dict, description="Param values of --quick.")
    vars: dict[str, Any] = Field(default_factory=dict, description="Values derived from the params.")
    out: str | None = Field(None, description="Output folder (default out/<name>).")
    torch_threads: Any = Field(None, description="torch.set_num_threads for the run (null: leave it).")
    stages: list[StageSpec] = Field(..., min_length=1, description="The pipeline, in order.")
    source: str | None = Field(None, description="The file the recipe came from (set when loaded).")

    @field_validator("params", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        """``name: 3`` is ``name: {default: 3}``."""
        if not isinstance(value, Mapping):
            return value
        return {k: v if isinstance(v, Mapping) and set(v) <= {"default", "help"} else {"default": v}
                for k, v in value.items()}

    @property
    def folder(self) -> Path:
        """Where relative ``file.py:attr`` kinds are looked up: the recipe file's folder."""
        return Path(self.source).parent if self.source else Path.cwd()


def load_recipe_file(path: str | Path) -> Recipe:
    p = Path(path)
    data = read_yaml_mapping(p, "recipe file", RecipeError)
    try:
        recipe = Recipe.model_validate({**data, "source": str(p.resolve())})
    except ValidationError as e:
        raise RecipeError(f"recipe file {p}: {one_line(e)}") from e
    names = [s.name for s in recipe.stages]
    if len(set(names)) != len(names):
        raise RecipeError(f"recipe {recipe.name}: stage names must be unique, got {names}")
    return recipe


def params_model(recipe: Recipe) -> type[BaseModel]:
    """A pydantic model of the recipe's params, each typed by its default (null: any): the boundary
    where ``--set`` values are checked."""
    fields: dict[str, Any] = {}
    for name, spec in recipe.params.items():
        kind: Any = Any if spec.default is None else type(spec.default)
        if kind is float:
            kind = float  # an int is a valid float
        fields[name] = (kind | None if spec.default is not None else Any, Field(spec.default, description=spec.help))
    return create_model(f"{recipe.name}_params", __config__=ConfigDict(extra="forbid", coerce_numbers_to_str=True),
                        **fields)


def one_line(err: ValidationError) -> str:
    """A validation error as one line: ``loc: message; ...``."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        parts.append(f"{loc or '(root)'}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- expressions

_ENV: Any = None


def _environment() -> Any:
    global _ENV
    if _ENV is None:
        from jinja2 import StrictUndefined
        from jinja2.sandbox import SandboxedEnvironment

        _ENV = SandboxedEnvironment(undefined=StrictUndefined)
        _ENV.globals.update(max=max, min=min, int=int, float=float, str=str, round=round, len=len, sum=sum,
                            abs=abs, bool=bool, list=list, sorted=sorted)
    return _ENV


def evaluate_expression(expr: str, context: Mapping[str, Any]) -> Any:
    """The value of one ``${...}`` body in ``context``; :class:`RecipeError` naming what is missing."""
    from jinja2 import TemplateError, Undefined

    try:
        value = _environment().compile_expression(expr, undefined_to_none=False)(**context)
    except TemplateError as e:
        raise RecipeError(f"${{{expr}}}: {e}") from None
    if isinstance(value, Undefined):
        raise RecipeError(f"${{{expr}}}: undefined (known names: {', '.join(sorted(context))})")
    return value


def _spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each ``${...}`` in ``text``, braces inside the expression balanced and
    quoted strings skipped; ``$${`` is a literal ``${``."""
    out: list[tuple[int, int]] = []
    i = 0
    while True:
        i = text.find("${", i)
        if i < 0:
            return out
        if i > 0 and text[i - 1] == "$":
            i += 2
            continue
        depth, j, quote = 0, i + 1, ""
        while j < len(text):
            c = text[j]
            if quote:
                quote = "" if c == quote else quote
            elif c in "'\"":
                quote = c
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if j >= len(text):
            raise RecipeError(f"unclosed ${{ in {text!r}")
        out.append((i, j + 1))
        i = j + 1


def resolve(value: Any, context: Mapping[str, Any]) -> Any:
    """``value`` with every ``${...}`` evaluated, recursively through lists and mappings."""
    if isinstance(value, str):
        spans = _spans(value)
        if len(spans) == 1 and spans[0] == (0, len(value)):
            return evaluate_expression(value[2:-1], context)
        parts, last = [], 0
        for a, b in spans:
            parts.append(value[last:a])
            parts.append(str(evaluate_expression(value[a + 2:b - 1], context)))
            last = b
        return ("".join(parts) + value[last:]).replace("$${", "${")
    if isinstance(value, Mapping):
        return {resolve(k, context): resolve(v, context) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, context) for v in value]
    return value
