"""Coding-agent sessions as Claude Code and Codex send them, for ``macpool bench agents``.

- ``plan``: lanes of sessions drawn from a seed. A lane is one developer's agent: its sessions one after
  another, each a sequence of turns. A turn re-sends the whole history plus what the agent's tools returned
  (``tool_tokens``), asks for a short answer, and comes after the agent's tools ran (``think_s``).
- ``Shapes``: a session's requests, made from the turns recorded in ``tests/fixtures/clients/`` - Claude
  Code's ``/v1/messages`` (system blocks, 12 tools, the environment as a message of role system) and Codex's
  ``/v1/responses`` (developer instructions, 9 tools, ``prompt_cache_key``), each with its own headers and
  session id. The simulator's template renders no tools and counts one token per 4 characters, so the
  system prompt (Claude) or the instructions (Codex) carry a text as long as the tools are on llama-server's
  real tokenizer: a first turn counts the 21,695 and 26,225 tokens the recorded turns count there
  (docs/coding-clis.md), plus the session's own task.
- ``drive``: every lane against one router until a deadline, each request retried as its CLI retries it
  (docs/coding-clis.md, "How they retry a full pool"), each turn recorded.
- ``Floors``: each turn alone on an idle Mac whose slot holds the session's history - the least time to its
  first token any router can give it, from the simulator's own engine.

The simulated model ends an answer at the request's output limit (or, with none, after ``default_n_predict``
tokens), so a Claude Code turn asks for its answer's length as ``max_tokens``, and a Codex turn, which sends
no limit, gets ``CODEX_ANSWER_TOKENS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from macpool.bench.sse import Events
from macpool.sim import anthropic, chat, responses, tokens
from macpool.sim.engine import Engine, ServerOptions, Task
from macpool.sim.machine import Machine

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "clients"  # the checkout's
CLIENTS = ("claude", "codex")
PATHS = {"claude": "/v1/messages", "codex": "/v1/responses"}
# a recorded turn's prompt on llama-server's real tokenizer (docs/coding-clis.md), tools rendered
REAL_FIRST_TURN_TOKENS = {"claude": 21_695, "codex": 26_225}
CODEX_ANSWER_TOKENS = 256  # the simulated model's end of an answer that sets no limit (default_n_predict)
# a session ends before a turn would pass this: every prompt fits the M2 Ultra's 64K-token slots, so no
# request is too long for every Mac
MAX_PROMPT_TOKENS = 60_000
TURN_OVERHEAD_TOKENS = 40  # what a turn's template adds around its answer and its tool's output
RECORDED_CWD = {"claude": "/tmp/macpool-clients/claude/work", "codex": "/tmp/macpool-clients/codex/work"}
TOKEN_EVENTS = ("content_block_delta", "response.output_text.delta")  # answer text: Messages, Responses
HEADERS_LEFT_OUT = ("authorization", "content-length", "host", "connection", "accept-encoding")


# --- the plan ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What ``plan`` draws from. Ranges are inclusive; times are simulated seconds."""

    lanes: int = 8
    seed: int = 1
    claude_share: float = 0.5
    turns: tuple[int, int] = (5, 9)
    task_tokens: tuple[int, int] = (20, 400)  # the user's request in a session's first turn
    tool_tokens: tuple[int, int] = (1000, 4000)  # what the tools returned, sent with each later turn
    answer_tokens: tuple[int, int] = (128, 512)  # a Claude Code answer (a Codex one: CODEX_ANSWER_TOKENS)
    think_s: tuple[float, float] = (2.0, 12.0)  # the agent running its tools between turns
    stagger_s: float = 90.0  # lanes start evenly spread over this long


@dataclass(frozen=True)
class Turn:
    tool_tokens: int  # sent with this turn (0: the first)
    answer_tokens: int
    think_s: float  # before it is sent


@dataclass(frozen=True)
class Session:
    lane: int
    index: int  # in the whole plan
    client: str
    task_tokens: int
    turns: tuple[Turn, ...]


def draw_session(w: Workload, lane: int, k: int, index: int) -> Session:
    rng = random.Random(f"agents-{w.seed}-{lane}-{k}")
    client = "claude" if rng.random() < w.claude_share else "codex"
    task = rng.randint(*w.task_tokens)
    prompt = REAL_FIRST_TURN_TOKENS[client] + task
    turns: list[Turn] = []
    answer = 0
    for n in range(rng.randint(*w.turns)):
        tool = rng.randint(*w.tool_tokens) if n else 0
        if n:
            prompt += answer + tool + TURN_OVERHEAD_TOKENS
            if prompt > MAX_PROMPT_TOKENS:
                break
        answer = CODEX_ANSWER_TOKENS if client == "codex" else rng.randint(*w.answer_tokens)
        turns.append(Turn(tool, answer, rng.uniform(*w.think_s)))
    return Session(lane, index, client, task, tuple(turns))


def plan(w: Workload, sessions_per_lane: int) -> list[list[Session]]:
    """``sessions_per_lane`` sessions for each lane, the same for every router and run."""
    return [[draw_session(w, lane, k, k * w.lanes + lane) for k in range(sessions_per_lane)]
            for lane in range(w.lanes)]


# --- the requests --------------------------------------------------------------------------------------


def _recorded(client: str) -> dict[str, Any]:
    name = "claude-code-turn.json" if client == "claude" else "codex-turn.json"
    request: dict[str, Any] = json.loads((FIXTURES / name).read_text())["requests"][0]
    return request


def _text(rng: random.Random, corpus: str, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of text: slices of ``corpus`` (recorded prompts) at random places."""
    want, parts, size = n_tokens * tokens.CHARS_PER_TOKEN, [], 0
    while size < want:
        at = rng.randrange(0, len(corpus) - 400)
        part = corpus[at:at + rng.randint(200, 400)]
        parts.append(part)
        size += len(part)
    return "".join(parts)[:want]


def sim_prompt(path: str, body: dict[str, Any]) -> str:
    """The prompt the simulator (llama-server) renders for a Messages or Responses body."""
    converted = anthropic.to_chat(body) if path == "/v1/messages" else responses.to_chat(body)
    return chat.prompt(converted)


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    def content(self) -> bytes:
        return json.dumps(self.body).encode()


class Shapes:
    """The recorded turns made into any session's requests (``request``) for one model name."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.recorded = {client: _recorded(client) for client in CLIENTS}
        body = self.recorded["claude"]["body"]
        self.corpus = "".join(block["text"] for block in body["system"]) + json.dumps(body["tools"])
        # the tools as llama-server's template renders them, stood for by a text of the tokens they take
        # there: the recorded turn (its task "Say hello.") then counts what it counts on the real tokenizer
        self.tools_text: dict[str, str] = {}
        for client in CLIENTS:
            self.tools_text[client] = ""
            probe = Session(0, 0, client, 0, (Turn(0, 16, 0.0),))
            rendered = sim_prompt(PATHS[client], self.request(probe, 0, run=0, task="Say hello.").body)
            missing = REAL_FIRST_TURN_TOKENS[client] - tokens.count(rendered)
            self.tools_text[client] = _repeat(json.dumps(self.recorded[client]["body"]["tools"]), missing)

    def session_id(self, session: Session, run: int) -> str:
        return str(uuid.UUID(int=random.Random(f"session-{run}-{session.index}").getrandbits(128), version=4))

    def request(self, session: Session, turn: int, run: int, task: str | None = None) -> Request:
        """Turn ``turn`` of ``session`` in run ``run``: the history of the turns before it (each answered
        with the simulator's text of its length) and this turn's tool output."""
        rng = random.Random(f"text-{session.index}")  # the session's texts, the same in every run
        task_text = task if task is not None else _text(rng, self.corpus, session.task_tokens)
        history: list[tuple[str, str]] = []  # (answer, tool output) of each earlier turn
        for n in range(1, turn + 1):
            answer = tokens.filler(session.turns[n - 1].answer_tokens)
            history.append((answer, _text(rng, self.corpus, session.turns[n].tool_tokens)))
        sid = self.session_id(session, run)
        cwd = f"/home/dev/src/project-{session.index:04d}"
        if session.client == "claude":
            return self._claude(session, turn, run, sid, cwd, task_text, history)
        return self._codex(session, turn, run, sid, cwd, task_text, history)

    def _headers(self, client: str) -> dict[str, str]:
        recorded: dict[str, str] = self.recorded[client]["headers"]
        return {k: v for k, v in recorded.items() if k not in HEADERS_LEFT_OUT}

    def _claude(self, session: Session, turn: int, run: int, sid: str, cwd: str, task: str,
                history: list[tuple[str, str]]) -> Request:
        recorded = self.recorded["claude"]["body"]
        system = [dict(block) for block in recorded["system"]]
        # the billing line's 3 hex digits follow the session's first prompt: they differ between sessions,
        # and carry the run here, so no run reuses another's cached prompts
        stamp = f"{(run * 1021 + session.index) % 4096:03x}"
        system[0]["text"] = system[0]["text"].replace("2.1.332.1c9", f"2.1.332.{stamp}")
        system[2]["text"] += "\n\n" + self.tools_text["claude"]
        first, environment = (json.loads(json.dumps(m)) for m in recorded["messages"])
        first["content"][1]["text"] = task
        environment["content"][0]["text"] = environment["content"][0]["text"].replace(RECORDED_CWD["claude"],
                                                                                      cwd)
        messages: list[dict[str, Any]] = [first, environment]
        for n, (answer, output) in enumerate(history):
            call = f"toolu_{session.index:04d}{n:02d}"
            messages.append({"role": "assistant", "content": [
                {"type": "text", "text": answer},
                {"type": "tool_use", "id": call, "name": "Bash", "input": {"command": f"make test-{n}"}},
            ]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call, "content": output},
            ]})
        if history:  # Claude Code marks the newest block for caching
            for message in messages[:-1]:
                for block in message["content"] if isinstance(message["content"], list) else ():
                    block.pop("cache_control", None)
            messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        body = {**recorded, "model": self.model, "system": system, "messages": messages,
                "max_tokens": session.turns[turn].answer_tokens,
                "metadata": {"user_id": json.dumps({"device_id": "0" * 64, "account_uuid": "",
                                                    "session_id": sid})}}
        headers = self._headers("claude") | {"x-claude-code-session-id": sid}
        return Request(PATHS["claude"], headers, body)

    def _codex(self, session: Session, turn: int, run: int, sid: str, cwd: str, task: str,
               history: list[tuple[str, str]]) -> Request:
        recorded = self.recorded["codex"]["body"]
        items = json.loads(json.dumps(recorded["input"]))
        rng = random.Random(f"ids-{run}-{session.index}")
        for item in items:
            item["id"] = f"msg_{uuid.UUID(int=rng.getrandbits(128), version=4)}"
        # the instructions open with the run (every Codex session shares them, and their cached prompt, within
        # a run, not across runs), and hold the tools as the template renders them
        instructions = items[0]["content"][0]
        instructions["text"] = f"[run {run}] {instructions['text']}\n\n{self.tools_text['codex']}"
        items[2]["content"][0]["text"] = items[2]["content"][0]["text"].replace(RECORDED_CWD["codex"], cwd)
        items[3]["content"][0]["text"] = task
        for n, (answer, output) in enumerate(history):
            call = f"call_{session.index:04d}{n:02d}"
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": answer}]})
            items.append({"type": "function_call", "name": "exec_command", "call_id": call,
                          "arguments": json.dumps({"cmd": f"make test-{n}"})})
            items.append({"type": "function_call_output", "call_id": call, "output": output})
        metadata = dict(recorded["client_metadata"])
        for key in ("session_id", "thread_id"):
            metadata[key] = sid
        metadata["x-codex-window-id"] = f"{sid}:0"
        body = {**recorded, "model": self.model, "input": items, "prompt_cache_key": sid,
                "client_metadata": metadata}
        headers = self._headers("codex") | {
            "session-id": sid, "thread-id": sid, "x-client-request-id": sid, "x-codex-window-id": f"{sid}:0",
        }
        headers.pop("x-codex-turn-metadata", None)
        return Request(PATHS["codex"], headers, body)


def _repeat(text: str, n_tokens: int) -> str:
    want = max(0, n_tokens) * tokens.CHARS_PER_TOKEN
    return (text * (want // max(1, len(text)) + 1))[:want]


# --- the client ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retries:
    """How a CLI retries a turn's request (docs/coding-clis.md), its waits in simulated seconds."""

    refused: int  # 429, 503, 529 (honouring Retry-After)
    bad_request: int  # 400, 422, sent again at once
    failed: int  # a 5xx, a lost connection, an error event in the stream
    backoff_s: float  # the first wait, doubling
    backoff_cap_s: float


RETRIES = {
    # its SDK's backoff from 0.5 s; a 400 sent again at once, five times (each without one more optional
    # part); an error event asked again at once
    "claude": Retries(refused=10, bad_request=5, failed=10, backoff_s=0.5, backoff_cap_s=32.0),
    # 0.2 s doubling, then "Reconnecting n/5"; a 400 fails the turn
    "codex": Retries(refused=5, bad_request=0, failed=5, backoff_s=0.2, backoff_cap_s=3.0),
}


@dataclass
class Attempt:
    """One request of a turn: ``kind`` is ok, context (a 400 for a prompt over a context), refused (429, 503,
    529), out_of_cells (llama-server's "Context size has been exceeded."), error (any other failure)."""

    kind: str
    status: int = 0
    first_token_at: float | None = None  # wall, time.monotonic()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retry_after_s: float = 0.0
    detail: str = ""
    node: str = ""  # the Mac that answered, where the router names it (macpool's X-Macpool-Node)


@dataclass
class TurnRecord:
    lane: int
    session: int
    turn: int
    client: str
    started: float  # wall seconds from the run's start
    ttft_s: float | None = None  # wall, from the first request to the first token of the answer
    ended: float | None = None  # wall seconds from the run's start, when it completed
    ok: bool = False
    cut: bool = False  # still running at the deadline
    waiting: bool = False  # ... and still without its first token (its TTFT: the wait so far, a lower bound)
    attempts: list[str] = field(default_factory=list)  # the kinds, in order
    prompt_tokens: int = 0
    cached_tokens: int = 0
    node: str = ""  # the Mac that answered it, where the router names it
    details: list[str] = field(default_factory=list)
    attempt: Attempt | None = None  # the request on its way (a turn cut at the deadline may have its token)


def _context_error(status: int, text: str) -> bool:
    lowered = text.lower()
    return status == 400 and any(word in lowered for word in ("context", "too long", "exceed"))


def _usage(doc: dict[str, Any], attempt: Attempt) -> None:
    """An event's usage, if any, into ``attempt`` (the fullest one wins: LiteLLM's Messages stream says the
    prompt's tokens in its last event, llama-server in its first)."""
    kind = doc.get("type")
    usage: Any = None
    if kind == "message_start":
        usage = (doc.get("message") or {}).get("usage")
    elif kind == "message_delta":
        usage = doc.get("usage")
    elif kind == "response.completed":
        usage = (doc.get("response") or {}).get("usage")
    if not isinstance(usage, dict):
        return
    if "input_tokens_details" in usage or kind == "response.completed":
        details = usage.get("input_tokens_details") or {}
        prompt, cached = int(usage.get("input_tokens") or 0), int(details.get("cached_tokens") or 0)
    else:
        cached = int(usage.get("cache_read_input_tokens") or 0)
        created = int(usage.get("cache_creation_input_tokens") or 0)
        prompt = int(usage.get("input_tokens") or 0) + cached + created
    if prompt >= attempt.prompt_tokens:
        attempt.prompt_tokens, attempt.cached_tokens = prompt, cached


def _failure(doc: dict[str, Any]) -> str | None:
    """The error an event reports, if it is one (Anthropic's ``error``, the Responses API's
    ``response.failed``, an OpenAI-shaped ``{"error": ...}``)."""
    kind = doc.get("type")
    if kind == "error" or ("error" in doc and kind is None):
        return json.dumps(doc.get("error"))[:200]
    if kind in ("response.failed", "response.error"):
        return json.dumps(doc.get("response", doc))[:200]
    return None


async def send(http: httpx.AsyncClient, request: Request, attempt: Attempt) -> Attempt:
    """One streamed request, read to its end, into ``attempt``."""
    try:
        async with http.stream("POST", request.path, content=request.content(),
                               headers=request.headers | {"content-type": "application/json"}) as response:
            status = response.status_code
            if status != 200:
                text = (await response.aread()).decode(errors="replace")
                if status in (429, 503, 529):
                    try:
                        wait = float(response.headers.get("retry-after", "0"))
                    except ValueError:
                        wait = 0.0
                    return Attempt("refused", status, retry_after_s=wait, detail=f"{status}")
                if _context_error(status, text):
                    return Attempt("context", status, detail=text[:200])
                kind = "out_of_cells" if "Context size has been exceeded" in text else "error"
                return Attempt(kind, status, detail=f"{status} {text[:200]}")
            attempt.status, attempt.detail = status, "the stream ended before its last event"
            attempt.node = response.headers.get("x-macpool-node", "")
            async for doc in Events(response):
                kind = str(doc.get("type"))
                failure = _failure(doc)
                if failure is not None:
                    attempt.kind = "out_of_cells" if "Context size has been exceeded" in failure else "error"
                    attempt.detail = f"error event {failure}"
                    break
                if attempt.first_token_at is None and kind in TOKEN_EVENTS:
                    attempt.first_token_at = time.monotonic()
                _usage(doc, attempt)
                if kind in ("message_stop", "response.completed"):
                    attempt.kind, attempt.detail = "ok", ""
            return attempt
    except (httpx.HTTPError, ValueError) as exc:
        return Attempt("error", 0, detail=f"{type(exc).__name__}: {str(exc)[:120]}")


async def turn_of(http: httpx.AsyncClient, request: Request, record: TurnRecord, client: str, speed: float,
                  t0: float) -> None:
    """Send a turn until it is answered or its CLI gives up, into ``record``."""
    policy = RETRIES[client]
    started = time.monotonic()
    used = {"refused": 0, "bad_request": 0, "failed": 0}
    waits = 0
    while True:
        record.attempt = Attempt("error")
        attempt = await send(http, request, record.attempt)
        record.attempts.append(attempt.kind)
        if attempt.detail:
            record.details.append(attempt.detail)
        if attempt.kind == "ok":
            record.ok = True
            record.ended = time.monotonic() - t0
            if attempt.first_token_at is not None:
                record.ttft_s = attempt.first_token_at - started
            record.prompt_tokens, record.cached_tokens = attempt.prompt_tokens, attempt.cached_tokens
            record.node = attempt.node
            return
        budget = "refused" if attempt.kind == "refused" else (
            "bad_request" if attempt.status in (400, 422) else "failed")
        used[budget] += 1
        if used[budget] > getattr(policy, budget):
            return
        if budget == "bad_request" or (client == "claude" and attempt.first_token_at is not None):
            continue  # sent again at once
        backoff = min(policy.backoff_s * 2 ** waits, policy.backoff_cap_s) / speed
        waits += 1
        await asyncio.sleep(max(backoff, attempt.retry_after_s))


@dataclass
class Outcome:
    """What one run of the plan against one router gave."""

    records: list[TurnRecord]
    wall_s: float
    sessions_started: int


async def drive(url: str, lanes: list[list[Session]], shapes: Shapes, w: Workload, run: int, speed: float,
                duration_s: float) -> Outcome:
    """Every lane against ``url`` for ``duration_s`` simulated seconds (at ``speed``); what is still running
    then is cut (the client leaves) and recorded as such."""
    t0 = time.monotonic()
    deadline = duration_s / speed
    records: list[TurnRecord] = []
    current: dict[int, TurnRecord] = {}
    started = [0]

    async def lane(index: int, sessions: list[Session]) -> None:
        await asyncio.sleep(w.stagger_s * index / max(1, len(lanes)) / speed)
        for session in sessions:
            started[0] += 1
            for n, turn in enumerate(session.turns):
                if n:
                    await asyncio.sleep(turn.think_s / speed)
                if time.monotonic() - t0 >= deadline:
                    return
                request = shapes.request(session, n, run)
                record = TurnRecord(index, session.index, n, session.client, time.monotonic() - t0)
                current[index] = record
                records.append(record)
                await turn_of(http, request, record, session.client, speed, t0)
                del current[index]
                if not record.ok:
                    break  # the agent stops: its user compacts the conversation or starts over
            await asyncio.sleep(session.turns[0].think_s / speed)

    limits = httpx.Limits(max_connections=len(lanes) + 8, max_keepalive_connections=len(lanes) + 8)
    timeout = httpx.Timeout(None, connect=10.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        tasks = [asyncio.create_task(lane(i, sessions)) for i, sessions in enumerate(lanes)]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deadline):
                await asyncio.gather(*tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    now = time.monotonic() - t0
    for record in current.values():
        record.cut = True
        first = record.attempt.first_token_at if record.attempt else None
        record.waiting = first is None
        record.ttft_s = now - record.started if first is None else first - t0 - record.started
    return Outcome(records, now, started[0])


# --- bounds ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Floor:
    """A turn alone on an idle Mac whose slot holds the session's history (and, for a first turn, the
    prompt every session of its client shares): simulated seconds to its first token and to its end."""

    ttft_s: float
    turn_s: float
    # the least of the Mac's stepping time the turn takes in any batch: its steps without the pass over the
    # weights each step makes (``decode_t0_ms``), which every request in a batch shares
    work_s: float


def alone(machine: Machine, cached: str, prompt: str, answer_tokens: int, context: int = 1 << 20) -> Floor:
    """One request on ``machine`` with one slot of ``context`` tokens holding ``cached``, nothing else
    running."""
    engine = Engine(machine, 1, context, ServerOptions(cache_ram_mib=0))
    engine.slots[0].cached = cached
    task = Task(prompt=prompt, n_prompt=tokens.count(prompt), n_predict=answer_tokens)
    engine.submit(task)
    first = None
    while not task.finished:
        engine.step()
        if first is None and task.n_decoded:
            first = engine.sim_time
    weights_s = machine.decode_t0_ms / 1000 * engine.counters.n_decode_total
    return Floor(ttft_s=(first or engine.sim_time) - task.arrival, turn_s=engine.sim_time - task.arrival,
                 work_s=engine.sim_time - task.arrival - weights_s)


def prompts(shapes: Shapes, session: Session) -> Iterator[tuple[str, str]]:
    """Each turn's rendered prompt, and what a slot that served the session's previous turn holds."""
    held = ""
    for n, turn in enumerate(session.turns):
        prompt = sim_prompt(PATHS[session.client], shapes.request(session, n, run=0).body)
        yield held, prompt
        held = prompt + tokens.filler(turn.answer_tokens)


class Floors:
    """Each turn's floor on ``machine``, worked out for a session when first asked for. A first turn starts
    from the prompt the other sessions of its client share (Codex's instructions and tools; Claude Code's
    differ from the first line)."""

    def __init__(self, shapes: Shapes, machine: Machine, context: int = 1 << 20) -> None:
        self.shapes, self.machine, self.context = shapes, machine, context
        self.shared: dict[str, str] = {}
        for client in CLIENTS:
            two = (Session(0, i, client, 50, (Turn(0, 16, 0.0),)) for i in (1, 2))
            a, b = (sim_prompt(PATHS[client], shapes.request(session, 0, run=0).body) for session in two)
            self.shared[client] = a[: tokens.common_prefix_tokens(a, b) * tokens.CHARS_PER_TOKEN]
        self.done: dict[int, list[Floor]] = {}

    def of(self, session: Session) -> list[Floor]:
        """The floor of each of ``session``'s turns, up to the first that does not fit the context."""
        if session.index not in self.done:
            floors = self.done[session.index] = []
            for (held, prompt), turn in zip(prompts(self.shapes, session), session.turns, strict=True):
                if tokens.count(prompt) + turn.answer_tokens > self.context:
                    break
                floors.append(alone(self.machine, held or self.shared[session.client], prompt,
                                    turn.answer_tokens, self.context))
        return self.done[session.index]

    def moved(self, session: Session, n: int) -> Floor:
        """Turn ``n`` of ``session`` on a Mac that never served it: a slot holding only the prompt its
        client's sessions share."""
        _, prompt = list(prompts(self.shapes, session))[n]
        return alone(self.machine, self.shared[session.client], prompt, session.turns[n].answer_tokens,
                     self.context)
