"""The pool dashboard in a real headless Chromium against a real pool (Redis, sims, agents, router)."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from macpool.dev import cli as dev
from macpool.dev.stack import Stack
from tests.inprocess import LocalStack
from tests.node_agent.test_agent_models import ask, model_files, start_mac, start_router
from tests.operator.helpers import ADMIN_KEY, HEARTBEAT_S, Pool, wait_until

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    """A page in the installed Chromium or Chrome through playwright; in CI a missing browser fails,
    locally it skips."""
    browser = dev.find_browser()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail(dev.browser_missing())
        pytest.skip(dev.browser_missing())
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("playwright missing in CI (it is in the test extra)")
        pytest.skip("playwright not installed (pip install playwright)")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(browser), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 820},
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def _load(
    router_url: str, stop: threading.Event, body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None, seconds: float = 180,
) -> None:
    """Streams one after another so the page has something to show (bounded)."""
    body = body or {"model": "op-model", "stream": True, "max_tokens": 400,
                    "messages": [{"role": "user", "content": "fill the dashboard"}]}
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=60, headers=headers) as client:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                with client.stream("POST", f"{router_url}/v1/chat/completions", json=body) as response:
                    for _ in response.iter_bytes():
                        if stop.is_set():
                            return
                if response.status_code != 200:
                    stop.wait(0.3)
            except httpx.HTTPError:
                stop.wait(0.3)


def _node_states(page: Any) -> dict[str, str]:
    return {node: card["state"] for node, card in _cards(page).items()}


def _cards(page: Any) -> dict[str, dict[str, str]]:
    """Each node card on the page: its state and the text of its share, memory and reason lines."""
    cards: dict[str, dict[str, str]] = page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('.node')].map(e => [e.dataset.nodeId, "
        "{state: e.dataset.state, share: e.querySelector('.share')?.textContent, "
        "mem: e.querySelector('.mem-text')?.textContent, reason: e.querySelector('.reason')?.textContent}]))"
    )
    return cards


@pytest.mark.slow
def test_dashboard_shows_every_node_and_a_killed_one_goes(pool: Callable[..., Pool], page: Any) -> None:
    running = pool(nodes=3)
    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(running.router.url, stop)) for _ in range(6)]
    for t in loaders:
        t.start()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(f"{running.router.url}/dashboard")
        wait_until(lambda: set(_node_states(page)) == set(running.agents), 30, "every node on the page")
        wait_until(lambda: page.inner_text("#conn") == "live", 30, "the SSE stream to be live")
        wait_until(lambda: page.inner_text("#p-capacity") not in ("", "-"), 30, "pool capacity in the header")
        wait_until(lambda: int(page.inner_text("#p-busy")) > 0, 30, "busy slots from the load")
        assert page.inner_text("#p-desired").strip().isdigit()
        # each node's model, loaded, with the memory it holds
        models = page.inner_text("#node-mac-1 .models")
        assert re.fullmatch(r"\S+ \(loaded, \d+\.\d GB\)", models), models
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

        page.fill("#admin-key", ADMIN_KEY)
        page.click("#admin-save")
        page.click("#node-mac-1 .drain")
        wait_until(lambda: _node_states(page).get("mac-1") == "draining", 30, "mac-1 drained from the page")
        page.click("#node-mac-1 .undrain")
        wait_until(lambda: _node_states(page).get("mac-1") == "healthy", 30, "mac-1 undrained from the page")

        victim = "mac-2"
        running.agents[victim].child.kill()  # SIGKILL: no clean deregistration, only the TTL
        ttl_s = 3 * HEARTBEAT_S
        gone = lambda: _node_states(page).get(victim, "gone") == "gone"  # noqa: E731
        wait_until(gone, ttl_s + 20, f"{victim} shown gone (or removed)")
        assert all(state != "gone" for node, state in _node_states(page).items() if node != victim)
        page.screenshot(path=str(ARTIFACTS / "dashboard-node-gone.png"), full_page=True)
    finally:
        stop.set()
        for t in loaders:
            t.join(30)
    assert not errors, errors


def _tenant_load(router_url: str, key: str, priority: str, stop: threading.Event) -> None:
    """One client of one API key: a long shared document then a short question, streamed (bounded)."""
    body = {"model": "op-model", "stream": True, "max_tokens": 200,
            "messages": [{"role": "system", "content": "Reference manual. " * 60},
                         {"role": "user", "content": f"a question from {key}"}]}
    headers = {"Authorization": f"Bearer {key}", "X-Macpool-Priority": priority}
    _load(router_url, stop, body, headers, seconds=120)


@pytest.mark.slow
@pytest.mark.in_process
def test_dashboard_shows_affinity_and_queues_by_class_and_key(
    pool: Callable[..., Pool], page: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-app name=app\nsk-nightly name=nightly priority=batch\n")
    running = pool(nodes=1, router_args=("--api-keys-file", str(keys), "--queue-size", "32",
                                         "--batch-queue-share", "0.5", "--queue-timeout", "30"))
    stop = threading.Event()
    clients = [("sk-app", "interactive")] * 6 + [("sk-nightly", "batch")] * 6
    url = running.router.url
    loaders = [threading.Thread(target=_tenant_load, args=(url, k, p, stop)) for k, p in clients]
    for t in loaders:
        t.start()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    def row(table: str, name: str) -> list[str]:
        cells: list[str] = page.evaluate(
            f"() => [...document.querySelectorAll('#{table} tbody tr')]"
            f".filter(r => r.cells[0].textContent === '{name}')"
            ".flatMap(r => [...r.cells].map(c => c.textContent))"
        )
        return cells

    try:
        page.goto(f"{running.router.url}/dashboard")
        wait_until(lambda: page.inner_text("#conn") == "live", 30, "the SSE stream to be live")
        wait_until(lambda: page.inner_text("#p-affinity").endswith("%")
                   and page.inner_text("#p-affinity") != "0%", 60, "an affinity hit rate")
        wait_until(lambda: len(row("tenants", "app")) == 5 and len(row("tenants", "nightly")) == 5, 30,
                   "both API keys in the tenants table")
        wait_until(lambda: int(row("classes", "batch")[1]) > 0 or int(row("classes", "interactive")[1]) > 0,
                   60, "queued requests by class")
        wait_until(lambda: row("classes", "interactive")[2].endswith("ms"), 60, "an interactive wait p50")
        assert int(row("tenants", "app")[1]) + int(row("tenants", "nightly")[1]) > 0  # in flight
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-tenants.png"), full_page=True)
    finally:
        stop.set()
        for t in loaders:
            t.join(timeout=70)
    assert not errors, errors


@pytest.mark.slow
@pytest.mark.in_process
def test_a_node_out_of_the_pools_capacity_takes_no_share_of_it(
    pool: Callable[..., Pool], page: Any, local_stack: LocalStack
) -> None:
    running = pool(nodes=3)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{running.router.url}/dashboard")
    wait_until(lambda: set(_node_states(page)) == set(running.agents), 30, "every node on the page")
    local_stack.stop(running.sims["mac-3"])  # its llama-server is gone: the agent stays, unhealthy
    wait_until(lambda: _cards(page)["mac-3"]["state"] == "unhealthy", 30, "mac-3 unhealthy")
    httpx.post(f"{running.router.url}/admin/nodes/mac-2/drain",
               headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5).raise_for_status()
    wait_until(lambda: _cards(page)["mac-2"]["state"] == "draining", 30, "mac-2 drained")
    cards = _cards(page)
    # the pool's capacity is mac-1's alone now: the shares must not add up to more than the whole
    assert (cards["mac-1"]["share"], cards["mac-2"]["share"], cards["mac-3"]["share"]) == ("100%", "0%", "0%")
    assert cards["mac-2"]["reason"].startswith("drained through the admin API"), cards["mac-2"]
    assert cards["mac-3"]["mem"] == "- GB", cards["mac-3"]  # its memory figures went with its llama-server
    assert not errors, errors


@pytest.mark.slow
def test_the_models_of_one_mac_sit_in_one_group(
        stack: Stack, redis_url: str, tmp_path: Path, page: Any) -> None:
    start_mac(stack, redis_url, "mac", model_files(tmp_path))
    router = start_router(stack, redis_url)
    assert ask(router, "a").status_code == 200  # loaded on demand
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{router}/dashboard")
    wait_until(lambda: page.inner_text("#conn") == "live", 30, "the SSE stream to be live")
    grouped = lambda: page.evaluate(  # noqa: E731
        "() => [...document.querySelectorAll('#mac-mac .mac-nodes > .node')].map(e => e.dataset.nodeId)")
    wait_until(lambda: grouped() == ["mac/a", "mac/b", "mac/c"], 30, "the Mac's three models in its group")
    # a's weights and the KV of its 2 slots, 8.57 GB, of the Mac's 21.3 GB wired limit
    head = "mac: 3 models, 1 loaded, 8.6 of 21.3 GB wired limit"
    wait_until(lambda: page.inner_text("#mac-mac .mac-head") == head, 30, "the group's head")
    assert page.evaluate("() => document.querySelectorAll('.mac-group').length") == 1
    assert not errors, errors
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-models.png"), full_page=True)
