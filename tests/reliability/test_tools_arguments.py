"""Hostile and careless tool arguments get a clear error before the call; results are always JSON.

Issue 9 (4): JSON nested 2,000+ deep and a 5,000-digit integer raised out of ``Tool.run`` (aborting
the graph run); ``add``/``multiply`` returned the non-JSON strings ``NaN``/``Infinity``;
``hodge_spectrum(rtol=inf)``, ``compatibility_certificate(tol=NaN)`` and
``residual_kernel_spectrum(gamma=-1)`` ran and returned silently wrong results.
Issue 26: ``closedloop tool call --args @/dev/zero`` died of MemoryError, and a 5,000-digit
integer in ``--args`` ended in a traceback (raised while recording the call).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from closedloop import plugins
from closedloop.tool import ArgumentLimits, tool
from closedloop.tools.arithmetic import add, multiply


@tool
def echo(x: object = None) -> object:
    """Echo."""
    return x


@pytest.mark.parametrize("raw, fragment", [
    ('{"x": ' + "[" * 3000 + "]" * 3000 + "}", "nested too deeply"),
    ('{"x": ' + "[" * 40 + "]" * 40 + "}", "nested too deeply"),
    ('{"x": ' + "9" * 5000 + "}", "too many digits"),
    ('{"x": ' + "9" * 400 + "}", "integer too large"),
    ('{"x": NaN}', "NaN"),
    ('{"x": -Infinity}', "-Infinity"),
    ('{"x": 1e999}', "infinity"),
    ('{"x": "' + "a" * 3_000_000 + '"}', "over the limit"),
])
async def test_hostile_json_is_a_clear_error_not_an_exception(raw, fragment):
    r = await echo.run(raw)
    assert not r.ok and r.error_kind == "invalid_arguments" and fragment in r.error
    assert len(r.error) < 2000  # a message for the model, not a dump of its input


async def test_dict_arguments_get_the_same_checks():
    deep: object = []
    for _ in range(100):
        deep = [deep]
    for value, fragment in ((deep, "nested too deeply"), (float("nan"), "NaN"), (10**500, "integer too large"),
                            ([0.0] * 600_000, "more than")):
        r = await echo.run({"x": value})
        assert r.error_kind == "invalid_arguments" and fragment in r.error


async def test_limits_are_per_tool():
    @tool(limits=ArgumentLimits(max_bytes=50, allow_non_finite=True))
    def tiny(x: float) -> str:
        """Tiny."""
        return str(x)

    assert (await tiny.run('{"x": -Infinity}')).content == "-inf"
    assert "over the limit of 50" in (await tiny.run('{"x": ' + "1" * 60 + "}")).error


@pytest.mark.parametrize("t, args", [(add, {"a": 1e308, "b": 1e308}), (multiply, {"a": 1e200, "b": 1e200}),
                                     (add, '{"a": 1e308, "b": 1e308}')])
async def test_non_finite_results_never_reach_the_model(t, args):
    r = await t.run(args)
    assert not r.ok and r.error_kind == "exception" and "not valid JSON" in r.error
    assert r.content.startswith("Error:") and r.content not in ("Infinity", "NaN", "inf")


@pytest.fixture(scope="module")
def registry():
    return plugins.tool_registry(["mesh_certificate", "conditional_krr"])


async def test_out_of_domain_parameters_are_refused_before_the_call(registry, tmp_path):
    d0, d1 = [[-1.0, 1.0, 0.0], [0.0, -1.0, 1.0], [-1.0, 0.0, 1.0]], [[1.0, 1.0, -1.0]]
    np.savez(tmp_path / "ds.npz", X=np.random.default_rng(0).normal(size=(20, 2)), y=np.zeros(20))
    dataset = str(tmp_path / "ds.npz")
    cases = [("hodge_spectrum", {"d0": d0, "d1": d1, "rtol": "inf"}, "rtol: Input should be a finite number"),
             ("hodge_spectrum", '{"d0": [[1.0]], "d1": [[1.0]], "rtol": Infinity}', "Infinity"),
             ("hodge_spectrum", {"d0": d0, "d1": d1, "rtol": 2.0}, "rtol"),
             ("compatibility_certificate", '{"d0": [[1.0]], "d1": [[1.0]], "tol": NaN}', "NaN"),
             ("compatibility_certificate", {"d0": d0, "d1": d1, "tol": -1.0}, "tol"),
             ("residual_kernel_spectrum", {"dataset": dataset, "gamma": -1}, "gamma"),
             ("conditional_krr_fit", {"dataset": dataset, "alpha": 0}, "alpha"),
             ("conditional_krr_fit", {"dataset": dataset, "features": "poly:400"}, "poly:k takes k <= 8")]
    for name, args, fragment in cases:
        t = registry.get(name).with_options(timeout_s=None)  # results are the subject, on any load
        r = await t.run(args)
        assert not r.ok and fragment in r.error, (name, r.error)
        if "poly" not in fragment:
            assert r.error_kind == "invalid_arguments", (name, r.error)
    # "inf" as a string is coerced by pydantic to a float infinity: refused all the same
    assert (await registry.get("hodge_spectrum").run({"d0": d0, "d1": d1, "rtol": float("inf")})).error_kind \
        == "invalid_arguments"
    # in-domain values still work
    ok = await registry.get("compatibility_certificate").with_options(timeout_s=None).run({"d0": d0, "d1": d1,
                                                                                          "tol": 1e-9})
    assert ok.ok and json.loads(ok.content)["compatible"] is True


def test_parse_arguments_serves_callers_with_their_own_convention():
    from closedloop.tool import ToolArgumentError, parse_arguments

    assert parse_arguments('{"a": 1}') == {"a": 1} and parse_arguments(None) == {}
    for raw, kind in (('{"a": ' + "[" * 3000 + "]" * 3000 + "}", "invalid_arguments"),
                      ('{"a": ' + "9" * 5000 + "}", "invalid_arguments"), ("{", "malformed_json"),
                      ("[1]", "invalid_arguments")):
        with pytest.raises(ToolArgumentError) as info:
            parse_arguments(raw)
        assert info.value.kind == kind


def _cli(capsys, *argv: str) -> tuple[int, dict, str]:
    from closedloop.cli import main

    rc = main(["tool", "call", *argv, "--tools", "arithmetic", "--json"])  # an exception here is a traceback
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


@pytest.mark.parametrize("source, fragment", [("/dev/zero", "holds more than 2000000 bytes"),
                                              ("{tmp}", "cannot read arguments file"),
                                              ("{tmp}/latin1.json", "not UTF-8 text")])
def test_the_cli_reads_an_arguments_file_bounded(capsys, tmp_path, source, fragment):
    (tmp_path / "latin1.json").write_bytes('{"a": "caf\xe9"}'.encode("latin-1"))
    rc, out, _ = _cli(capsys, "add", "--no-store", "--args", "@" + source.format(tmp=tmp_path))
    assert rc == 2 and out["error_kind"] == "bad_input" and fragment in out["error"]


def test_a_huge_integer_in_the_cli_is_a_clear_error_and_the_run_is_finished(capsys, tmp_path):
    from closedloop.store import RunStore

    store = tmp_path / "runs.duckdb"
    rc, out, err = _cli(capsys, "add", "--store", str(store), "--args", '{"a": ' + "9" * 5000 + ', "b": 1}')
    assert rc == 2 and out["error_kind"] == "invalid_arguments" and "too many digits" in out["error"]
    run = RunStore(store).get_run(out["run_id"])
    assert run.status == "failed"  # finished, not left running
    # recorded, or one line saying why not (the store's redaction of such arguments is the store's own)
    assert len(run.tool_calls) == 1 or "could not be recorded" in err
