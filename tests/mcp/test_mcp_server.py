"""``closedloop mcp serve`` as a real subprocess, driven by the official SDK's own clients.

Each transport (stdio, streamable HTTP) gets one server process per module; one client session
runs every scenario against it and the tests below check what came back. Starting a server costs
seconds on a loaded 2-core machine, a scenario milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mcp")

from closedloop import plugins  # noqa: E402
from closedloop.mcp_server import PathOutsideWorkdir, check_paths  # noqa: E402
from closedloop.server.local import stop_process  # noqa: E402

MODULES = "arithmetic,mesh_certificate"
FACES = [[0, 1, 2], [1, 3, 2]]


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "CLOSEDLOOP_ARTIFACTS": str(tmp / "elsewhere")}  # outside the workdir: the server must override it


def _layout(tmp: Path) -> tuple[Path, Path]:
    """A workdir holding faces.npy (and a symlink that escapes it) next to a directory outside it."""
    work, outside = tmp / "work", tmp / "outside"
    work.mkdir()
    outside.mkdir()
    np.save(work / "faces.npy", np.array(FACES))
    np.save(outside / "faces.npy", np.array(FACES))
    (work / "escape.npy").symlink_to(outside / "faces.npy")
    return work, outside


def _text(result: Any) -> str:
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


async def _scenarios(session: Any, outside: Path) -> dict[str, Any]:
    await session.initialize()
    listed = await session.list_tools()
    seen: dict[str, Any] = {"schemas": {t.name: t.input_schema for t in listed.tools},
                            "descriptions": {t.name: t.description for t in listed.tools}}

    async def call(key: str, name: str, arguments: dict[str, Any]) -> None:
        r = await session.call_tool(name, arguments)
        seen[key] = {"is_error": bool(r.is_error), "text": _text(r)}

    await call("add", "add", {"a": 2, "b": 3.5})
    await call("add_invalid", "add", {"a": "two", "b": 1})
    await call("add_extra", "add", {"a": 1, "b": 2, "c": 3})
    await call("unknown", "no_such_tool", {})
    await call("missing_file", "mesh_incidence", {"faces": "missing.npy"})
    await call("inline", "mesh_incidence", {"faces": FACES})
    await call("path_inside", "mesh_incidence", {"faces": "faces.npy"})
    await call("path_dotdot", "mesh_incidence", {"faces": "../outside/faces.npy"})
    await call("path_absolute", "mesh_incidence", {"faces": str(outside / "faces.npy")})
    await call("path_symlink", "mesh_incidence", {"faces": "escape.npy"})
    if not seen["path_inside"]["is_error"]:
        report = json.loads(seen["path_inside"]["text"])
        seen["returned_paths"] = [report["d0"]["path"], report["d1"]["path"]]
        await call("roundtrip", "compatibility_certificate", {"d0": report["d0"]["path"], "d1": report["d1"]["path"]})
    return seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_stdio(work: Path, outside: Path, env: dict[str, str]) -> dict[str, Any]:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    # cwd is NOT the workdir: relative paths must resolve against --workdir, not the process's cwd.
    params = StdioServerParameters(command=sys.executable, cwd=str(outside), env=env,
                                   args=["-m", "closedloop", "mcp", "serve", "--tools", MODULES, "--workdir", str(work)])

    async def go() -> dict[str, Any]:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                return await _scenarios(session, outside)

    return asyncio.run(go())


def _run_http(work: Path, outside: Path, env: dict[str, str], log: Path) -> dict[str, Any]:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    port = _free_port()
    cmd = [sys.executable, "-m", "closedloop", "mcp", "serve", "--transport", "http", "--port", str(port),
           "--tools", MODULES, "--workdir", str(work)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=outside, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not listening after 120 s:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.2)

        async def go() -> dict[str, Any]:
            async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write):
                async with ClientSession(read, write) as session:
                    return await _scenarios(session, outside)

        return asyncio.run(go())
    finally:
        stop_process(proc)


@pytest.fixture(scope="module", params=["stdio", "http"])
def served(request, tmp_path_factory) -> tuple[dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp(f"mcp-{request.param}")
    work, outside = _layout(tmp)
    env = _env(tmp)
    if request.param == "stdio":
        return _run_stdio(work, outside, env), work
    return _run_http(work, outside, env, tmp / "server.log"), work


def test_list_tools_advertises_our_own_schemas(served):
    seen, _ = served
    registry = plugins.tool_registry(MODULES.split(","))
    assert seen["schemas"] == {t.name: t.parameters for t in registry}
    assert seen["descriptions"] == {t.name: t.description for t in registry}


def test_a_valid_call_returns_the_tool_result(served):
    seen, _ = served
    assert seen["add"] == {"is_error": False, "text": "5.5"}


def test_invalid_arguments_are_a_tool_error_with_the_validation_message(served):
    seen, _ = served
    assert seen["add_invalid"]["is_error"]
    assert "invalid arguments for add" in seen["add_invalid"]["text"] and "a:" in seen["add_invalid"]["text"]
    assert seen["add_extra"]["is_error"] and "c:" in seen["add_extra"]["text"]  # extra="forbid", as in graphs
    assert seen["unknown"]["is_error"] and "unknown tool 'no_such_tool'" in seen["unknown"]["text"]


def test_the_tools_own_failure_is_a_tool_error_too(served):
    seen, _ = served
    assert seen["missing_file"]["is_error"]
    assert "raised ArtifactError" in seen["missing_file"]["text"] and "file not found" in seen["missing_file"]["text"]


def test_array_arguments_work_inline_and_as_paths_inside_the_workdir(served):
    seen, work = served
    for key in ("inline", "path_inside"):
        assert not seen[key]["is_error"], seen[key]["text"]
        report = json.loads(seen[key]["text"])
        assert (report["n_vertices"], report["n_edges"], report["n_faces"]) == (4, 5, 2)
    # outputs land inside the workdir (CLOSEDLOOP_ARTIFACTS pointed outside is overridden) and can be passed back
    assert all(Path(p).resolve().is_relative_to(work.resolve()) for p in seen["returned_paths"])
    assert not seen["roundtrip"]["is_error"], seen["roundtrip"]["text"]


@pytest.mark.parametrize("key", ["path_dotdot", "path_absolute", "path_symlink"])
def test_paths_resolving_outside_the_workdir_are_refused(served, key):
    seen, _ = served
    assert seen[key]["is_error"]
    assert "outside the server's working directory" in seen[key]["text"]


def test_check_paths_leaves_non_paths_alone_and_resolves_relative_ones(tmp_path):
    (tmp_path / "table").write_text("x")
    args = {"kernel": "rbf", "features": "mercer:5", "x": [[1.0, 2.0]], "data": "d.npz", "sub": "a/b.npy",
            "ratio": "1/2", "url": "https://example.org/a.json", "file": "./table"}
    out = check_paths(args, tmp_path)
    for unchanged in ("kernel", "features", "x", "ratio", "url"):
        assert out[unchanged] == args[unchanged]
    root = tmp_path.resolve()
    assert (out["data"], out["sub"], out["file"]) == (str(root / "d.npz"), str(root / "a/b.npy"), str(root / "table"))
    with pytest.raises(PathOutsideWorkdir, match=r"items\[1\]"):
        check_paths({"items": ["ok.npy", "~/../../etc/passwd"]}, tmp_path)
