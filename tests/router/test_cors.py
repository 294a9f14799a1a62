"""CORS: with ``--cors-origins`` a browser application on those origins can call the router - preflights are
answered and every answer (a stream, a refusal, an auth error) carries the headers that let the page read it;
without it the router refuses every request a page on another origin sends (403), and adds nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from macpool.dev.procs import macpool_argv
from tests.conftest import chat
from tests.router.conftest import Pool

ORIGIN = "https://chat.example.com"


pytestmark = pytest.mark.in_process  # none of these tests is about a process


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-macpool-priority",
    }, timeout=10)


def test_a_browser_on_an_allowed_origin_can_call_the_router_and_read_every_answer(
    pool: Pool, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("browser-key\n")
    pool.node("n1", cap=1, speed=1.0)
    router = pool.router("--cors-origins", f"{ORIGIN}, http://localhost:5173", "--api-keys-file", str(keys),
                         "--queue-size", "0")
    pool.wait_ready(router, 1)
    model = ""  # any node (listing the models would need the key)

    allowed = preflight(router.url, ORIGIN)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"]
    assert preflight(router.url, "http://localhost:5173").status_code == 200
    refused = preflight(router.url, "https://evil.example.com")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert refused.json()["error"]["code"] == "cors_disallowed"  # JSON, as every error

    browser = {"Origin": ORIGIN, "Authorization": "Bearer browser-key"}
    with httpx.Client(timeout=30) as client:
        # an auth error the page must be able to read
        url = router.url + "/v1/chat/completions"
        anonymous = client.post(url, json=chat(model), headers={"Origin": ORIGIN})
        assert anonymous.status_code == 401
        assert anonymous.headers["access-control-allow-origin"] == ORIGIN
        with client.stream("POST", router.url + "/v1/chat/completions", json=chat(model, max_tokens=2000),
                           headers=browser) as stream:
            assert stream.status_code == 200
            assert stream.headers["access-control-allow-origin"] == ORIGIN
            exposed = set(stream.headers["access-control-expose-headers"].lower().replace(" ", "").split(","))
            assert {"retry-after", "x-macpool-reason", "x-request-id"} <= exposed
            chunks = stream.iter_raw()  # held: a dropped iterator closes the connection
            next(chunks)
            # the one slot is held: refusals, most of them from the router's memory of "full",
            # each with the headers
            for _ in range(30):
                full = client.post(router.url + "/v1/chat/completions", json=chat(model), headers=browser)
                assert full.status_code == 503
                assert full.headers["access-control-allow-origin"] == ORIGIN
                assert full.headers["x-macpool-reason"] == "pool_full"
            # a caller that is not a browser is refused as before, without CORS headers
            plain = client.post(router.url + "/v1/chat/completions", json=chat(model),
                                headers={"Authorization": "Bearer browser-key"})
            assert plain.status_code == 503 and "access-control-allow-origin" not in plain.headers


def test_without_cors_origins_a_browser_origin_is_refused(pool: Pool) -> None:
    pool.node("n1", cap=1)
    router = pool.router()
    pool.wait_ready(router, 1)
    answer = preflight(router.url, ORIGIN)
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "origin_not_allowed"
    assert not any(name.startswith("access-control-") for name in answer.headers)
    body = chat(pool.model(router), stream=False)
    url = router.url + "/v1/chat/completions"
    refused = httpx.post(url, json=body, headers={"Origin": ORIGIN}, timeout=30)
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
    assert refused.json()["error"] == {"message": refused.json()["error"]["message"],
                                       "type": "permission_error", "code": "origin_not_allowed"}
    # a client that is not a browser sends no Origin; the router's own pages send its own
    assert httpx.post(url, json=body, timeout=30).status_code == 200
    assert httpx.post(url, json=body, headers={"Origin": router.url}, timeout=30).status_code == 200


def test_an_origin_with_a_path_or_trailing_slash_is_refused_at_start() -> None:
    for value in ("https://chat.example.com/", "chat.example.com", "https://chat.example.com/app"):
        argv = macpool_argv("router", "--cors-origins", value)
        result = subprocess.run(argv, capture_output=True, timeout=60)
        assert result.returncode == 2, value
        assert b"is not an origin" in result.stderr
