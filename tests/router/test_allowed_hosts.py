"""``--allowed-hosts``: a router on a shared network answers only to the names it is reached by. A web page
that rebinds its own name to the router's address (DNS rebinding) sends that name as ``Host`` and as
``Origin``, so the same-origin rule lets it through; with the list it is refused (400, in the API's dialect)
on every path. Addresses and localhost always pass; without the flag, every host does."""

from __future__ import annotations

import httpx
import pytest

from router.cli import build_settings
from router.settings import ConfigError
from tests.conftest import chat
from tests.router.conftest import Pool

pytestmark = pytest.mark.in_process  # none of these tests is about a process

PAGE = "rebound.attacker.example"


def test_a_page_rebinding_its_name_to_the_router_is_refused_and_the_routers_names_pass(pool: Pool) -> None:
    pool.node("n1", cap=1)
    router = pool.router("--allowed-hosts", "macpool.lan, *.pool.example", "--queue-size", "0")
    pool.wait_ready(router, 1)
    model = pool.model(router)
    port = router.url.rsplit(":", 1)[1]
    with httpx.Client(timeout=30) as client:
        def send(host: str, path: str = "/v1/chat/completions", **extra: str) -> httpx.Response:
            headers = {"Host": host, **extra}
            if path == "/dashboard":
                return client.get(router.url + path, headers=headers)
            body = chat(model) if path != "/v1/messages" else {
                "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            return client.post(router.url + path, json=body, headers=headers)

        # the page's own requests: same-origin by Origin, but addressed to the page's name
        for path in ("/v1/chat/completions", "/v1/messages", "/dashboard"):
            refused = send(f"{PAGE}:{port}", path, Origin=f"http://{PAGE}:{port}")
            assert refused.status_code == 400, (path, refused.text)
            if path == "/v1/messages":  # Anthropic's error document
                assert refused.json()["type"] == "error", refused.text
                assert refused.json()["error"]["type"] == "invalid_request_error", refused.text
            else:
                assert refused.json()["error"]["code"] == "host_not_allowed", refused.text
            assert "--allowed-hosts" in refused.text and "Traceback" not in refused.text
        assert send("pool.example").status_code == 400  # *.pool.example is the names under it
        assert send(f"macpool.lan.{PAGE}").status_code == 400

        for host in (f"macpool.lan:{port}", "MacPool.LAN", f"mac1.pool.example:{port}", f"127.0.0.1:{port}",
                     "[::1]", "192.168.1.20:8080", "localhost", f"localhost:{port}",
                     ""):  # (no name: no browser sends that; HAProxy's HTTP/1.0 health check does)
            answered = send(host)
            assert answered.status_code == 200, (host, answered.text)
        page = send(f"macpool.lan:{port}", "/dashboard", Origin=f"http://macpool.lan:{port}")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert send(f"macpool.lan:{port}", "/v1/messages").status_code == 200


def test_without_the_list_every_host_is_answered(pool: Pool) -> None:
    pool.node("n1", cap=1)
    router = pool.router("--queue-size", "0")
    pool.wait_ready(router, 1)
    answered = httpx.post(router.url + "/v1/chat/completions", json=chat(pool.model(router)),
                          headers={"Host": PAGE}, timeout=30)
    assert answered.status_code == 200, answered.text


@pytest.mark.parametrize("value", ["https://macpool.lan", "macpool.lan:8080", "*", "*.", ".lan", "a b"])
def test_a_list_entry_that_is_not_a_host_name_is_refused_at_start(value: str) -> None:
    with pytest.raises(ConfigError, match="is not a host name"):
        build_settings(["--allowed-hosts", value])
    assert build_settings(["--allowed-hosts", "macpool.lan,*.example.com"]).allowed_hosts
