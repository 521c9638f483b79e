// memvisor dashboard: follows GET /v1/events (EventSource) and draws with plain canvas.
// No build step, no library: this file, dashboard.html and dashboard.css are all of it.
"use strict";

const MAX_WINDOW = 900;            // seconds of history kept for the chart (the widest window)
const ACTIONS = new Set(["evict", "abort", "abort_load", "mark_for_unload", "reclaim", "ttl", "crash",
  "wedged", "refused", "unload", "failed"]);
const PALETTE = ["#a371f7", "#3fb9a4", "#db61a2", "#e3b341", "#79c0ff", "#56d364", "#ff9bce", "#ffa657"];
const GiB = 1024 ** 3, MiB = 1024 ** 2;

const S = {
  offset: 0,                     // wall - monotonic: places a sample's t (worker monotonic clock)
  es: null,                      // the EventSource of /v1/events
  session: null, ceiling: null, pressure: null, status: null, statusAt: 0,
  lines: { group: [], ceiling: [], soft: [], hard: [] },   // [wall seconds, bytes]
  models: new Map(),             // model id -> [[t, usage]]
  colors: new Map(),
  latest: new Map(),             // worker id -> latest Sample
  gone: new Set(),               // workers whose exit came after the last status
  progress: new Map(),           // model id -> its load in progress (W6: the last load_progress event's)
  own: 0,                        // group usage the samples do not cover (the supervisor itself)
  events: [], seen: new Set(), marks: [],
  windowSec: 300, dirty: true, tablesDirty: true, formSynced: "",
  token: sessionStorage.getItem("memvisor-token") || "",
};

const $ = (id) => document.getElementById(id);

function fmt(bytes) {
  if (bytes === undefined || bytes === null) return "–";
  if (Math.abs(bytes) >= GiB) return (bytes / GiB).toFixed(2) + " GiB";
  if (Math.abs(bytes) >= 10 * MiB) return (bytes / MiB).toFixed(0) + " MiB";
  return (bytes / MiB).toFixed(1) + " MiB";
}

function dur(seconds) {
  if (!isFinite(seconds)) return "–";
  if (seconds < 60) return seconds.toFixed(0) + " s";
  if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function clock(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8) + "." + String(d.getMilliseconds()).padStart(3, "0");
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function push(series, t, v) {
  series.push([t, v]);
  const cut = Date.now() / 1000 - MAX_WINDOW - 5;
  while (series.length && series[0][0] < cut) series.shift();
}

function colorOf(model) {
  if (!S.colors.has(model)) S.colors.set(model, PALETTE[S.colors.size % PALETTE.length]);
  return S.colors.get(model);
}

// -- messages ------------------------------------------------------------------

function onCeiling(m) {
  S.ceiling = m;
  push(S.lines.ceiling, m.t, m.ceiling);
  push(S.lines.soft, m.t, m.soft_bytes);
  push(S.lines.hard, m.t, m.hard_bytes);
  S.dirty = S.tablesDirty = true;
}

function samplesTotal() {
  let total = 0;
  for (const s of S.latest.values()) total += s.memory.usage;
  return total;
}

function onPressure(m) {
  S.pressure = m;
  S.own = m.usage - samplesTotal();
  push(S.lines.group, m.t, m.usage);
  push(S.lines.ceiling, m.t, m.ceiling);
  push(S.lines.soft, m.t, m.soft_bytes);
  push(S.lines.hard, m.t, m.hard_bytes);
  S.dirty = S.tablesDirty = true;
}

function onSample(m) {
  const t = m.t + S.offset;
  S.latest.set(m.worker_id, m);
  const series = m.model_id || "spare";   // W1: a spare worker has no model yet
  if (!S.models.has(series)) S.models.set(series, []);
  push(S.models.get(series), t, m.memory.usage);
  if (S.pressure) push(S.lines.group, t, S.own + samplesTotal());
  S.dirty = S.tablesDirty = true;
}

function onEvent(ev) {
  const key = ev.t + "|" + ev.kind + "|" + ev.reason;
  if (S.seen.has(key)) return;
  S.seen.add(key);
  S.events.push(ev);
  if (S.events.length > 500) S.events.shift();
  if (ACTIONS.has(ev.kind) || ev.kind === "level" || ev.kind === "drill") S.marks.push(ev);
  if (["exit", "crash", "evict", "unload"].includes(ev.kind) && ev.worker_id) S.latest.delete(ev.worker_id);
  if (["exit", "crash"].includes(ev.kind) && ev.worker_id) S.gone.add(ev.worker_id);
  // W6: a load's phase and the weights read, until it is over
  if (ev.kind === "load_progress" && ev.load && ev.model_id) S.progress.set(ev.model_id, ev.load);
  if (["loaded", "load_phases", "load_failed", "exit", "crash"].includes(ev.kind)) S.progress.delete(ev.model_id);
  S.dirty = S.tablesDirty = true;
}

function progressWords(load) {
  const phase = load.phase.replace("_", " ");
  if (load.phase !== "read" || !load.bytes_read) return phase;
  return phase + " " + fmt(load.bytes_read) + (load.estimate_bytes ? " / " + fmt(load.estimate_bytes) : "");
}

function onStatus(st) {
  S.status = st;
  S.statusAt = Date.now() / 1000;
  S.gone.clear();
  const live = new Set(st.guard.workers.map((w) => w.worker));
  for (const id of [...S.latest.keys()]) if (!live.has(id)) S.latest.delete(id);
  for (const ev of st.events) onEvent(ev);
  S.tablesDirty = true;
}

// EventSource cannot send headers, and no secret goes in a URL: with [supervisor] api_keys
// set, the key the user typed (an API key or the admin token) is traded, as a header, for a
// same-origin HttpOnly cookie that opens /v1/events only (POST /ui/ticket).
async function ticket() {
  if (!S.token) return;
  await fetch("/ui/ticket", { method: "POST", headers: authHeaders() }).catch(() => null);
}

async function connect() {
  if (S.es) S.es.close();
  await ticket();
  const since = Date.now() / 1000 - S.windowSec;
  const es = new EventSource("/v1/events?since=" + since.toFixed(3));
  S.es = es;
  const conn = $("conn");
  const on = (name, fn) => es.addEventListener(name, (e) => fn(JSON.parse(e.data)));
  on("hello", (h) => { S.offset = h.t - h.monotonic; conn.textContent = "live"; conn.className = "conn live"; });
  on("ceiling", onCeiling);
  on("pressure", onPressure);
  on("sample", onSample);
  on("event", onEvent);
  on("status", (m) => onStatus(m.status));
  on("dropped", (d) => { conn.textContent = "dropped: " + d.reason; conn.className = "conn down"; });
  on("closed", (d) => { conn.textContent = d.reason; conn.className = "conn down"; });
  es.onerror = () => {
    conn.textContent = "reconnecting…"; conn.className = "conn down";
    // refused (no key yet, or the server restarted and forgot the ticket): ask again, later
    if (es.readyState === EventSource.CLOSED && S.es === es) setTimeout(connect, 3000);
  };
}

// -- the header, the cards and the tables --------------------------------------------

function renderCards() {
  const c = S.ceiling, p = S.pressure, g = S.status && S.status.guard;
  const level = p ? p.level : g ? g.pressure_level : "unknown";
  $("level").textContent = level;
  $("level").className = "badge level-" + level;
  $("paused").hidden = !(p && p.admission_paused);
  if (c) {
    $("ceiling").textContent = c.enabled ? fmt(c.ceiling) : "guard off";
    $("binding").textContent = "bound by " + c.binding + " · static " + fmt(c.static) +
      (c.dynamic ? " · dynamic " + fmt(c.dynamic) : "") + (c.gpu_cap ? " · gpu cap " + fmt(c.gpu_cap) : "");
    $("watermarks").textContent = fmt(c.soft_bytes) + " / " + fmt(c.hard_bytes);
    $("tier").textContent = c.tier;
  }
  if (p) {
    $("usage").textContent = fmt(p.usage);
    $("utilization").textContent = (p.utilization * 100).toFixed(1) + " % of the ceiling";
    $("interval").textContent = "guard ticks every " + p.interval + " s";
  }
  if (g) {
    $("thresholds").textContent = "at " + (g.soft_threshold * 100).toFixed(0) + " % / " +
      (g.hard_threshold * 100).toFixed(0) + " % of the ceiling";
    $("remedy").textContent = g.warning || (g.remedy ? "if the ceiling is too low: " + g.remedy : "");
  }
  renderDevice(p ? p.device : c ? c.device : g ? g.device : null);
  const last = [...S.events].reverse().find((e) => ACTIONS.has(e.kind));
  if (last) {
    const box = $("last-action");
    box.replaceChildren(el("span", last.kind, "kind"),
      el("span", (last.model_id ? last.model_id + ": " : "") + last.reason + " (" + clock(last.t) + ")"));
  }
}

// SPEC D6: a discrete device's pool beside the host's; nothing at all without one
function renderDevice(d) {
  $("device-card").hidden = !d;
  if (!d) return;
  const level = d.ceiling > 0 ? d.level : "unknown";
  $("device-name").textContent = d.name || "";
  $("device-level").textContent = d.ceiling > 0 ? d.level + (d.emergency ? " !" : "") : "off";
  $("device-level").className = "badge level-" + level;
  $("device-usage").textContent = fmt(d.usage) + " / " + (d.ceiling > 0 ? fmt(d.ceiling) : "no limit");
  const fill = $("device-fill");
  fill.style.width = (d.ceiling > 0 ? Math.min(100, d.utilization * 100) : 0).toFixed(1) + "%";
  fill.className = "level-" + level;
  $("device-sub").textContent = (d.ceiling > 0 ? (d.utilization * 100).toFixed(1) + " % · bound by " + d.binding +
    " · soft " + fmt(d.soft_bytes) + " / hard " + fmt(d.hard_bytes) + " · " : "") + "device " + fmt(d.total) +
    (d.free !== null && d.free !== undefined ? ", free " + fmt(d.free) : "");
}

function modelRows() {
  const byId = new Map();
  const configured = S.session ? S.session.models : [];
  for (const m of configured) byId.set(m.id, { id: m.id, ttl: m.ttl, pinned: m.pinned, state: "unloaded" });
  if (S.status) {
    for (const m of S.status.models) {
      if (!byId.has(m.id)) byId.set(m.id, { id: m.id });
      Object.assign(byId.get(m.id), { state: m.state, pid: m.pid, worker: m.worker, pinned: m.pinned,
        disk: m.disk_cache_bytes });
    }
    const since = Date.now() / 1000 - S.statusAt;
    for (const w of S.status.guard.workers) {
      if (!w.model && !S.gone.has(w.worker) && !["stopped", "dead"].includes(w.state)) {   // W1: a spare
        byId.set("spare:" + w.worker, { id: "(spare)", spare: true, state: w.state === "starting" ? "starting" :
          w.state, pid: w.pid, worker: w.worker, usage: w.usage, active: w.mlx_active, pool: w.mlx_pool });
        continue;
      }
      const row = byId.get(w.model);
      if (!row) continue;
      Object.assign(row, { usage: w.usage, active: w.mlx_active, pool: w.mlx_pool, running: w.running,
        queued: w.queued, idle: w.running || w.queued ? 0 : w.idle_seconds + since, cache: w.cache_bytes,
        batch: w.batch_bytes, live: w.batch_live_bytes });
    }
  }
  for (const [key, row] of byId) {   // an exit is shown at once, not at the next status
    if (row.spare && S.gone.has(row.worker)) byId.delete(key);
    else if (row.worker && S.gone.has(row.worker)) byId.set(key, { id: row.id, ttl: row.ttl, pinned: row.pinned,
      state: "unloaded", disk: row.disk });
  }
  for (const [id, load] of S.progress) {
    const row = byId.get(id);
    if (row) row.progress = progressWords(load);
  }
  for (const s of S.latest.values()) {
    const row = byId.get(s.model_id);
    const m = s.memory;   // the worker's MemoryReading, as it wrote it into the ledger
    if (row && row.worker === s.worker_id) Object.assign(row, { usage: m.usage, active: m.mlx_active,
      pool: m.mlx_pool, running: s.running, queued: s.queued, cache: m.cache_bytes, batch: m.batch_bytes,
      live: m.batch_live_bytes });
  }
  return [...byId.values()];
}

function renderModels() {
  const body = $("models").tBodies[0];
  const rows = modelRows().map((m) => {
    const tr = document.createElement("tr");
    tr.dataset.model = m.id;
    const name = el("td", m.id);
    name.append(el("span", m.pinned ? " (pinned)" : "", "hint"));
    const ttl = m.pinned ? "pinned" : !m.ttl ? "never" :
      dur(m.ttl) + (m.idle !== undefined ? " (in " + dur(Math.max(0, m.ttl - m.idle)) + ")" : "");
    const state = (m.state || "–") + (m.progress ? " · " + m.progress : "");
    tr.append(name, el("td", state, "state-" + m.state), el("td", m.pid || "–"),
      el("td", fmt(m.usage), "num"), el("td", fmt(m.active), "num"), el("td", fmt(m.pool), "num"),
      el("td", m.cache === undefined ? "–" : fmt(m.cache), "num"),
      el("td", m.disk ? fmt(m.disk) : "–", "num"),
      el("td", !m.batch ? "–" : fmt(m.batch) + " (live " + fmt(m.live || 0) + ")", "num"),
      el("td", m.running === undefined ? "–" : m.running + " / " + m.queued, "num"),
      el("td", m.idle === undefined ? "–" : dur(m.idle), "num"), el("td", ttl, "num"));
    const act = el("td", undefined, "admin-only");
    tr.append(act);
    if (m.spare) return tr;   // a spare is not loaded or unloaded by hand
    const loaded = m.state && !["unloaded", "failed", "stopped", "dead"].includes(m.state);
    const button = el("button", loaded ? "unload" : "load");
    button.type = "button";
    button.dataset.action = button.textContent;
    act.append(button);
    return tr;
  });
  body.replaceChildren(...rows);
}

// H5, H6 (proposed): the prompt cache's disk tier under the models, as workers reported it
function renderDiskCache() {
  const d = S.status && S.status.disk_cache;
  if (!d) return;
  let text = d.max === 0 ? "prompt cache on disk: off" :
    "prompt cache on disk: " + fmt(d.bytes) + " of " + (d.budget ? fmt(d.budget) : d.max < 0 ? "auto" : fmt(d.max)) +
    " · " + d.entries + " entries · read back " + d.read_entries + " (" + d.read_tokens + " tokens) · written " +
    d.written_entries + " · not written at a stop's deadline " + d.dropped_entries + " · evicted " + d.evicted_entries;
  if (d.quantize_bits || d.quantized_entries) text += " · quantized " + d.quantized_entries + " (" +
    fmt(d.quantized_bytes) + " returned)";
  $("disk-cache").textContent = text;
}

function renderEvents() {
  const rows = [...S.events].reverse().slice(0, 200).map((e) => {
    const tr = document.createElement("tr");
    tr.className = ACTIONS.has(e.kind) ? "kind-action" : e.kind === "level" ? "kind-level" : "";
    tr.dataset.kind = e.kind;
    tr.append(el("td", clock(e.t)), el("td", e.kind), el("td", e.model_id || ""), el("td", e.reason, "reason"),
      el("td", e.usage ? fmt(e.usage) : "", "num"));
    return tr;
  });
  $("events").tBodies[0].replaceChildren(...rows);
}

// -- the chart ---------------------------------------------------------------------------

function niceStep(max) {
  const raw = max / 5, steps = [1, 2, 5, 10];
  const unit = raw >= GiB ? GiB : MiB;
  const mag = Math.pow(10, Math.floor(Math.log10(raw / unit)));
  for (const s of steps) if (s * mag * unit >= raw) return s * mag * unit;
  return 10 * mag * unit;
}

function drawChart() {
  const canvas = $("chart"), dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000, t0 = now - S.windowSec;
  const L = 70, R = 10, T = 18, B = 22, pw = w - L - R, ph = h - T - B;
  const visible = (series) => series.filter((pt) => pt[0] >= t0 - 30);
  // the axis follows what is used, and takes in the watermarks once usage nears them (axis.js)
  let peak = 0;
  for (const series of [S.lines.group, ...S.models.values()]) {
    for (const [t, v] of series) if (t >= t0 && v > peak) peak = v;
  }
  const last = (series) => (series.length ? series[series.length - 1][1] : 0);
  const marks = { ceiling: last(S.lines.ceiling), hard: last(S.lines.hard), soft: last(S.lines.soft) };
  const axis = chartAxis(peak, marks), ymax = axis.top;
  S.axis = axis;  // what the page drew, for the browser test
  const x = (t) => L + ((t - t0) / S.windowSec) * pw, y = (v) => T + ph - (v / ymax) * ph;
  // grid and axes
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#8b97a5";
  ctx.strokeStyle = "#2a3440";
  ctx.lineWidth = 1;
  const step = niceStep(ymax);
  for (let v = 0; v <= ymax; v += step) {
    ctx.beginPath(); ctx.moveTo(L, y(v)); ctx.lineTo(L + pw, y(v)); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(fmt(v), L - 6, y(v) + 4);
  }
  const tick = S.windowSec / 5;
  for (let k = 0; k <= 5; k++) {
    const t = now - k * tick;
    ctx.textAlign = "center";
    ctx.fillText(k === 0 ? "now" : "-" + dur(k * tick), x(t), h - 6);
  }
  ctx.save();
  ctx.beginPath(); ctx.rect(L, T, pw, ph); ctx.clip();
  // soft..hard band, then the lines
  band(ctx, visible(S.lines.soft), visible(S.lines.hard), x, y, now);
  stepLine(ctx, visible(S.lines.soft), x, y, now, "#d29922", [6, 4], 1.5);
  stepLine(ctx, visible(S.lines.hard), x, y, now, "#f0883e", [6, 4], 1.5);
  stepLine(ctx, visible(S.lines.ceiling), x, y, now, "#f85149", [], 2);
  for (const [model, series] of S.models) line(ctx, visible(series), x, y, colorOf(model), 1.5);
  line(ctx, visible(S.lines.group), x, y, "#58a6ff", 2.5);
  // the guard's actions, labelled in rows so that marks close together stay legible
  let row = 0;
  for (const ev of S.marks) {
    if (ev.t < t0) continue;
    const color = ev.kind === "level" ? "#d29922" : ev.kind === "drill" ? "#a371f7" : "#f85149";
    ctx.strokeStyle = color; ctx.setLineDash([2, 3]); ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(x(ev.t), T); ctx.lineTo(x(ev.t), T + ph); ctx.stroke();
    ctx.setLineDash([]);
    const label = ev.kind === "level" ? ev.reason.split(":")[0] : ev.kind + (ev.model_id ? " " + ev.model_id : "");
    const lw = ctx.measureText(label).width, ly = T + 12 + 15 * (row++ % 6);
    ctx.fillStyle = "rgba(23, 30, 38, 0.85)";
    ctx.fillRect(x(ev.t) - lw - 6, ly - 11, lw + 4, 14);
    ctx.fillStyle = color; ctx.textAlign = "right";
    ctx.fillText(label, x(ev.t) - 4, ly);
  }
  ctx.restore();
  if (axis.above.length) {  // the watermarks over the axis, in words at its top edge
    ctx.fillStyle = "#8b97a5"; ctx.textAlign = "right";
    ctx.fillText(axis.above.map((name) => name + " " + fmt(marks[name])).join(" · ") + " ↑", L + pw - 4, T - 5);
  }
  legend();
}

function line(ctx, pts, x, y, color, width) {
  if (!pts.length) return;
  ctx.strokeStyle = color; ctx.lineWidth = width; ctx.setLineDash([]);
  ctx.beginPath();
  pts.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
  ctx.stroke();
}

function stepLine(ctx, pts, x, y, now, color, dash, width) {
  if (!pts.length) return;
  ctx.strokeStyle = color; ctx.lineWidth = width; ctx.setLineDash(dash);
  ctx.beginPath();
  pts.forEach(([t, v], i) => {
    if (i) ctx.lineTo(x(t), y(pts[i - 1][1]));
    i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v));
  });
  ctx.lineTo(x(now), y(pts[pts.length - 1][1]));
  ctx.stroke();
  ctx.setLineDash([]);
}

function band(ctx, soft, hard, x, y, now) {
  // soft and hard arrive together (ceiling and pressure messages carry both)
  ctx.fillStyle = "rgba(210, 153, 34, 0.12)";
  const n = Math.min(soft.length, hard.length);
  for (let i = 0; i < n; i++) {
    const end = i + 1 < n ? soft[i + 1][0] : now;
    ctx.fillRect(x(soft[i][0]), y(hard[i][1]), x(end) - x(soft[i][0]), y(soft[i][1]) - y(hard[i][1]));
  }
}

function legend() {
  const items = [["group usage", "#58a6ff"], ["ceiling", "#f85149"], ["hard", "#f0883e"], ["soft", "#d29922"]];
  for (const model of S.models.keys()) items.push([model, colorOf(model)]);
  const key = items.map((i) => i[0]).join("|");
  const box = $("legend");
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.replaceChildren(...items.map(([name, color]) => {
    const span = el("span");
    const swatch = el("i");
    swatch.style.background = color;
    span.append(swatch, document.createTextNode(name));
    return span;
  }));
}

// -- admin: load, unload, the guard switch -------------------------------------------------

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  if (S.token) headers.Authorization = "Bearer " + S.token;
  return headers;
}

async function admin(path, body, out) {
  out.textContent = "…";
  try {
    const r = await fetch(path, { method: "POST", headers: authHeaders(), body: body ? JSON.stringify(body) : "" });
    const answer = await r.json().catch(() => ({}));
    out.textContent = r.ok ? "done: " + path : (answer.error ? answer.error.message : "HTTP " + r.status);
  } catch (err) {
    out.textContent = String(err);
  }
}

async function loadSession() {
  const r = await fetch("/ui/session", { headers: authHeaders() });
  S.session = await r.json();
  document.body.classList.toggle("admin", S.session.admin);
  $("token-box").hidden = !(S.session.token_required || S.session.key_required);
  const select = $("tier-select");
  if (!select.options.length) for (const t of S.session.tiers) select.append(new Option(t, t));
  S.tablesDirty = true;
  return S.session;
}

function wireForms() {
  $("models").addEventListener("click", (e) => {   // one listener: rows are redrawn every second
    const button = e.target.closest("button[data-action]");
    if (!button) return;
    const model = button.closest("tr").dataset.model;
    admin("/v1/models/" + encodeURIComponent(model) + "/" + button.dataset.action, null, $("admin-result"));
  });
  $("guard-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const body = { tier: $("tier-select").value, enabled: $("guard-enabled").checked };
    const ceiling = $("custom-ceiling").value.trim();
    if (ceiling) body.custom_ceiling = ceiling;
    admin("/admin/guard", body, $("admin-result"));
  });
  $("token-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    S.token = $("token").value.trim();
    sessionStorage.setItem("memvisor-token", S.token);
    const session = await loadSession();
    $("token-result").textContent = session.admin ? "unlocked"
      : !session.key_required && session.token_required ? "events unlocked; that is not the admin token"
      : "that is not the admin token or an API key";
    if (!session.key_required) connect();
  });
  for (const b of document.querySelectorAll("[data-window]")) {
    b.addEventListener("click", () => {
      S.windowSec = Number(b.dataset.window);
      for (const o of document.querySelectorAll("[data-window]")) o.classList.toggle("on", o === b);
      S.dirty = true;
    });
  }
}

function syncGuardForm() {
  // follow the server only when its settings change, never over what the user is choosing
  if (!S.ceiling) return;
  const key = S.ceiling.tier + "|" + S.ceiling.enabled;
  if (key === S.formSynced) return;
  S.formSynced = key;
  $("tier-select").value = S.ceiling.tier;
  $("guard-enabled").checked = S.ceiling.enabled;
}

function frame() {
  if (S.dirty) { S.dirty = false; drawChart(); }
  requestAnimationFrame(frame);
}

async function start() {
  wireForms();
  await loadSession().catch(() => null);
  try {
    const r = await fetch("/status");
    onStatus(await r.json());
  } catch (err) { /* the stream brings a status within seconds */ }
  connect();
  setInterval(() => { S.dirty = true; }, 250);            // the time axis moves on
  setInterval(() => {
    if (!S.tablesDirty) return;
    S.tablesDirty = false;
    renderCards(); renderEvents(); renderDiskCache();
    syncGuardForm();
  }, 250);
  setInterval(renderModels, 1000);                         // idle clocks tick; a click survives a redraw
  requestAnimationFrame(frame);
}

document.addEventListener("DOMContentLoaded", start);
