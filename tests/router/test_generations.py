"""A request running several generations at once (several prompts, n > 1) through the router: refused with
a 400 when no node could ever run them all at once, else sent so that its agent counts each on its cap."""

from __future__ import annotations

import httpx

from tests.conftest import chat, metric, wait_until
from tests.router.conftest import Pool


def test_more_generations_than_any_node_runs_are_a_400_and_the_others_count_each(pool: Pool) -> None:
    node = pool.node("n1", cap=2, parallel=8, speed=20.0)
    router = pool.router()
    pool.wait_ready(router, 1)
    url = router.url + "/v1/chat/completions"
    too_many = httpx.post(url, json={**chat(stream=False), "n": 3}, timeout=10)
    assert too_many.status_code == 400
    error = too_many.json()["error"]
    assert error["code"] == "too_many_generations"
    assert error["message"].endswith("no node in the pool runs more than 2")
    prompts = {"prompt": ["a", "b", "c"], "max_tokens": 5}
    assert httpx.post(router.url + "/v1/completions", json=prompts, timeout=10).status_code == 400
    assert metric(router.url, 'macpool_requests_total{model="",node="",status="400"}') == 2
    assert node.stats()["completed"] == 0  # none of them reached a node
    # two fit: streamed through the router, the agent still counts them as two while they run
    with httpx.stream("POST", url, json={**chat(max_tokens=2000), "n": 2}, timeout=30) as pair:
        assert pair.status_code == 200
        chunks = pair.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        assert node.status()["in_flight"] == 2
    wait_until(lambda: node.status()["in_flight"] == 0, timeout=2)
