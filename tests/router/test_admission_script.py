"""The admission scripts themselves, on a real Redis: affinity, queue order, hand-over, shedding, limits.

Nodes here are just their Redis hashes (what a heartbeat writes); the end-to-end behaviour through real
routers is in test_tenants.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from macpool.contract import now_ms
from macpool.store import Candidate, Keys, Lease, Release, Reservation, ReserveRequest
from tests.blocking_store import BlockingStore
from tests.strict_keys import strict_keys  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("strict_keys")  # every script touches only its KEYS

KEYS = Keys()
LEASE = 60_000
QUEUE_LEASE = 3_000


def placed(answer: Reservation) -> tuple[str, str]:
    return answer.status, answer.node_id


class Store:
    """The store's API on a real Redis, plus the raw client (``r``) and the events channel to look at it."""

    def __init__(self, url: str) -> None:
        self.now = now_ms()  # the scripts' clock (ms): a test moves it on instead of sleeping
        self.api = BlockingStore(url, KEYS)
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(KEYS.events)

    def node(self, node_id: str, cap: int, models: str = "m", slots: int = 0, **kv: int) -> None:
        """A node as its heartbeat writes it; ``kv``: its KV cache (seq_ctx, kv_unified, kv_cells,
        n_predict)."""
        self.r.hset(KEYS.node(node_id), mapping={"capacity": cap, "state": "ready", "models": models,
                                                 "slots": slots, **kv})
        store = self.api.store
        store.known_nodes = store.known_nodes | {node_id}  # (as its router's next pool read finds it)

    def ask(
        self, rid: str, nodes: list[str] | list[Candidate], now: int | None = None, **kw: Any
    ) -> Reservation:
        """A reservation among ``nodes`` (names, or candidates as a router weighs them)."""
        kw.setdefault("queue_size", 8)
        kw.setdefault("enqueue", True)
        kw.setdefault("model", "m")
        kw.setdefault("queue_lease_ms", QUEUE_LEASE)
        candidates = [n if isinstance(n, Candidate) else Candidate(n) for n in nodes]
        request = ReserveRequest(rid, candidates, LEASE, **kw)
        return self.api.run(self.api.store.reserve(request, self.now if now is None else now))

    def release(self, rid: str, node: str, tenant: str = "anonymous", slots: int = 1, now: int | None = None,
                queue_lease_ms: int = QUEUE_LEASE) -> int:
        release = Release(rid, node, tenant, slots, queue_lease_ms=queue_lease_ms)
        return self.api.run(self.api.store.release(release, self.now if now is None else now))

    def tick(self, ms: int = 5) -> None:
        """``ms`` pass on the scripts' clock: what is asked next arrives after what was asked before (ties
        in arrival are broken by id)."""
        self.now += ms

    def held(self, node: str) -> list[str]:
        return sorted(self.r.zrange(KEYS.reservations(node), 0, -1))

    def tokens(self, node: str) -> dict[str, int]:
        """The tokens each request holds on ``node``, as recorded."""
        return {rid: int(t) for rid, t in self.r.hgetall(KEYS.tokens(node)).items()}

    def leave(self, rid: str, nodes: tuple[str, ...] = (), now: int | None = None) -> bool:
        """True when slots had been handed to it."""
        when = self.now if now is None else now
        return self.api.run(self.api.store.leave_queue(rid, nodes, QUEUE_LEASE, when))

    def events(self) -> list[str]:
        out = []
        while (message := self.pubsub.get_message(timeout=0.05)) is not None:
            out.append(message["data"])
        return out

    def close(self) -> None:
        self.pubsub.close()
        self.r.close()
        self.api.close()


@pytest.fixture
def store(redis_url: str) -> Iterator[Store]:
    store = Store(redis_url)
    yield store
    store.close()


def test_affinity_prefers_the_prefix_holder_until_it_is_much_busier(store: Store) -> None:
    store.node("a", 8)
    store.node("b", 8)
    conversation = ("h3", "h2", "h1")
    first = store.ask("r1", ["a", "b"], prefixes=conversation)
    assert first.status == "reserved" and first.affinity == "miss"
    holder, other = first.node_id, "b" if first.node_id == "a" else "a"
    # the next turn (a longer prefix whose shorter prefixes were recorded) goes back to the holder...
    turn = store.ask("r2", ["a", "b"], prefixes=("h4", *conversation))
    assert placed(turn) == ("reserved", holder) and turn.affinity == "hit"
    # ...until it has affinity_abs more in flight than the least-loaded node and a higher relative load
    store.ask("r3", ["a", "b"], prefixes=("x1",))  # an unrelated prompt: least-loaded goes to the other
    for i in range(3):
        assert store.ask(f"r{4 + i}", ["a", "b"], prefixes=conversation).node_id == holder
    # holder: r1 r2 r4 r5 r6 = 5 in flight, other: r3 = 1; the gap 4 meets the absolute threshold
    over = store.ask("r9", ["a", "b"], prefixes=conversation, affinity_abs=4, affinity_rel=1.5)
    assert placed(over) == ("reserved", other) and over.affinity == "overridden"
    # no prefixes: no affinity outcome at all
    assert store.ask("r10", ["a", "b"]).affinity == ""


def test_a_much_busier_prefix_holder_keeps_a_long_prompt_its_cache_makes_quicker_there(store: Store) -> None:
    def ask(rid: str, prefill_s: float, prefixes: tuple[str, ...] = ("turn2", "turn1"),
            shares: tuple[float, ...] = (1.0, 0.9)) -> Reservation:
        # two Macs alike: ttft 1 s, 2 s of decode; this request's prompt takes prefill_s to process anywhere
        candidates = [Candidate(n, 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=prefill_s) for n in ("a", "b")]
        return store.ask(rid, candidates, prefixes=prefixes, prefix_shares=shares, affinity_abs=2,
                         affinity_rel=1.5, batch_cost=0.175)

    store.node("a", 8)
    store.node("b", 8)
    for i in range(3):
        store.ask(f"busy{i}", ["a"])  # a runs 3 requests, b none: much busier by both thresholds

    def held_on_a(*hashes: str) -> None:  # a served the conversation's last turn (each ask records anew)
        store.r.delete(KEYS.affinity)
        store.r.hset(KEYS.affinity, mapping=dict.fromkeys(hashes, "a"))

    # a 30-second prefill stays where 90 % of it is cached: expected 3 + 2 x 1.7 = 6.4 s there (where prompts
    # count, the ones ahead of it are the backlog's, none here), 30 + 2 x 1.175 = 32.35 s on b
    held_on_a("turn1")
    stays = ask("long", prefill_s=30.0)
    assert placed(stays) == ("reserved", "a") and stays.affinity == "hit"
    # a short prompt moves: the wait on a outweighs what a's cache saves
    held_on_a("turn1")
    moves = ask("short", prefill_s=0.5)
    assert placed(moves) == ("reserved", "b") and moves.affinity == "overridden"
    # a session names the node: it covers what the content prefixes held there cover
    held_on_a("s-session", "turn1")
    session = ask("session", prefill_s=30.0, prefixes=("s-session", "new2", "turn1"), shares=(-1.0, 1.0, 0.9))
    assert placed(session) == ("reserved", "a") and session.affinity == "hit"
    # a session whose node holds none of its prompt any more is kept only while it is not much busier
    held_on_a("s-session")
    lost = ask("lost", prefill_s=30.0, prefixes=("s-session", "other2", "other1"), shares=(-1.0, 1.0, 0.5))
    assert placed(lost) == ("reserved", "b") and lost.affinity == "overridden"


def test_the_part_of_a_prompt_a_cache_does_not_hold_costs_more_a_token_the_deeper_it_starts(
    store: Store,
) -> None:
    def ask(rid: str, halving: float) -> Reservation:
        # a holds 90 % of a 36K-token prompt and runs 3 requests; b, idle, processes prompts 5 x faster
        candidates = [Candidate("a", 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=30.0),
                      Candidate("b", 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=6.0)]
        answer = store.ask(rid, candidates, prefixes=("turn2", "turn1"), prefix_shares=(1.0, 0.9),
                           affinity_abs=2, affinity_rel=1.5, batch_cost=0.175, prompt_tokens=36_000,
                           prefill_halving=halving)
        store.release(rid, answer.node_id)
        return answer

    store.node("a", 8)
    store.node("b", 8)
    for i in range(3):
        store.ask(f"busy{i}", ["a"])
    store.r.hset(KEYS.affinity, mapping={"turn1": "a"})
    # the last 3,600 tokens as a tenth of the prompt's time: 3 + 2 x 1.7 = 6.4 s on a, 6 + 2 x 1.175 = 8.35 s
    # on b
    assert ask("flat", halving=0).node_id == "a"
    store.r.delete(KEYS.affinity)  # a served the turn before, not this one
    store.r.hset(KEYS.affinity, mapping={"turn1": "a"})
    # 32,400 tokens in, each costs 6.7 times one at the start, where the prompt's average is 4 times:
    # 5.025 + 3.4 = 8.425 s on a
    assert ask("deep", halving=6_000).node_id == "b"


def test_where_prompts_count_the_wait_on_a_node_is_its_backlog_not_a_first_token_per_request(
    store: Store,
) -> None:
    def ask(rid: str, backlog_s: float) -> Reservation:
        # a runs 3 requests and measured slow first tokens (they waited on each other's prompts); a
        # processes this prompt in 2 s, b in 6 s
        candidates = [Candidate("a", 10.0, ttft_s=3.0, decode_s=1.0, prefill_s=2.0, backlog_s=backlog_s),
                      Candidate("b", 10.0, ttft_s=3.0, decode_s=1.0, prefill_s=6.0)]
        answer = store.ask(rid, candidates, batch_cost=0.175, prompt_tokens=20_000)
        store.release(rid, answer.node_id)
        return answer

    store.node("a", 8)
    store.node("b", 8)
    for i in range(3):
        store.ask(f"busy{i}", ["a"])
    # the prompts a runs are processed: 2 + 1 x 1.7 = 3.7 s there, 6 + 1 x 1.175 = 7.175 s on b
    assert ask("clear", backlog_s=0.0).node_id == "a"
    # 5 s of prompts sent there still ahead: 8.7 s
    assert ask("behind", backlog_s=5.0).node_id == "b"


def test_where_prompts_count_each_node_is_weighed_with_the_share_of_the_prompt_its_cache_holds(
    store: Store,
) -> None:
    # a served the longest prefix but has 30 s of prompts ahead; c served a shorter one, half the prompt
    for node in ("a", "b", "c"):
        store.node(node, 8)
    store.r.hset(KEYS.affinity, mapping={"p2": "a", "p1": "c"})
    candidates = [Candidate(n, 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=20.0, backlog_s=30.0 * (n == "a"))
                  for n in ("a", "b", "c")]
    answer = store.ask("r", candidates, prefixes=("p2", "p1"), prefix_shares=(0.95, 0.5), affinity_abs=2,
                       affinity_rel=1.5, batch_cost=0.175, prompt_tokens=20_000)
    # a: 30 + 1 + 2 x 1.175 = 33.35 s; b: 20 + 2.35 = 22.35 s; c: 10 + 2.35 = 12.35 s
    assert placed(answer) == ("reserved", "c") and answer.affinity == "overridden"
    assert answer.cached == pytest.approx(0.5)


def test_a_reservation_says_what_share_of_its_prompt_the_node_was_expected_to_hold(store: Store) -> None:
    store.node("a", 8)
    store.node("b", 8)
    store.r.hset(KEYS.affinity, mapping={"turn1": "a"})
    hit = store.ask("hit", ["a", "b"], prefixes=("turn2", "turn1"), prefix_shares=(1.0, 0.9))
    assert placed(hit) == ("reserved", "a") and hit.affinity == "hit" and hit.cached == 0.9
    miss = store.ask("miss", ["a", "b"], prefixes=("other",), prefix_shares=(1.0,))
    assert miss.affinity == "miss" and miss.cached == 0.0


def test_prompts_a_node_is_still_processing_send_the_next_one_elsewhere(store: Store) -> None:
    def ask(rid: str, backlog_on_a: float) -> Reservation:
        # a is the faster Mac (8 s for this prompt there, 12 s on b), both idle by their reservations
        candidates = [Candidate("a", 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=8.0, backlog_s=backlog_on_a),
                      Candidate("b", 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=12.0)]
        return store.ask(rid, candidates, batch_cost=0.175)

    store.node("a", 8)
    store.node("b", 8)
    assert ask("idle", backlog_on_a=0.0).node_id == "a"
    store.release("idle", "a")
    # a's router still waits for a 26K-token prompt's first token there: 10 s of it left
    assert ask("behind", backlog_on_a=10.0).node_id == "b"


def _session_turn(store: Store, rid: str, share: float, **kw: Any) -> Reservation:
    """A turn whose prompt the cache of a (1 slot) holds ``share`` of, where b holds none: 20 s of prompt
    from nothing on either, 2 s to decode."""
    candidates = [Candidate(n, 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=20.0) for n in ("a", "b")]
    return store.ask(rid, candidates, prefixes=("history",), prefix_shares=(share,), batch_cost=0.175,
                     prompt_tokens=30_000, **kw)


def test_a_turn_waits_for_the_full_node_holding_its_history_while_that_is_sooner(store: Store) -> None:
    store.node("a", 1)
    store.node("b", 2)
    store.r.hset(KEYS.affinity, "history", "a")
    store.ask("busy", ["a"])
    # a: 2 s of prompt left + 2 x 1.35 = 4.7 s once its slot frees; b now: 20 + 2 x 1.175 = 22.35 s
    assert _session_turn(store, "turn", 0.9).status == "queued"
    record = json.loads(store.r.hget(KEYS.queue_meta, "turn") or "{}")
    assert (record["stay"], record["hold"]) == ("a", "a")
    store.tick()
    # b's free slots are not the waiter's: a request behind it takes one, and a release there is not its
    assert placed(store.ask("other", ["a", "b"])) == ("reserved", "b")
    store.events()
    store.release("other", "b")
    assert store.events() == ["freed b"]
    assert _session_turn(store, "turn", 0.9, dequeue=True).status == "queued"
    store.release("busy", "a")
    assert store.events() == ["granted turn a 1"]
    taken = _session_turn(store, "turn", 0.9, dequeue=True)
    assert placed(taken) == ("reserved", "a") and taken.cached == pytest.approx(0.9)


def test_a_turn_waits_for_its_node_no_longer_than_the_time_its_cache_saves(store: Store) -> None:
    store.node("a", 1)
    store.node("b", 2)
    store.r.hset(KEYS.affinity, "history", "a")
    store.ask("busy", ["a"])
    assert _session_turn(store, "turn", 0.9).status == "queued"
    for _ in range(17):  # 17 s waited (asking again each second, as its router does) of the 17.65 s a's
        store.tick(1_000)  # cache saves
        assert _session_turn(store, "turn", 0.9, dequeue=True).status == "queued"
    store.tick(1_000)
    assert placed(_session_turn(store, "turn", 0.9, dequeue=True)) == ("reserved", "b")
    assert store.r.hget(KEYS.queue_meta, "turn") is None


def test_a_turn_does_not_wait_for_a_node_holding_none_of_it_too_small_or_sharing_cells(store: Store) -> None:
    store.node("a", 1)
    store.node("b", 4)
    store.r.hset(KEYS.affinity, "history", "a")
    store.ask("busy", ["a"])
    # a's cache holds none of this prompt: nothing to wait for
    assert placed(_session_turn(store, "small", 0.0)) == ("reserved", "b")
    # a node that could never hold the prompt is not waited for
    store.node("a", 1, seq_ctx=16_384)
    assert placed(_session_turn(store, "long", 0.9)) == ("reserved", "b")
    # nor one whose slots share their cells: an idle session's cache lives on there only in llama-server's
    # prompt cache in host memory, which the pool cannot see
    store.node("a", 1, seq_ctx=131_072, kv_unified=1, kv_cells=131_072)
    assert placed(_session_turn(store, "shared", 0.9)) == ("reserved", "b")


def test_a_session_stays_on_its_node_through_a_backlog_there_until_that_node_is_much_busier(
        store: Store) -> None:
    def turn(rid: str) -> Reservation:
        # a holds the session's history (0.9 of its prompt); a minute of other prompts is queued there
        candidates = [Candidate("a", 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=20.0, backlog_s=60.0),
                      Candidate("b", 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=20.0)]
        return store.ask(rid, candidates, prefixes=("s-one", "history"), prefix_shares=(-1.0, 0.9),
                         batch_cost=0.175, prompt_tokens=30_000)

    store.node("a", 8)
    store.node("b", 8)
    store.r.hset(KEYS.affinity, mapping={"s-one": "a", "history": "a"})
    # b would answer sooner, its whole history processed again there (about 22 s against a's 64 s), holding
    # b's streams as long: a's backlog passes, the session stays
    stays = turn("stays")
    assert placed(stays) == ("reserved", "a") and stays.cached == pytest.approx(0.9)
    assert stays.affinity == "hit"
    store.release("stays", "a")
    # a much busier (4 requests more than b, and over 1.5 times b's share of its slots): the session moves
    for i in range(4):
        store.ask(f"busy-{i}", ["a"])
    moves = turn("moves")
    assert placed(moves) == ("reserved", "b") and moves.affinity == "overridden"


def test_a_new_session_goes_where_it_evicts_no_other_sessions_cache(store: Store) -> None:
    window = 300_000

    def ask(rid: str, session: str) -> Reservation:
        # a (2 slots) is the faster Mac: this prompt takes 10 s there, 14 s on b (4 slots)
        candidates = [Candidate("a", 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=10.0),
                      Candidate("b", 10.0, ttft_s=1.0, decode_s=2.0, prefill_s=14.0)]
        answer = store.ask(rid, candidates, prefixes=(f"s-{session}", f"{session}-1"),
                           prefix_shares=(-1.0, 1.0), batch_cost=0.175, session_window_ms=window)
        store.release(rid, answer.node_id)  # its turn is over: the session thinks, its cache stays
        store.tick()
        return answer

    store.node("a", 8, slots=2)
    store.node("b", 8, slots=4)
    assert ask("one", "one").node_id == "a"
    assert ask("two", "two").node_id == "a"
    assert store.r.zcard(KEYS.sessions("a")) == 2
    # both of a's slots hold a session's cache: a third session would evict one, which costs its prompt again
    assert ask("three", "three").node_id == "b"
    # a session already there keeps its place
    assert ask("one-again", "one").node_id == "a"
    # sessions that sent nothing for the window hold no slot any more
    store.tick(window + 1)
    assert ask("four", "four").node_id == "a"
    assert store.r.zrange(KEYS.sessions("a"), 0, -1) == ["s-four"]


def test_a_new_session_counts_the_turns_the_sessions_already_on_a_node_will_send(store: Store) -> None:
    window = 300_000

    def ask(rid: str, session: str, enqueue: bool = True) -> Reservation:
        # a is the faster Mac (this prompt takes 10 s there, 14 s on b); a turn there takes about 3 s to a
        # first token; both have a slot for every session
        candidates = [Candidate("a", 10.0, ttft_s=3.0, decode_s=2.0, prefill_s=10.0),
                      Candidate("b", 10.0, ttft_s=3.0, decode_s=2.0, prefill_s=14.0)]
        answer = store.ask(rid, candidates, prefixes=(f"s-{session}", f"{session}-1"),
                           prefix_shares=(-1.0, 1.0), batch_cost=0.175, session_window_ms=window,
                           enqueue=enqueue)
        store.release(rid, answer.node_id)  # the turn is over: its session thinks, and comes back
        store.tick()
        return answer

    def sessions(node: str) -> list[str]:
        return sorted(store.r.zrange(KEYS.sessions(node), 0, -1))

    store.node("a", 8, slots=8)
    store.node("b", 8, slots=8)
    assert ask("one", "one").node_id == "a"
    # one session on a: its next turn (3 s) will come while this one's 10 s prompt is processed there, which
    # still answers sooner than b
    assert ask("two", "two").node_id == "a"
    # two sessions on a, 6 s of turns to come: b answers sooner
    assert ask("three", "three").node_id == "b"
    # sessions that sent nothing for the window count no more: a again
    store.tick(window + 1)
    assert ask("four", "four").node_id == "a"
    # a session that has a node stays there: the rule is for sessions that open
    assert ask("one-again", "one").node_id == "a"
    # a session that moves (its node full) counts where it runs now, no longer where it ran
    store.node("a", 2, slots=8)
    store.ask("busy-1", ["a"])
    store.ask("busy-2", ["a"])
    assert ask("one-moves", "one", enqueue=False).node_id == "b"
    assert sessions("a") == ["s-four"] and sessions("b") == ["s-one"]


def test_affinity_memory_is_bounded_least_recently_used_first(store: Store) -> None:
    store.node("a", 100)
    for i in range(10):
        store.ask(f"r{i}", ["a"], prefixes=(f"p{i}",), affinity_max_entries=4)
    assert store.r.hlen(KEYS.affinity) == 4
    assert set(store.r.hkeys(KEYS.affinity)) == {"p6", "p7", "p8", "p9"}
    # a much lower bound (another replica's setting, or a restart with a smaller one) converges, never fails
    store.r.hset(KEYS.affinity, mapping={f"old{i}": "a" for i in range(12_000)})
    store.r.zadd(KEYS.affinity + ":lru", {f"old{i}": i for i in range(12_000)})
    for i in range(14):
        assert store.ask(f"s{i}", ["a"], prefixes=(f"q{i}",), affinity_max_entries=10).status == "reserved"
    assert store.r.zcard(KEYS.affinity + ":lru") == 10 and store.r.hlen(KEYS.affinity) == 10


def test_release_hands_the_slot_to_the_head_of_the_queue_priority_then_fairness(store: Store) -> None:
    store.node("a", 2)
    assert store.ask("busy-1", ["a"], tenant="flood").status == "reserved"
    assert store.ask("busy-2", ["a"], tenant="flood").status == "reserved"
    assert store.ask("q-batch", ["a"], tenant="light", priority="batch", batch_queue_max=4).status == "queued"
    assert store.ask("q-flood", ["a"], tenant="flood").status == "queued"
    assert store.ask("q-light", ["a"], tenant="light").status == "queued"
    store.events()
    # interactive before batch; among interactive, the tenant with fewer in flight (light: 0, flood: 2)
    store.release("busy-1", "a", "flood")
    assert store.events() == ["granted q-light a 1"]
    picked = store.ask("q-light", ["a"], tenant="light", dequeue=True)
    assert placed(picked) == ("reserved", "a")
    assert picked.affinity == ""  # no prompt prefix: no affinity outcome
    store.release("busy-2", "a", "flood")
    assert store.events() == ["granted q-flood a 1"]
    # the flood tenant's pick-up is slow; meanwhile nothing can jump the queue: a new arrival waits
    assert store.ask("late", ["a"], tenant="flood").status == "queued"
    # a waiter that gives up after being handed a slot passes it on to the next in line
    assert store.leave("q-flood")
    assert store.events() == ["granted late a 1"]
    store.release("q-light", "a", "light")
    assert store.events() == ["granted q-batch a 1"]


def test_a_new_arrival_does_not_jump_waiters_but_ranks_ahead_of_lower_classes(store: Store) -> None:
    store.node("a", 1)
    store.ask("busy", ["a"])
    # (queued 50 ms ago: requests of the same millisecond are ordered by id, and these calls can be that fast)
    waiting = store.ask("w-batch", ["a"], priority="batch", batch_queue_max=4, now=store.now - 50)
    assert waiting.status == "queued"
    # capacity grows (a heartbeat, not a release): the interactive arrival takes the new slot at once
    store.node("a", 2)
    assert store.ask("new-int", ["a"]).status == "reserved"
    store.node("a", 3)
    # a batch arrival queues behind the batch waiter; the waiter itself takes the slot
    assert store.ask("new-batch", ["a"], priority="batch", batch_queue_max=4).status == "queued"
    assert store.ask("w-batch", ["a"], priority="batch", dequeue=True).status == "reserved"


def test_batch_is_shed_first_when_the_queue_fills(store: Store) -> None:
    store.node("a", 1)
    store.ask("busy", ["a"])
    assert store.ask("b1", ["a"], priority="batch", queue_size=3, batch_queue_max=1).status == "queued"
    # batch may hold only its share of the queue: the next one is shed (503), not queued
    assert store.ask("b2", ["a"], priority="batch", queue_size=3, batch_queue_max=1).status == "shed"
    assert store.ask("i1", ["a"], queue_size=3).status == "queued"
    assert store.ask("i2", ["a"], queue_size=3).status == "queued"
    store.events()
    # the queue is full: an interactive request takes the queued batch request's place
    assert store.ask("i3", ["a"], queue_size=3).status == "queued"
    assert store.events() == ["shed b1"]
    assert store.ask("b1", ["a"], priority="batch", dequeue=True).status == "shed"
    # full of interactive requests: the next one is refused outright
    assert store.ask("i4", ["a"], queue_size=3).status == "full"


def test_per_key_limit_counts_in_flight_and_queued(store: Store) -> None:
    store.node("a", 2)
    assert store.ask("t1", ["a"], tenant="t", key_limit=3).status == "reserved"
    assert store.ask("t2", ["a"], tenant="t", key_limit=3).status == "reserved"
    assert store.ask("t3", ["a"], tenant="t", key_limit=3).status == "queued"
    limited = store.ask("t4", ["a"], tenant="t", key_limit=3)
    assert limited.status == "limited" and limited.count == 3
    assert store.ask("u1", ["a"], tenant="u", key_limit=3).status == "queued"  # other tenants are unaffected
    store.events()
    store.release("t1", "a", "t")
    assert store.events() == ["granted u1 a 1"]  # fairness: u has nothing in flight, t has one
    assert store.ask("t3", ["a"], tenant="t", key_limit=3, dequeue=True).status == "queued"
    assert store.ask("t5", ["a"], tenant="t", key_limit=3).status == "queued"  # t2 + t3 + t5 = 3
    assert store.ask("t6", ["a"], tenant="t", key_limit=3).status == "limited"


def test_models_decide_who_may_take_a_released_slot(store: Store) -> None:
    store.node("a", 1, models="m1")
    store.node("b", 1, models="m2")
    store.ask("busy-a", ["a"], model="m1")
    store.ask("busy-b", ["b"], model="m2")
    store.ask("wants-m2", ["b"], model="m2")
    store.events()
    store.release("busy-a", "a")
    assert store.events() == ["freed a"]  # the only waiter cannot run on a: nobody is handed the slot
    store.release("busy-b", "b")
    assert store.events() == ["granted wants-m2 b 1"]


def test_a_slot_handed_to_a_dead_waiter_comes_back_after_the_queue_lease(store: Store) -> None:
    store.node("a", 1)
    t = store.now
    store.ask("busy", ["a"], now=t)
    assert store.ask("waiter", ["a"], queue_lease_ms=200, now=t).status == "queued"
    store.events()
    store.release("busy", "a", now=t)
    assert store.events() == ["granted waiter a 1"]
    # nobody picks it up (the waiter's router died): the slot is free again once the short lease runs out
    assert store.ask("next", ["a"], enqueue=False, now=t + 199).status == "full"
    assert store.ask("next", ["a"], enqueue=False, now=t + 201).status == "reserved"


def test_a_waiter_taking_its_slot_gets_the_full_lease(store: Store) -> None:
    store.node("a", 1)
    store.ask("busy", ["a"])
    store.ask("waiter", ["a"])
    store.release("busy", "a")
    assert store.ask("waiter", ["a"], dequeue=True).status == "reserved"
    expiry = store.r.zscore(KEYS.reservations("a"), "waiter")
    assert expiry is not None and expiry > now_ms() + LEASE - 5_000
    assert store.r.zscore(KEYS.in_flight, "anonymous\twaiter") == expiry


def test_a_waiter_excluding_a_node_is_neither_handed_its_slots_nor_holds_them_back(store: Store) -> None:
    # the waiter's router tried node a already (or a's circuit is open there): its attempts exclude a
    store.node("a", 1)
    store.node("b", 1)
    store.ask("busy-a", ["a"])
    store.ask("busy-b", ["b"])
    assert store.ask("picky", ["b"], excluded=("a",)).status == "queued"
    store.tick()
    assert store.ask("any", ["a", "b"]).status == "queued"
    store.events()
    store.release("busy-a", "a")  # a's slot skips picky, first in line, for the next one
    assert store.events() == ["granted any a 1"]
    assert placed(store.ask("any", ["a", "b"], dequeue=True)) == ("reserved", "a")
    store.release("any", "a")
    assert store.events() == ["freed a"]
    # a free slot on a is not held back for picky from a later arrival (it would otherwise wait behind it)
    assert placed(store.ask("late", ["a", "b"], enqueue=False)) == ("reserved", "a")
    # once its router takes a again (the circuit closed), a is picky's like any node
    assert store.ask("picky", ["b"], dequeue=True, excluded=()).status == "queued"
    store.release("late", "a")
    assert store.events() == ["granted picky a 1"]


def test_a_handed_over_slot_gone_before_it_is_taken_is_not_counted_as_held(store: Store) -> None:
    store.node("a", 1)
    store.ask("busy", ["a"])
    store.ask("waiter", ["a"])
    store.events()
    store.release("busy", "a")
    assert store.events() == ["granted waiter a 1"]
    store.r.zrem(KEYS.reservations("a"), "waiter")  # as if its short lease had run out
    answer = store.ask("waiter", ["a"], dequeue=True)
    assert placed(answer) == ("reserved", "a")  # a is free, and the waiter takes it properly
    assert store.r.zscore(KEYS.reservations("a"), "waiter") is not None
    assert store.r.zcard(KEYS.queue) == 0


def test_a_waiter_declines_a_slot_on_a_node_it_no_longer_takes_and_it_goes_to_the_next(store: Store) -> None:
    # the waiter's router tries node a, and fails, after a's slot was handed to it: it turns it down
    store.node("a", 1)
    store.node("b", 1)
    store.ask("busy-a", ["a"])
    store.ask("busy-b", ["b"])
    assert store.ask("picky", ["b"]).status == "queued"
    store.tick()
    assert store.ask("any", ["a", "b"]).status == "queued"
    store.events()
    store.release("busy-a", "a")  # hands a's slot to the head of the queue, by model only
    assert store.events() == ["granted picky a 1"]
    # picky's next attempt declines it: the slot goes on to the next in line, picky keeps its place
    assert placed(store.ask("picky", ["b"], dequeue=True, excluded=("a",))) == ("queued", "")
    assert store.events() == ["granted any a 1"]
    assert store.r.zscore(KEYS.reservations("a"), "picky") is None
    assert placed(store.ask("any", ["a", "b"], dequeue=True)) == ("reserved", "a")
    # picky is still first in line for b
    store.release("busy-b", "b")
    assert store.events() == ["granted picky b 1"]
    assert placed(store.ask("picky", ["b"], dequeue=True)) == ("reserved", "b")
    assert store.r.zcard(KEYS.queue) == 0 and store.r.hlen(KEYS.queue_meta) == 0


def test_a_declined_slot_nobody_else_wants_is_freed(store: Store) -> None:
    store.node("a", 1)
    store.node("b", 1)
    store.ask("busy-a", ["a"])
    store.ask("busy-b", ["b"])
    store.ask("picky", ["b"])
    store.events()
    store.release("busy-a", "a")
    assert store.events() == ["granted picky a 1"]
    assert store.ask("picky", ["b"], dequeue=True).status == "queued"
    assert store.events() == ["freed a"]
    assert store.r.zcard(KEYS.reservations("a")) == 0
    # a later arrival is not held back for picky, nor is a slot on a handed to picky again
    assert placed(store.ask("new", ["a"], enqueue=False)) == ("reserved", "a")
    store.release("new", "a")
    assert store.events() == ["freed a"]
    assert store.ask("picky", ["b"], dequeue=True).status == "queued"


def test_a_hand_over_prefers_a_waiter_whose_prefix_the_node_holds_among_equals(store: Store) -> None:
    store.node("a", 1)
    store.node("b", 1)
    store.ask("seed-a", ["a", "b"], prefixes=("conv-a",))  # a now holds conv-a (the least-loaded pick)
    holder = store.r.hget(KEYS.affinity, "conv-a")
    other = "b" if holder == "a" else "a"
    store.ask("busy", ["a", "b"])  # fills the other node
    assert store.ask("first", ["a", "b"], prefixes=("conv-x",)).status == "queued"
    assert store.ask("second", ["a", "b"], prefixes=("conv-a",)).status == "queued"
    store.events()
    # the holder frees a slot: the younger waiter that holds a prefix there goes before the head
    store.release("seed-a", holder)
    assert store.events() == [f"granted second {holder} 1"]
    picked = store.ask("second", ["a", "b"], prefixes=("conv-a",), dequeue=True)
    assert placed(picked) == ("reserved", holder) and picked.affinity == "hit"
    store.release("busy", other)
    assert store.events() == [f"granted first {other} 1"]
    assert store.ask("first", ["a", "b"], prefixes=("conv-x",), dequeue=True).affinity == "miss"


def test_affinity_never_overrides_priority_or_fairness_in_a_hand_over(store: Store) -> None:
    store.node("a", 1)
    store.node("b", 1)
    store.ask("t1-b", ["b"], tenant="t1")  # t1 keeps one request in flight on b throughout
    store.ask("seed", ["a"], prefixes=("conv",), tenant="t1")  # a holds conv
    assert store.ask("light", ["a"], tenant="t2").status == "queued"
    assert store.ask("heavy", ["a"], prefixes=("conv",), tenant="t1").status == "queued"
    assert store.ask("batch", ["a"], prefixes=("conv",), tenant="t2", priority="batch",
                     batch_queue_max=4).status == "queued"
    store.events()
    store.release("seed", "a", "t1")  # t1 still has 1 in flight, t2 none: light goes first
    assert store.events() == ["granted light a 1"]
    assert store.ask("light", ["a"], tenant="t2", dequeue=True).status == "reserved"
    store.release("light", "a", "t2")  # interactive heavy before batch, whatever batch holds
    assert store.events() == ["granted heavy a 1"]


def test_a_request_is_passed_over_for_affinity_at_most_four_times(store: Store) -> None:
    store.node("a", 1)
    store.ask("seed", ["a"], prefixes=("conv",))
    store.ask("patient", ["a"])  # no prefix anywhere: the head of the queue
    for i in range(6):
        store.ask(f"warm-{i}", ["a"], prefixes=("conv",))  # each prefers a
    store.events()
    granted = []
    holder = "seed"
    for _ in range(6):
        store.release(holder, "a")
        (event,) = store.events()
        holder = event.split()[1]
        granted.append(holder)
        store.ask(holder, ["a"], prefixes=("conv",), dequeue=True)
    assert granted[:5] == ["warm-0", "warm-1", "warm-2", "warm-3", "patient"]


# --- requests running several generations at once: one slot each -----------------------------------------

def test_a_request_holds_one_slot_per_generation_and_gives_them_all_back(store: Store) -> None:
    store.node("a", 4)
    answer = store.ask("three", ["a"], generations=3)
    assert answer == Reservation("reserved", "a", 3, "", 3)
    assert store.held("a") == ["three", "three#2", "three#3"]
    assert store.r.zcard(KEYS.in_flight) == 1  # per-key limits count requests
    # one slot left: a pair does not fit, a single does
    assert store.ask("pair", ["a"], generations=2, enqueue=False).status == "full"
    one = store.ask("one", ["a"], enqueue=False)
    assert (one.status, one.node_id, one.count) == ("reserved", "a", 4)
    store.events()
    assert store.release("three", "a", slots=3) == 3
    assert store.events() == ["freed a"] * 3  # one per slot: each may wake a waiter
    assert store.held("a") == ["one"]
    assert store.r.zcard(KEYS.in_flight) == 1


def test_the_slots_a_request_holds_are_bounded_by_the_nodes_llama_server_slots(store: Store) -> None:
    # llama-server runs at most its slots of a request's generations at once and queues the rest
    store.node("a", 2, slots=2)
    assert store.ask("many", ["a"], generations=5) == Reservation("reserved", "a", 2, "", 2)
    assert store.held("a") == ["many", "many#2"]


def test_a_release_not_told_the_count_gives_back_every_slot_the_request_holds(store: Store) -> None:
    # a cancelled reservation whose answer never came back is undone without knowing what it took
    store.node("a", 4)
    store.ask("three", ["a"], generations=3)
    store.ask("one", ["a"])
    assert store.release("three", "a", slots=0) == 3
    assert store.held("a") == ["one"]
    assert store.release("three", "a", slots=0) == 0  # a release of nothing changes nothing


def test_a_waiter_needing_several_slots_is_handed_them_together_and_holds_back_the_ones_behind(
        store: Store) -> None:
    store.node("a", 3)
    for i in range(3):
        store.ask(f"busy-{i}", ["a"])
    assert store.ask("pair", ["a"], generations=2).status == "queued"
    store.tick()
    assert store.ask("single", ["a"]).status == "queued"
    store.events()
    store.release("busy-0", "a")  # one free slot: not enough for the pair, and the single waits behind it
    assert store.events() == ["freed a"]
    assert store.ask("single", ["a"], dequeue=True).status == "queued"
    assert store.ask("late", ["a"], enqueue=False).status == "full"  # nor does a new arrival take it
    store.release("busy-1", "a")
    assert store.events() == ["granted pair a 2"]
    taken = store.ask("pair", ["a"], generations=2, dequeue=True)
    assert taken == Reservation("reserved", "a", 3, "", 2)
    expiry = store.r.zscore(KEYS.reservations("a"), "pair#2")  # the full lease, on each of its slots
    assert expiry is not None and expiry > now_ms() + LEASE - 5_000
    store.release("busy-2", "a")
    assert store.events() == ["granted single a 1"]


def test_one_release_hands_its_slots_to_as_many_waiters_as_they_serve(store: Store) -> None:
    store.node("a", 3)
    store.ask("big", ["a"], generations=3)
    store.ask("w1", ["a"])
    store.tick()
    store.ask("w2", ["a"])
    store.events()
    store.release("big", "a", slots=3)
    assert store.events() == ["granted w1 a 1", "granted w2 a 1", "freed a"]


def test_a_waiter_leaving_after_it_was_handed_several_slots_passes_them_all_on(store: Store) -> None:
    store.node("a", 2)
    store.ask("busy", ["a"], generations=2)
    store.ask("pair", ["a"], generations=2)
    store.tick()
    store.ask("w1", ["a"])
    store.events()
    store.release("busy", "a", slots=2)
    assert store.events() == ["granted pair a 2"]
    assert store.leave("pair")
    assert store.events() == ["granted w1 a 1", "freed a"]
    assert store.held("a") == ["w1"]


def test_a_node_too_small_for_a_waiter_never_holds_its_slots_back(store: Store) -> None:
    # the pair can only ever run on b: a's slots go to the single behind it
    store.node("a", 1)
    store.node("b", 2)
    store.ask("busy-a", ["a"])
    store.ask("busy-b", ["b"], generations=2)
    assert store.ask("pair", ["b"], generations=2).status == "queued"
    store.tick()
    assert store.ask("single", ["a", "b"]).status == "queued"
    store.events()
    assert store.ask("late", ["a", "b"], enqueue=False).status == "full"
    store.release("busy-a", "a")
    assert store.events() == ["granted single a 1"]
    store.release("single", "a")
    assert placed(store.ask("late", ["a", "b"], enqueue=False)) == ("reserved", "a")


def test_a_waiter_needing_several_slots_holds_back_only_the_node_it_waits_on(store: Store) -> None:
    # a, b and c have one free slot each; the pair fits on none and waits on a (the most free slots, then
    # the lowest id): a's free slot is held back for it, b's and c's go to the requests behind it meanwhile
    for node in ("a", "b", "c"):
        store.node(node, 2)
        store.ask(f"busy-{node}", [node])
    assert store.ask("pair", ["a", "b", "c"], generations=2).status == "queued"
    store.tick()
    placed = {rid: store.ask(rid, ["a", "b", "c"]).node_id for rid in ("s1", "s2")}
    assert set(placed.values()) == {"b", "c"}
    assert store.ask("s3", ["a", "b", "c"]).status == "queued"
    store.events()
    store.release("s1", placed["s1"])  # a node the pair does not wait on: its slot goes to the single
    assert [e.split()[:2] for e in store.events()] == [["granted", "s3"]]
    store.release("busy-a", "a")
    assert store.events() == ["granted pair a 2"]


@pytest.mark.parametrize("model", ["", "alias"])
def test_slots_held_back_for_a_waiter_are_kept_from_arrivals_naming_another_name_or_none(
        store: Store, model: str) -> None:
    # a serves the model as "m" and "alias"; the pair asked for "m" and waits on a, whose one free slot is
    # held back for it: a request naming no model, or the alias, must not take that slot either
    store.node("a", 2, models="m\nalias")
    store.ask("busy-a", ["a"])
    assert store.ask("pair", ["a"], generations=2).status == "queued"
    store.tick()
    assert store.ask("late", ["a"], model=model).status == "queued"
    assert store.held("a") == ["busy-a"]
    store.events()
    store.release("busy-a", "a")
    assert store.events() == ["granted pair a 2"]


def _pair_waiting_on_a_with_a_single_behind(store: Store, b_busy: tuple[int, ...] = (1, 1)) -> None:
    """a has one slot free, held back for the pair queued ahead of the single; b is full (its requests
    running ``b_busy`` generations each)."""
    store.node("a", 2)
    store.node("b", sum(b_busy))
    store.ask("busy-a", ["a"])
    for i, k in enumerate(b_busy):
        store.ask(f"busy-b{i}", ["b"], generations=k)
    assert store.ask("pair", ["a", "b"], generations=2).status == "queued"
    store.tick()
    assert store.ask("single", ["a", "b"]).status == "queued"
    assert store.ask("single", ["a", "b"], dequeue=True).status == "queued"
    store.events()


def test_the_slot_held_back_for_a_waiter_goes_on_when_it_takes_slots_handed_to_it_elsewhere(
        store: Store) -> None:
    _pair_waiting_on_a_with_a_single_behind(store, b_busy=(2,))
    store.release("busy-b0", "b", slots=2)  # two slots at once on b: the pair, at the head, gets them
    assert store.events() == ["granted pair b 2"]
    assert placed(store.ask("pair", ["a", "b"], generations=2, dequeue=True)) == ("reserved", "b")
    # a's free slot was held back for the pair only: the single gets it now, not at a's next release
    assert store.events() == ["granted single a 1"]
    assert placed(store.ask("single", ["a", "b"], dequeue=True)) == ("reserved", "a")


def test_the_slot_held_back_for_a_waiter_goes_on_when_it_reserves_on_its_own(store: Store) -> None:
    _pair_waiting_on_a_with_a_single_behind(store)
    store.r.hset(KEYS.node("a"), "capacity", 4)  # a heartbeat raised a's capacity: the pair fits there now
    assert placed(store.ask("pair", ["a", "b"], generations=2, dequeue=True)) == ("reserved", "a")
    assert store.events() == ["granted single a 1"]


def test_the_slot_held_back_for_a_waiter_goes_on_when_it_gives_up(store: Store) -> None:
    _pair_waiting_on_a_with_a_single_behind(store)
    assert not store.leave("pair", ("a", "b"))  # its queue timeout, or its client left
    assert store.events() == ["granted single a 1"]
    assert store.ask("late", ["a", "b"], enqueue=False).status == "full"


def test_a_waiter_with_no_node_to_wait_on_holds_back_every_node_it_could_run_on(store: Store) -> None:
    # an entry with no node to wait on (hold "": reserve.lua's designate found no candidate to run it)
    # holds back the free slots of every node it could run on
    for node in ("a", "b"):
        store.node(node, 2)
        store.ask(f"busy-{node}", [node])
    assert store.ask("pair", ["a", "b"], generations=2).status == "queued"
    meta = store.r.hget(KEYS.queue_meta, "pair")
    assert meta is not None and json.loads(meta)["hold"] == "a"
    store.r.hset(KEYS.queue_meta, "pair", json.dumps({**json.loads(meta), "hold": ""}))
    store.tick()
    assert store.ask("late", ["a", "b"], enqueue=False).status == "full"


def test_a_renewal_renews_every_slot_and_recreates_them_all_when_gone(store: Store) -> None:
    store.node("a", 4)
    store.ask("pair", ["a"], generations=2)
    lease = Lease("pair", "a", slots=2)
    now = store.now + LEASE

    def renew() -> list[bool]:
        return store.api.run(store.api.store.renew([lease], LEASE, now))

    assert renew() == [False]
    key = KEYS.reservations("a")
    assert [store.r.zscore(key, m) for m in ("pair", "pair#2")] == [now + LEASE, now + LEASE]
    store.r.delete(key)  # Redis restarted empty while the request runs
    assert renew() == [True]
    assert store.held("a") == ["pair", "pair#2"]


def test_slots_held_back_on_one_node_leave_a_node_too_small_for_the_waiter_to_others(store: Store) -> None:
    # b (the least utilised, and the node holding the prompt's prefix) holds its free slots back for the
    # quad, which can never run on s: s's free slot is anyone else's
    store.node("s", 2)
    store.node("b", 4)
    store.ask("busy-s", ["s"])
    store.ask("busy-b", ["b"], prefixes=("conv",))
    assert store.ask("quad", ["b"], generations=4).status == "queued"
    store.tick()
    assert placed(store.ask("late", ["s", "b"], enqueue=False)) == ("reserved", "s")
    store.release("late", "s")
    turn = store.ask("turn", ["s", "b"], prefixes=("conv",), enqueue=False)
    assert placed(turn) == ("reserved", "s") and turn.affinity == "overridden"


def test_a_waiter_that_fits_only_where_slots_are_held_back_leaves_the_other_nodes_to_those_behind(
        store: Store) -> None:
    store.node("s", 2)
    store.node("b", 4)
    store.ask("busy-s", ["s"])
    store.ask("busy-b", ["b"])
    store.ask("quad", ["b"], generations=4)
    store.tick()
    # fits neither: s has one free slot, b's are the quad's; it waits on b (the most free slots) too
    assert store.ask("pair", ["s", "b"], generations=2).status == "queued"
    store.tick()
    # s's free slot, too few for the pair, goes to the request behind them (as a release on s hands it over)
    assert placed(store.ask("late", ["s", "b"], enqueue=False)) == ("reserved", "s")


def test_a_waiter_waits_on_its_node_also_for_a_request_that_does_not_go_there(store: Store) -> None:
    # the quad waits on a; a request whose router no longer sends it to a (it tried a, or a's circuit is open
    # there) takes b's free slot: the quad does not wait on b
    store.node("a", 4)
    store.node("b", 4)
    store.ask("busy-a", ["a"])
    store.ask("busy-b", ["b"], generations=3)
    assert store.ask("quad", ["a", "b"], generations=4).status == "queued"  # a has the most free slots
    store.tick()
    assert placed(store.ask("single", ["b"], excluded=("a",))) == ("reserved", "b")
    store.release("single", "b")
    store.r.sadd(KEYS.drained, "a")  # the quad can no longer wait on a: it waits on b, for such a request too
    assert store.ask("next", ["b"], excluded=("a",), enqueue=False).status == "full"


def test_a_hand_over_does_not_shorten_the_life_of_the_leases_already_held(store: Store) -> None:
    # the slot is handed over with the short queue lease; the node's other reservations keep their full
    # lease: their key must outlive the hand-over, renewed or not (the requests in flight live in a key
    # without a TTL, pruned by their leases)
    store.node("a", 2)
    store.ask("long", ["a"])
    store.ask("done", ["a"])
    store.ask("waiter", ["a"])
    store.events()
    store.release("done", "a", queue_lease_ms=100)
    assert store.events() == ["granted waiter a 1"]
    # the keys live on for the full lease (Redis's own clock ends them: no `now` to pass), not the
    # queue lease the slot was handed over with
    assert store.r.pttl(KEYS.reservations("a")) > LEASE
    assert store.r.pttl(KEYS.in_flight) == -1 and store.r.zcard(KEYS.in_flight) == 2


def test_a_waiter_taking_its_slot_keeps_it_for_the_full_lease(store: Store) -> None:
    store.node("a", 1)
    store.ask("done", ["a"])
    store.ask("waiter", ["a"])
    store.release("done", "a", queue_lease_ms=100)
    assert placed(store.ask("waiter", ["a"], dequeue=True)) == ("reserved", "a")
    # its key lives on for the full lease (Redis's own clock ends it), not the queue lease it was handed
    # the slot with; it counts in flight for the full lease too
    assert store.r.pttl(KEYS.reservations("a")) > LEASE
    expiry = store.r.zscore(KEYS.reservations("a"), "waiter")
    assert store.r.zscore(KEYS.in_flight, "anonymous\twaiter") == expiry == store.now + LEASE


def test_a_waiter_whose_place_lapsed_keeps_no_slot_handed_to_it(store: Store) -> None:
    # its router stalled past the queue lease (or runs a clock behind the others'): once its place is gone it
    # can no longer take the slots handed to it - they lapse with it, not 3 s after they were handed over
    store.node("a", 1)
    store.node("b", 1)
    t = store.now
    store.ask("busy-a", ["a"], now=t)
    store.ask("busy-b", ["b"], now=t)
    assert store.ask("late", ["a", "b"], now=t).status == "queued"  # its place lasts until t + QUEUE_LEASE
    for busy, node in (("busy-a", "a"), ("busy-b", "b")):  # a's slot is handed to it, b's is left free
        store.release(busy, node, now=t + 1_000)
    answer = store.ask("late", ["a", "b"], dequeue=True, now=t + QUEUE_LEASE + 1)  # a new arrival now
    assert answer.status == "reserved"
    assert store.held("a") + store.held("b") == ["late"]  # one slot, on one node


def test_a_lease_ending_now_is_over_also_for_a_waiter_passing_on_held_back_slots(store: Store) -> None:
    store.node("a", 1)
    t = store.now
    store.ask("busy", ["a"], now=t - LEASE)  # its lease ends at t
    assert store.ask("single", ["a"], now=t - 10).status == "queued"
    store.events()
    store.leave("pair", ("a",), now=t)  # a waiter of two generations leaves
    assert store.events() == ["granted single a 1"]


# --- capacity counted in tokens -------------------------------------------------------------------------

K = 1024
UNIFIED_64K = {"seq_ctx": 64 * K, "kv_unified": 1, "kv_cells": 64 * K}  # 4 slots over one pool of cells


def tokens(prompt: int, output: int = 0) -> dict[str, int]:
    return {"prompt_tokens": prompt, "output_tokens": output}


def test_a_unified_node_admits_four_8k_requests_or_one_60k_request_not_five_of_either(store: Store) -> None:
    store.node("a", 4, slots=4, **UNIFIED_64K)
    for i in range(4):
        answer = store.ask(f"small-{i}", ["a"], enqueue=False, **tokens(6 * K, 2 * K))
        assert answer == Reservation("reserved", "a", i + 1, "", 1, 8 * K)
    assert store.ask("small-4", ["a"], enqueue=False, **tokens(6 * K, 2 * K)).status == "full"  # (slots)
    for i in range(4):
        store.release(f"small-{i}", "a")
    assert store.tokens("a") == {}
    assert store.ask("big", ["a"], enqueue=False, **tokens(50 * K, 10 * K)).tokens == 60 * K
    assert store.ask("big-2", ["a"], enqueue=False, **tokens(50 * K, 10 * K)).status == "full"
    assert store.ask("small", ["a"], enqueue=False, **tokens(6 * K, 2 * K)).status == "full"  # 68K of 64K
    assert store.ask("fits", ["a"], enqueue=False, **tokens(3 * K, 1 * K)).tokens == 4 * K  # 64K of 64K
    assert store.tokens("a") == {"big": 60 * K, "fits": 4 * K}


def test_the_tokens_a_request_holds_follow_its_limits_and_the_nodes(store: Store) -> None:
    store.node("known", 8, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K)
    store.node("limited", 8, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K, n_predict=512)
    store.node("unknown", 8)
    cases = [
        ("known", tokens(1000, 300), 1300),  # its own output limit
        ("known", tokens(1000), 16 * K),  # none: the rest of the context
        ("known", tokens(15 * K, 4 * K), 16 * K),  # never past what one sequence holds
        ("limited", tokens(1000), 1512),  # none: llama-server's default limit
        ("unknown", tokens(1000), 1000),  # the context unknown: what it says
        ("unknown", tokens(1000, 300), 1300),
        ("known", tokens(0, 300), 0),  # not counted: slots alone
    ]
    for i, (node, counts, held) in enumerate(cases):
        answer = store.ask(f"r{i}", [node], enqueue=False, **counts)
        assert (answer.status, answer.tokens) == ("reserved", held), (node, counts, answer)
        store.release(f"r{i}", node)


def test_a_node_that_could_never_hold_a_request_is_no_candidate(store: Store) -> None:
    store.node("short", 4, slots=4, seq_ctx=4 * K, kv_cells=16 * K)  # a context of 4K per slot
    store.node("small", 4, kv_unified=1, kv_cells=8 * K)  # one pool of 8K cells, the context not known
    store.node("long", 4, slots=4, seq_ctx=32 * K, kv_cells=128 * K)
    store.ask("busy", ["long"])  # the other two are the least utilised
    # a prompt past short's context, and 9K tokens, past small's cells
    assert placed(store.ask("r1", ["short", "small", "long"], **tokens(5 * K, 4 * K))) == ("reserved", "long")
    assert placed(store.ask("r2", ["short", "small", "long"], **tokens(4 * K, 5 * K))) == ("reserved", "long")
    # only such nodes: it is placed nowhere (it waits, as a request whose router sent it nowhere would)
    assert placed(store.ask("r3", ["short", "small"], **tokens(9 * K))) == ("queued", "")
    assert store.held("short") == store.held("small") == []


def test_non_unified_nodes_count_slots_only_and_record_the_tokens(store: Store) -> None:
    store.node("a", 2, slots=2, seq_ctx=8 * K, kv_cells=16 * K)  # each slot has its own 8K
    for rid in ("r1", "r2"):
        assert store.ask(rid, ["a"], enqueue=False, **tokens(7 * K)).tokens == 8 * K
    assert store.tokens("a") == {"r1": 8 * K, "r2": 8 * K}
    assert store.ask("r3", ["a"], enqueue=False, **tokens(1 * K, 1 * K)).status == "full"  # (slots)


def test_a_release_hands_its_slot_to_a_waiter_only_once_its_tokens_fit(store: Store) -> None:
    store.node("a", 4, slots=4, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K)
    for rid, size in (("r1", 6), ("r2", 6), ("r3", 3)):
        store.ask(rid, ["a"], **tokens(size * K - 100, 100))
    assert store.ask("w", ["a"], **tokens(7 * K, 1 * K)).status == "queued"  # 15K held: no room for 8K
    store.tick()
    assert store.ask("small", ["a"], **tokens(K - 100, 100)).status == "queued"  # (the cells wait for w)
    store.events()
    store.release("r3", "a")  # 12K held: still no room for w, and the small one waits behind it
    assert store.events() == ["freed a"]
    store.release("r1", "a")  # 6K held: w's 8K fit
    assert store.events() == ["granted w a 1", "granted small a 1"]
    assert store.tokens("a") == {"r2": 6 * K, "w": 8 * K, "small": K}
    taken = store.ask("w", ["a"], dequeue=True, **tokens(7 * K, 1 * K))
    assert taken == Reservation("reserved", "a", 3, "", 1, 8 * K)


def test_a_waiter_leaving_gives_the_tokens_handed_to_it_on(store: Store) -> None:
    store.node("a", 4, slots=4, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K)
    half = tokens(7 * K, K - 1)  # two of them fill the cells
    store.ask("r1", ["a"], **tokens(12 * K, 1))
    store.ask("w1", ["a"], **half)
    store.tick()
    store.ask("w2", ["a"], **half)
    store.events()
    store.release("r1", "a")
    assert store.events() == ["granted w1 a 1", "granted w2 a 1"]
    store.ask("w3", ["a"], **half)
    assert store.leave("w1")
    assert store.events() == ["granted w3 a 1"]
    assert store.tokens("a") == {"w2": 8 * K - 1, "w3": 8 * K - 1}


def test_an_offer_hands_a_new_node_to_the_waiters_whose_tokens_fit_there(store: Store) -> None:
    store.node("a", 1)
    store.ask("busy", ["a"])
    for rid, size in (("big", 20), ("m1", 10), ("m2", 10)):
        assert store.ask(rid, ["a", "b"], **tokens(size * K - 100, 100)).status == "queued"
        store.tick()
    store.node("b", 4, slots=4, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K)
    store.events()
    assert store.api.run(store.api.store.offer("b", QUEUE_LEASE, store.now)) == 1
    # big never fits on b (it waits for a), and b's cells hold one of the others, not both
    assert store.events() == ["granted m1 b 1"]
    assert store.tokens("b") == {"m1": 10 * K}


def test_tokens_lapse_with_their_lease(store: Store) -> None:
    store.node("a", 4, slots=4, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K)
    t = store.now
    store.ask("lost", ["a"], now=t, **tokens(12 * K, 1))  # its router dies: nobody releases it
    assert store.ask("next", ["a"], enqueue=False, now=t + LEASE - 1, **tokens(12 * K, 1)).status == "full"
    answer = store.ask("next", ["a"], enqueue=False, now=t + LEASE, **tokens(12 * K, 1))
    assert answer.status == "reserved"
    assert store.tokens("a") == {"next": 12 * K + 1}


def test_a_dead_routers_tokens_are_given_back_by_the_next_beat(store: Store) -> None:
    store.node("a", 4, slots=4, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K)
    store.r.zadd(KEYS.nodes, {"a": store.now})  # (in the index, which a beat declares)
    api = store.api
    api.run(api.store.beat("crashed", 2_000, now=store.now))
    assert store.ask("lost", ["a"], router="crashed", **tokens(12 * K, 1)).status == "reserved"
    assert store.ask("w", ["a"], **tokens(8 * K, 1)).status == "queued"
    store.events()
    assert api.run(api.store.beat("live", 2_000, now=store.now + 2_001)) == 1  # (within w's queue lease)
    assert store.events() == ["granted w a 1"]
    assert store.tokens("a") == {"w": 8 * K + 1}


def test_a_renewal_writes_lost_tokens_again_and_forget_takes_them_out(store: Store) -> None:
    store.node("a", 4, slots=4, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K)
    held = store.ask("r", ["a"], **tokens(12 * K, 1))
    lease = Lease("r", "a", slots=held.slots, tokens=held.tokens)
    store.r.delete(KEYS.reservations("a"), KEYS.tokens("a"))  # Redis restarted empty while it runs
    assert store.api.run(store.api.store.renew([lease], LEASE, store.now)) == [True]
    assert store.tokens("a") == {"r": 12 * K + 1}
    assert store.ask("next", ["a"], enqueue=False, **tokens(8 * K, 1)).status == "full"
    store.api.run(store.api.store.forget(lease))
    assert store.tokens("a") == {} and store.held("a") == []


def test_an_arrival_leaves_the_cells_a_waiter_ahead_fits_in(store: Store) -> None:
    store.node("a", 4, slots=4, seq_ctx=16 * K, kv_unified=1, kv_cells=16 * K)
    store.ask("r1", ["a"], **tokens(10 * K, 1))
    assert store.ask("w", ["a"], **tokens(8 * K)).status == "queued"  # 8K (the rest of its context)
    store.tick()
    # the node's cache grows (a heartbeat: no release announces it): 22K free, room for w, yet not for w and
    # an arrival of 16K besides - which waits behind w rather than take its cells
    store.node("a", 4, slots=4, seq_ctx=16 * K, kv_unified=1, kv_cells=32 * K)
    assert store.ask("late", ["a"], **tokens(15 * K, K)).status == "queued"
    assert store.ask("w", ["a"], dequeue=True, **tokens(8 * K)).status == "reserved"
