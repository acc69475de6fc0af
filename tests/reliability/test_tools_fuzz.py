"""A bounded fuzz of tool calls over every registered tool: ``Tool.run`` never raises.

Issue 9 (4): 54 of 3,781 malformed tool calls raised out of ``Tool.run`` and aborted the graph
run. Here every tool of every ``closedloop.tools`` entry point gets schema-driven malformed
calls (bad JSON, wrong types, missing and unknown fields, NaN/Infinity, huge and deep values,
out-of-range numbers, path escapes). Calls that fail validation run for real; of the calls that
would pass it, at most a couple per tool run (with a short timeout), so the whole fuzz stays
well under a minute. The figures are printed: tried / ok / clean errors / escaped exceptions.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from closedloop import plugins
from closedloop.tool import Tool, _ArgError

DEEP = "[" * 3000 + "]" * 3000
BIG_INT = "9" * 5000
RAW_DOCUMENTS = ["", "{", "[]", "null", '"text"', "42", "{}", '{"a": }', "{'single': 1}", '{"x": NaN}',
                 '{"__proto__": {}}', "\ud800", "{" * 5000, '{"k": ' + DEEP + "}", '{"k": ' + BIG_INT + "}"]
ESCAPES = ["/etc/passwd", "../../../../etc/shadow.npy", "~/.ssh/id_rsa.npy", "/proc/self/environ.npz",
           "data/../../x.safetensors"]


def _json_values(prop: dict[str, Any]) -> list[str]:
    """JSON texts of hostile values for one schema property (raw, so NaN and huge tokens survive)."""
    values = ["null", "{}", "[[[]]]", '"x"', "true", "NaN", "Infinity", "-Infinity", "1e999", BIG_INT,
              "9" * 400, DEEP, '"' + "a" * 100_000 + '"', "-1", "0", "1e-320"]
    lo = prop.get("minimum", prop.get("exclusiveMinimum"))
    hi = prop.get("maximum", prop.get("exclusiveMaximum"))
    if lo is not None:
        values.append(json.dumps(lo - 1))
    if hi is not None:
        values += [json.dumps(hi + 1), json.dumps(hi * 1000)]
    values += [json.dumps(e) for e in ESCAPES]
    return values


def _mutations(t: Tool) -> list[str]:
    schema = t.parameters
    props: dict[str, Any] = schema.get("properties", {})
    required = schema.get("required", [])
    base = {k: "1" for k in required}  # a type-plausible filler; most tools refuse it, which is the point
    out = list(RAW_DOCUMENTS)
    out.append(json.dumps({**{k: 1 for k in required}, "no_such_argument": 1}))
    for name, prop in props.items():
        for value in _json_values(prop):
            fields = {**{k: json.dumps(v) for k, v in base.items()}, name: value}
            out.append("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}")
    for k in required:  # each required argument missing
        out.append(json.dumps({r: 1 for r in required if r != k}))
    return out


def _would_run(t: Tool, raw: str) -> bool:
    try:
        t.check_resources(t.validate(raw))
    except _ArgError:
        return False
    except BaseException:  # validate itself must not raise anything else; run() is checked below
        return True
    return True


def _capped(t: Tool) -> Tool:
    """The same tool (checks, isolation, ceiling) with a short timeout for the fuzz."""
    return t.with_options(timeout_s=3.0)  # a timeout is as clean an error as any other here


async def test_no_tool_call_escapes_as_an_exception(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path / "artifacts"))
    registry = plugins.tool_registry()
    assert len(registry) >= 30
    counts: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    escaped: list[str] = []
    for t in registry:
        capped, budget = _capped(t), (1 if t.isolation == "process" else 2)
        for raw in _mutations(t):
            if _would_run(t, raw):
                if budget == 0:
                    counts["skipped (would run)"] += 1
                    continue
                budget -= 1
            counts["tried"] += 1
            try:
                r = await capped.run(raw)
            except BaseException as e:  # noqa: BLE001 - exactly what must not happen
                escaped.append(f"{t.name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if r.ok:
                counts["ok"] += 1
                json.loads(r.content) if r.content[:1] in "[{" else None  # JSON results parse
            else:
                counts["clean errors"] += 1
                kinds[r.error_kind or "?"] += 1
                assert r.content.startswith("Error: ") and len(r.content) < 20_000, (t.name, r.content[:200])
    # unknown tools and garbage names through the registry
    from closedloop.messages import ToolCall

    for name in ("no_such_tool", "x" * 10_000, "add; rm -rf /"):
        counts["tried"] += 1
        r = await registry.call(ToolCall.make(name, "{}"))
        counts["clean errors"] += r.error_kind == "unknown_tool"
    print(f"\ntool fuzz: tools={len(registry)} tried={counts['tried']} ok={counts['ok']} "
          f"clean_errors={counts['clean errors']} escaped={len(escaped)} "
          f"skipped_would_run={counts['skipped (would run)']} kinds={dict(kinds)}")
    assert escaped == []
    assert counts["tried"] >= 1500 and counts["clean errors"] >= 0.9 * counts["tried"]
