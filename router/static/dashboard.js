// macpool pool dashboard: one SSE stream from the router, no polling, no dependencies.
"use strict";

const GONE_KEEP_MS = 120000;   // a node that left the pool stays on the page, greyed, this long
const SPARK_WINDOW_MS = 300000;
const KEY_STORE = "macpool-admin-key";
// the pool's figures may need the read key (or the admin key): an EventSource sends no header, so the key
// typed in goes in a same-site session cookie as well as in this tab's storage (docs/security.md)
const KEY_COOKIE = "macpool_key";

const cards = new Map();       // node_id -> {el, doc, goneSince}
let history = [];
let lastView = null;

const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 1) => (v === null || v === undefined || Number.isNaN(v)) ? "-" : Number(v).toFixed(digits);

function nodeState(doc) {
  const mem = doc.memory || {};
  if (doc.drained || doc.state === "draining") return "draining";
  if (doc.state === "unhealthy" || doc.circuit === "open") return "unhealthy";
  if (doc.state === "paging" || mem.state === "paging" || mem.state === "collapsed") return "paging";
  if (doc.state === "starting") return "starting";
  if (ELASTIC_STATES.has(doc.state)) return doc.state;
  if (mem.state === "near_ceiling" || mem.pressure === "warning" || mem.pressure === "critical") return "near_ceiling";
  return "healthy";
}

// the elastic pool's states (macpool autoscale): a standby Mac holds no model
const ELASTIC_STATES = new Set(["standby", "asleep", "waking", "loading", "draining-to-standby", "downloading"]);

const STATE_TEXT = {
  healthy: "healthy", near_ceiling: "near ceiling", paging: "paging", draining: "draining",
  unhealthy: "unhealthy", starting: "starting", gone: "gone",
  standby: "standby", asleep: "asleep", waking: "waking", loading: "loading", "draining-to-standby": "draining to standby",
  downloading: "downloading",
};

function makeCard(id) {
  const el = $("node-card").content.firstElementChild.cloneNode(true);
  el.id = "node-" + id;
  el.dataset.nodeId = id;
  el.querySelector(".node-id").textContent = id;
  el.querySelector(".drain").addEventListener("click", () => admin(id, "drain"));
  el.querySelector(".undrain").addEventListener("click", () => admin(id, "undrain"));
  const slash = id.indexOf("/");
  insertSorted(slash > 0 ? macGroup(id.slice(0, slash)).querySelector(".mac-nodes") : $("nodes"), el);
  return el;
}

// in node id order
function insertSorted(parent, el) {
  const next = [...parent.children].find((c) => c.dataset.nodeId && c.dataset.nodeId > el.dataset.nodeId);
  parent.insertBefore(el, next || null);
}

// a Mac serving several models (macpool agent run --models) is a node per model, "<mac>/<model>": its
// cards sit in one group, headed by the Mac and the memory its loaded models hold together
function macGroup(mac) {
  const found = [...$("nodes").children].find((c) => c.dataset.macId === mac);
  if (found) return found;
  const group = document.createElement("section");
  group.className = "mac-group";
  group.id = "mac-" + mac;
  group.dataset.macId = mac;
  group.dataset.nodeId = mac + "/";
  const head = document.createElement("h2");
  head.className = "mac-head";
  const nodes = document.createElement("div");
  nodes.className = "mac-nodes";
  group.append(head, nodes);
  insertSorted($("nodes"), group);
  return group;
}

function renderGroups() {
  for (const group of [...$("nodes").querySelectorAll(".mac-group")]) {
    if (!group.querySelector(".node")) { group.remove(); continue; }
    const docs = [...group.querySelectorAll(".node")].map((el) => cards.get(el.dataset.nodeId))
      .filter((card) => card && !card.goneSince).map((card) => card.doc);
    const loaded = docs.filter((doc) => ((doc.model_states || [])[0] || {}).state === "loaded");
    const held = loaded.reduce((gb, doc) => gb + (doc.model_states[0].memory_gb || 0), 0);
    const limit = docs.map((doc) => (doc.memory || {}).wired_limit_gb).find((gb) => gb);
    group.querySelector(".mac-head").textContent = `${group.dataset.macId}: ${docs.length} models, ` +
      `${loaded.length} loaded, ${fmt(held)}` + (limit ? ` of ${fmt(limit)} GB wired limit` : " GB");
  }
}

function setState(el, state) {
  for (const c of [...el.classList]) if (c.startsWith("st-")) el.classList.remove(c);
  el.classList.add("st-" + state);
  el.dataset.state = state;
  el.querySelector(".node-state").textContent = STATE_TEXT[state] || state;
}

// each model the node serves or could load: its phase, the memory it holds, how long its last load took
function modelsText(doc) {
  const states = doc.model_states || [];
  if (!states.length) return (doc.models || []).join(", ") || "no model";
  return states.map((m) => {
    const parts = [m.state];
    if (m.memory_gb !== null && m.memory_gb !== undefined) parts.push(fmt(m.memory_gb) + " GB");
    if (m.load_s !== null && m.load_s !== undefined) parts.push("loads in " + fmt(m.load_s) + " s");
    return `${m.name} (${parts.join(", ")})`;
  }).join(", ");
}

// 65536 -> "64K": contexts and cells are counted in thousands of tokens
function kilo(n) {
  return n >= 1024 ? fmt(n / 1024, n % 1024 ? 1 : 0) + "K" : String(n);
}

function renderNode(card, poolCapacity) {
  const { el, doc } = card;
  const q = (sel) => el.querySelector(sel);
  const mem = doc.memory || {};
  const cap = doc.capacity || 0;
  // the router's reservations lead the agent's heartbeat by up to an interval: show the larger
  const busy = Math.max(doc.in_flight || 0, doc.reserved || 0);
  setState(el, card.goneSince ? "gone" : nodeState(doc));
  q(".models").textContent = modelsText(doc);
  q(".models").title = doc.url || "";
  q(".circuit").textContent = doc.circuit && doc.circuit !== "closed" ? "circuit " + doc.circuit.replace("_", "-") : "";
  const slotScale = Math.max(cap, doc.total_slots || 0, busy, 1);
  q(".bar.slots .fill").style.width = (100 * busy / slotScale) + "%";
  q(".slots-text").textContent = `${busy} / ${cap}` + (doc.total_slots && doc.total_slots !== cap ? ` (of ${doc.total_slots})` : "");

  // scale to a little past the wired limit (the part that matters), not to all of unified memory
  const span = mem.wired_limit_gb ? mem.wired_limit_gb * 1.25 : (mem.total_gb || 0);
  const total = Math.max(Math.min(span, mem.total_gb || span), mem.pinned_gb || 0, 0.001);
  const weights = mem.weights_gb || 0;
  const working = mem.pinned_gb > weights ? mem.pinned_gb - weights : busy * (mem.per_request_gb || 0);
  const free = Math.max(total - weights - working, 0);
  q(".seg-weights").style.width = (100 * weights / total) + "%";
  q(".seg-work").style.width = (100 * working / total) + "%";
  q(".seg-free").style.width = (100 * free / total) + "%";
  const limit = q(".limit");
  limit.style.display = mem.wired_limit_gb ? "" : "none";
  limit.style.left = `calc(${100 * (mem.wired_limit_gb || 0) / total}% - 1px)`;
  q(".bar.memory").title = `weights ${fmt(weights)} GB, in-flight ${fmt(working)} GB, ` +
    `wired limit ${fmt(mem.wired_limit_gb)} GB of ${fmt(mem.total_gb)} GB, swap ${fmt(mem.swap_used_gb)} GB, pressure ${mem.pressure || "-"}`;
  // no memory sample (the probe failing, or the simulator's llama-server down): say so rather than "0.0 / 0.0"
  q(".mem-text").textContent = mem.wired_limit_gb ? `${fmt(weights + working)} / ${fmt(mem.wired_limit_gb)} GB` : "- GB";

  // the KV cache: the cells llama-server holds (the bar), the tokens the routers reserved there (the mark),
  // and the most one request may hold; none known (an agent that does not say): "-"
  const cells = doc.kv_cells || 0;
  const used = doc.kv_cells_used || 0;
  const reservedTokens = doc.reserved_tokens || 0;
  q(".bar.cells .fill").style.width = cells ? (100 * Math.min(used / cells, 1)) + "%" : "0%";
  q(".bar.cells .held").style.width = cells ? (100 * Math.min(reservedTokens / cells, 1)) + "%" : "0%";
  q(".cells-text").textContent = cells ? `${kilo(used)} / ${kilo(cells)}` + (doc.kv_unified ? " shared" : "") : "-";
  q(".bar.cells").title = cells ? `${used} of ${cells} cells held, ${reservedTokens} tokens reserved by the ` +
    `routers; one request holds at most ${doc.seq_ctx || doc.ctx_per_slot || "?"} tokens` +
    (doc.kv_unified ? " (one pool of cells for every slot)" : " (a context per slot)") : "";
  q(".tps").textContent = fmt(doc.tokens_per_s, 0);
  q(".ttft").textContent = doc.ttft_p50_ms === null || doc.ttft_p50_ms === undefined ? "-" : fmt(doc.ttft_p50_ms, 0) + " ms";
  // the pool's capacity counts ready, undrained nodes only: so must each node's share of it
  const counted = !card.goneSince && doc.state === "ready" && !doc.drained && cap > 0;
  const share = counted && poolCapacity > 0 ? cap / poolCapacity : 0;
  q(".share").textContent = fmt(100 * share, 0) + "%";
  q(".share").title = "this node's share of the pool's capacity, so of the queue it drains";
  q(".reserved").textContent = doc.reserved ?? "-";
  q(".node > .reason, .reason").textContent = card.goneSince
    ? `left the pool ${Math.round((Date.now() - card.goneSince) / 1000)}s ago (heartbeat expired or agent stopped)`
    : doc.drained ? "drained through the admin API: no new requests until undrained" + (doc.reason ? "; " + doc.reason : "")
    : (doc.reason || "");
  // supervise mode: llama-server's slots and why (what fits the memory budget, the calibrated cap, pressure)
  q(".sizing").textContent = doc.sizing ? "llama-server: " + doc.sizing : "";
  q(".slots-text").title = doc.sizing || "";
  q(".drain").disabled = !!card.goneSince || !!doc.drained;
  q(".undrain").disabled = !!card.goneSince || !doc.drained;
}

function onPool(msg) {
  const view = msg.view || {};
  const pool = view.pool || {};
  const now = Date.now();
  lastView = view;
  $("redis").textContent = view.redis_ok ? "redis ok" : "redis down";
  $("redis").className = "conn " + (view.redis_ok ? "conn-ok" : "conn-bad");
  $("router-id").textContent = view.router_id ? "router " + view.router_id : "";
  $("p-capacity").textContent = pool.capacity ?? "-";
  $("p-busy").textContent = pool.busy ?? "-";
  $("p-queued").textContent = pool.queued ?? "-";
  $("p-rps").textContent = fmt(pool.requests_per_s);
  $("p-rejections").textContent = fmt(pool.rejections_per_s);
  $("p-saturation").textContent = fmt(100 * (pool.saturation || 0), 0) + "%";
  $("p-nodes").textContent = `${pool.nodes_ready ?? "-"} / ${pool.nodes_total ?? "-"}`;
  const affinity = view.affinity || {};
  $("p-affinity").textContent = !affinity.enabled ? "off" : affinity.hit_rate === null || affinity.hit_rate === undefined
    ? "-" : fmt(100 * affinity.hit_rate, 0) + "%";
  renderQueues(view);
  const scale = msg.scale || {};
  $("p-desired").textContent = scale.desired_nodes ?? "-";
  const acted = (view.autoscale || []).filter((d) => ["activate", "wake", "standby"].includes(d.action));
  const last = acted[acted.length - 1];
  $("p-reason").textContent = (scale.reason ? "scale hint: " + scale.reason : "")
    + (last ? ` | autoscale: ${last.action} ${last.node} (${last.reason})` : "");
  const refused = (view.untrusted || []).filter((n) => n.trust === "untrusted");
  $("p-untrusted").textContent = refused.length
    ? "untrusted, no traffic: " + refused.map((n) => `${n.node_id} at ${n.url || "-"} (${n.reason})`).join("; ") : "";

  const seen = new Set();
  for (const doc of view.nodes || []) {
    seen.add(doc.node_id);
    let card = cards.get(doc.node_id);
    if (!card) { card = { el: makeCard(doc.node_id) }; cards.set(doc.node_id, card); }
    card.doc = doc;
    card.goneSince = null;
  }
  for (const [id, card] of cards) {
    if (seen.has(id)) continue;
    card.goneSince = card.goneSince || now;
    if (now - card.goneSince > GONE_KEEP_MS) { card.el.remove(); cards.delete(id); }
  }
  for (const card of cards.values()) renderNode(card, pool.capacity || 0);
  renderGroups();
  $("empty").style.display = cards.size ? "none" : "";

  if (msg.point && (!history.length || msg.point.ts_ms > history[history.length - 1].ts_ms)) history.push(msg.point);
  drawSparks();
}

function cells(row, values) {
  row.replaceChildren(...values.map((v) => { const td = document.createElement("td"); td.textContent = v; return td; }));
  return row;
}

function renderQueues(view) {
  const waits = view.queue_wait_p50_ms || {};
  const ms = (v) => v === undefined ? "-" : fmt(v, 0) + " ms";
  const tenants = view.tenants || [];
  const classes = ["interactive", "batch"].map((c) => cells(document.createElement("tr"), [
    c, tenants.reduce((n, t) => n + ((t.queued || {})[c] || 0), 0), ms((waits.priority || {})[c]),
  ]));
  $("classes").tBodies[0].replaceChildren(...classes);
  const rows = tenants.map((t) => {
    const row = cells(document.createElement("tr"), [
      t.tenant, t.in_flight ?? "-", (t.queued || {}).interactive || 0, (t.queued || {}).batch || 0,
      ms((waits.tenant || {})[t.tenant]),
    ]);
    row.dataset.tenant = t.tenant;
    return row;
  });
  $("tenants").tBodies[0].replaceChildren(...rows);
}

function spark(svg, points, key, floorMax) {
  const end = points.length ? points[points.length - 1].ts_ms : Date.now();
  // up to the last five minutes; a young history fills the width instead of hugging the right edge
  const start = Math.max(end - SPARK_WINDOW_MS, points.length ? points[0].ts_ms : end);
  const span = Math.max(end - start, 1000);
  const shown = points.filter((p) => p.ts_ms >= start);
  const max = Math.max(floorMax, ...shown.map((p) => p[key] || 0));
  const coords = shown.map((p) => `${(300 * (p.ts_ms - start) / span).toFixed(1)},${(40 - 38 * (p[key] || 0) / max).toFixed(1)}`);
  const ref = floorMax === 1 ? `<line x1="0" x2="300" y1="${40 - 38 / max}" y2="${40 - 38 / max}"></line>` : "";
  svg.innerHTML = ref + `<polyline points="${coords.join(" ")}"></polyline>`;
  return max;
}

function drawSparks() {
  const cutoff = Date.now() - 2 * SPARK_WINDOW_MS;
  if (history.length && history[0].ts_ms < cutoff) history = history.filter((p) => p.ts_ms >= cutoff);
  spark($("spark-saturation"), history, "saturation", 1);
  const max = spark($("spark-rejections"), history, "rejections_per_s", 1);
  $("spark-rej-max").textContent = `(max ${fmt(max)})`;
}

async function admin(id, action) {
  const key = sessionStorage.getItem(KEY_STORE) || $("admin-key").value;
  const msg = $("admin-msg");
  if (!key) { msg.textContent = "type the admin key first"; return; }
  try {
    const r = await fetch(`admin/nodes/${encodeURIComponent(id)}/${action}`, {
      method: "POST", headers: { Authorization: "Bearer " + key },
    });
    let detail = "";
    try { const body = await r.json(); detail = body.error ? body.error.message : ""; } catch (_) { /* empty body */ }
    msg.textContent = r.ok ? `${action} ${id}: done` : `${action} ${id}: HTTP ${r.status} ${detail}`;
  } catch (err) {
    msg.textContent = `${action} ${id}: ${err}`;
  }
}

function connect() {
  const source = new EventSource("api/pool/stream");
  source.addEventListener("open", () => { $("conn").textContent = "live"; $("conn").className = "conn conn-ok"; });
  source.addEventListener("error", async () => {
    $("conn").textContent = "reconnecting"; $("conn").className = "conn conn-bad";
    try {
      const r = await fetch("api/pool/scale");
      if (r.status === 401) {
        source.close();  // no retry without a key: one is asked for
        $("conn").textContent = "this router needs its read key (or the admin key): type it in the key box";
        $("admin-key").focus();
      }
    } catch (_) { /* the router is away: EventSource retries */ }
  });
  source.addEventListener("history", (e) => {
    const incoming = JSON.parse(e.data).points || [];
    const last = history.length ? history[history.length - 1].ts_ms : 0;
    history = incoming.length && incoming[0].ts_ms <= last ? incoming : history.concat(incoming.filter((p) => p.ts_ms > last));
    drawSparks();
  });
  source.addEventListener("pool", (e) => onPool(JSON.parse(e.data)));
  source.addEventListener("problem", (e) => { $("conn").textContent = JSON.parse(e.data).message; $("conn").className = "conn conn-bad"; });
  return source;
}

let source = null;

function keepKey(key) {
  const secure = location.protocol === "https:" ? "; Secure" : "";
  document.cookie = `${KEY_COOKIE}=${encodeURIComponent(key)}; path=/; SameSite=Strict${secure}` + (key ? "" : "; max-age=0");
}

$("admin-key").value = sessionStorage.getItem(KEY_STORE) || "";
keepKey($("admin-key").value);
$("admin-save").addEventListener("click", () => {
  sessionStorage.setItem(KEY_STORE, $("admin-key").value);
  keepKey($("admin-key").value);
  $("admin-msg").textContent = $("admin-key").value ? "key kept for this tab" : "key cleared";
  if (source) source.close();
  source = connect();  // again, with the key
});
source = connect();
