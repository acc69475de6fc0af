"""Issue 26: ``GET /closedloop/v1/weights`` of a server proxying ``openai:m@http://key:sk-...@host/v1``
showed the upstream key in ``backend``. Every place the server reports its model spec (the weights
status, error bodies, in-band stream errors, its own log) now goes through the store's redaction;
the proxied client itself still sends the key upstream (that is what it is configured with).

The upstream is a real closedloop server that serves another model name, so the proxy's request
fails with an error that quotes the upstream URL, as any upstream failure does.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from closedloop.messages import AssistantMessage
from closedloop.models.openai_client import OpenAIClient
from closedloop.models.scripted import ScriptedClient
from closedloop.server import create_app
from closedloop.server.local import free_port, serve_app

KEY = "sk-proxy0123456789abcdefKEY"


@pytest.fixture(scope="module")
def upstream():
    with serve_app(create_app(ScriptedClient([AssistantMessage(content="hi")], cycle=True), "other")) as url:
        yield url


def _specs(upstream: str) -> dict[str, str]:
    return {"userinfo": upstream.replace("http://", f"http://key:{KEY}@"),
            "query": f"{upstream}?api_key={KEY}",
            "unreachable": f"http://key:{KEY}@127.0.0.1:{free_port()}/v1"}


@pytest.mark.parametrize("where", ["userinfo", "query", "unreachable"])
def test_no_report_of_the_server_holds_the_upstream_key(upstream, where, caplog):
    base_url = _specs(upstream)[where]
    client = OpenAIClient("m", base_url=base_url, max_retries=0)
    assert KEY in client.base_url and KEY not in client.spec  # configured with it; its printed spec never shows it
    with caplog.at_level(logging.ERROR, logger="closedloop.server"), serve_app(create_app(client, "m")) as url:
        root = url.removesuffix("/v1")
        status = httpx.get(f"{root}/closedloop/v1/weights", timeout=60).json()
        assert "[REDACTED]" in status["backend"] and KEY not in status["backend"]
        assert status["backend"].startswith("openai:m@http://") and "127.0.0.1" in status["backend"]
        bodies = [httpx.get(f"{root}/health", timeout=60).text, httpx.get(f"{url}/models", timeout=60).text]
        for stream in (False, True):
            r = httpx.post(f"{url}/chat/completions", timeout=60,
                           json={"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x"}]})
            bodies.append(r.text)
            error = (r.json() if not stream else
                     next(json.loads(line[6:]) for line in r.text.splitlines() if '"error"' in line))["error"]
            assert error["type"] == "server_error" and "127.0.0.1" in error["message"]  # still says where
    for body in bodies:
        assert KEY not in body
    assert "Traceback" in caplog.text or where == "unreachable"  # the log keeps the traceback ...
    assert KEY not in caplog.text  # ... without the key
