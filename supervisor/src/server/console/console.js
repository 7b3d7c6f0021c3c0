// berth's console: the models, their memory over time with the events on
// it, the event list, unload reports and the last stderr lines of workers
// that died. Plain JavaScript served by berth itself; nothing is fetched
// from anywhere else. Every event shown comes from /api/events; the table
// from /api/ps and /api/models, the charts' lines from /api/history.
//
// Everything a worker or a config sets (names, stderr lines, errors) is
// put on the page as text, never as markup.
"use strict";

const TOKEN_KEY = "berth-token";
const MAX_EVENTS = 500;
const MAX_REPORTS = 20;
const SVG = "http://www.w3.org/2000/svg";

const state = {
  token: localStorage.getItem(TOKEN_KEY) || "",
  models: [], // /api/ps
  catalogue: [], // /api/models
  history: { host: [], models: {} },
  lastSample: 0,
  events: [], // oldest first
  lastEventId: 0,
  started: false,
  following: false,
  fresh: false, // no event yet on the current connection
  pending: { models: false, charts: false },
};

// Many events at once (the kept ones, on connecting) redraw once.
function soon(what, f) {
  if (state.pending[what]) return;
  state.pending[what] = true;
  setTimeout(() => {
    state.pending[what] = false;
    f();
  }, 100);
}

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function mib(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  if (bytes >= 10 * 1073741824) return (bytes / 1073741824).toFixed(1) + " GiB";
  return (bytes / 1048576).toFixed(1) + " MiB";
}

function clock(ms) {
  return new Date(ms).toLocaleTimeString([], { hour12: false });
}

// ---- talking to berth -------------------------------------------------

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (state.token) headers["Authorization"] = "Bearer " + state.token;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const reply = await fetch(path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
    signal: options.signal,
    cache: "no-store",
  });
  if (reply.status === 401) throw new Unauthorized();
  if (options.raw) return reply;
  const value = await reply.json().catch(() => ({}));
  if (!reply.ok) {
    const message = (value.error && value.error.message) || "HTTP " + reply.status;
    throw new Error(message);
  }
  return value;
}

function askForToken(message) {
  $("console").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setStatus("needs a token", "down");
  $("token").focus();
}

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = $("token").value.trim();
  localStorage.setItem(TOKEN_KEY, state.token);
  $("token").value = "";
  start();
});

function setStatus(text, kind) {
  const s = $("status");
  s.textContent = text;
  s.className = "status " + (kind || "");
}

// ---- the event stream -------------------------------------------------

// EventSource cannot send a header, and the token never goes in a URL: the
// stream is read with fetch and parsed here.
async function follow() {
  for (;;) {
    try {
      const reply = await api("/api/events?since=" + state.lastEventId, { raw: true });
      if (!reply.ok) throw new Error("HTTP " + reply.status);
      setStatus("live", "live");
      state.fresh = true;
      const reader = reply.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          handleMessage(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
    } catch (e) {
      if (e instanceof Unauthorized) {
        state.following = false;
        return askForToken("The token was refused.");
      }
    }
    setStatus("reconnecting…", "down");
    await new Promise((r) => setTimeout(r, 2000));
  }
}

function handleMessage(text) {
  let name = null;
  let data = "";
  for (const line of text.split("\n")) {
    if (line.startsWith("event: ")) name = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (!data) return;
  let value;
  try {
    value = JSON.parse(data);
  } catch {
    return;
  }
  if (name === "missed" || name === "dropped") {
    note(value.message || name);
    return;
  }
  if (typeof value.id !== "number") return;
  if (state.fresh && value.id <= state.lastEventId) {
    // A new run of berth (its numbers start again at 1): what was shown
    // is of the old one.
    state.events = [];
    state.lastEventId = 0;
    $("events").replaceChildren();
  }
  state.fresh = false;
  if (value.id <= state.lastEventId) return;
  state.lastEventId = value.id;
  state.events.push(value);
  if (state.events.length > MAX_EVENTS) state.events.shift();
  addEvent(value);
  if (value.type === "unloaded") addReport(value);
  if (value.type === "crashed") addStderr(value);
  if (["loaded", "unloaded", "crashed", "registered", "deregistered", "swap_completed", "recycled", "failed", "restart_cancelled", "failure_cleared", "slept", "woke", "sleep_failed"].includes(value.type)) {
    soon("models", refreshModels);
  }
  soon("charts", drawCharts);
}

function note(text) {
  $("events").prepend(el("li", { class: "note" }, text));
}

function describe(e) {
  const r = e.report || {};
  switch (e.type) {
    case "loaded": return `pid ${r.pid} in ${Math.round(r.load_ms || 0)} ms, RSS ${mib(r.rss_bytes)}`;
    case "unloaded": return `pid ${r.pid}: reclaimed ${mib(r.reclaimed_bytes)} of RSS ${mib(r.rss_at_stop_bytes)}, ${r.leftover_processes} processes left over`;
    case "slept": return `pid ${r.pid}: GPU ${mib(r.vram_before_bytes)} → ${mib(r.vram_after_bytes)} (NVML) in ${Math.round(r.checkpoint_ms || 0)} ms`;
    case "woke": return `pid ${r.pid}: GPU ${mib(r.vram_bytes)} back in ${Math.round(r.restore_ms || 0)} ms`;
    case "sleep_failed": return `${e.step}: ${e.error}; ${e.fallback}`;
    case "crashed": return e.description || "";
    case "memory_limit_exceeded": return `peak ${mib(e.peak_bytes)} over its limit of ${mib(e.limit_bytes)}`;
    case "evicted": return e.for_model ? `to make room for ${e.for_model}` : "past the memory or GPU budget";
    case "swap_completed": return r.old_pid ? `pid ${r.old_pid} → ${r.new_pid}` : "spec updated (nothing was running)";
    case "recycled": return `pid ${e.old_pid} → ${e.new_pid}`;
    case "recycling": return e.why || "";
    case "restarting": return `in ${e.in_ms} ms`;
    case "restarted": return `pid ${e.pid}`;
    case "quarantined": return `${e.requests} requests`;
    case "load_failed": case "swap_rolled_back": case "recycle_failed": return e.error || "";
    case "failed": return e.reason || "";
    case "server_started": return `berth ${e.version} on ${e.listen}`;
    case "warning": case "gpu_budget_overrun": return e.message || "";
    default: return "";
  }
}

function addEvent(e) {
  const item = el("li", { "data-type": e.type, "data-model": e.model || "" },
    el("time", {}, clock(e.at_unix_ms)),
    el("span", { class: "type" }, e.type.replaceAll("_", " ")), " ",
    e.model ? el("b", {}, e.model) : "", " ", describe(e));
  $("events").prepend(item);
  while ($("events").children.length > MAX_EVENTS) $("events").lastChild.remove();
}

function addReport(e) {
  const r = e.report;
  const box = $("reports");
  if (box.querySelector(".note")) box.replaceChildren();
  box.prepend(el("div", { class: "report", "data-model": e.model, "data-pid": String(r.pid) },
    el("div", {}, el("strong", {}, e.model), ` pid ${r.pid}, ${clock(e.at_unix_ms)}: stopped (${r.stop}) after ${r.took_ms.toFixed(1)} ms, ${r.requests} requests`),
    el("div", {}, "memory at stop: RSS ", mib(r.rss_at_stop_bytes), ", anonymous ", mib(r.anon_at_stop_bytes), ", peak ", mib(r.peak_rss_bytes)),
    el("div", {}, "reclaimed ", el("b", {}, mib(r.reclaimed_bytes)),
      ` (system anonymous memory ${mib(r.system_anon_before_bytes)} → ${mib(r.system_anon_after_bytes)}); ${r.leftover_processes} processes left over`)));
  while (box.children.length > MAX_REPORTS) box.lastChild.remove();
}

function addStderr(e) {
  const box = $("stderr");
  if (box.querySelector(".note")) box.replaceChildren();
  box.prepend(el("div", { "data-model": e.model },
    el("div", {}, el("strong", {}, e.model), ` pid ${e.pid}, ${clock(e.at_unix_ms)}: ${e.description}`),
    el("pre", {}, (e.stderr_tail || []).join("\n") || "(nothing on stderr)")));
  while (box.children.length > MAX_REPORTS) box.lastChild.remove();
}

// ---- the models table ------------------------------------------------

async function refreshModels() {
  try {
    const [ps, catalogue] = await Promise.all([api("/api/ps"), api("/api/models")]);
    state.models = ps.models || [];
    state.catalogue = catalogue.models || [];
    drawTable();
    drawLiveStderr();
  } catch (e) {
    if (e instanceof Unauthorized) askForToken("The token was refused.");
  }
}

async function act(model, action) {
  $("action-error").textContent = "";
  try {
    let body = {};
    if (action === "swap") {
      // A swap to the model's own spec: a new worker, the old one drained.
      const entry = state.catalogue.find((m) => m.spec.name === model);
      body = (entry && entry.spec) || {};
    }
    await api(`/api/models/${encodeURIComponent(model)}/${action}`, { method: "POST", body });
  } catch (e) {
    if (e instanceof Unauthorized) return askForToken("The token was refused.");
    $("action-error").textContent = `${action} ${model}: ${e.message}`;
  }
  refreshModels();
}

function drawTable() {
  const body = $("models").querySelector("tbody");
  const loaded = new Map(state.models.map((m) => [m.name, m]));
  const names = new Set([...state.catalogue.map((m) => m.spec.name), ...loaded.keys()]);
  const rows = [];
  for (const name of [...names].sort()) {
    const m = loaded.get(name);
    const entry = state.catalogue.find((c) => c.spec.name === name) || {};
    const st = m ? m.state : "unloaded";
    const button = (action, label) => {
      const b = el("button", { "data-action": action, "data-model": name }, label);
      b.addEventListener("click", () => act(name, action));
      return b;
    };
    const actions = el("td", {});
    if (!m) actions.append(button("load", "Load"));
    else actions.append(button("unload", "Unload"), button("swap", "Swap"));
    const batch = m && m.batching && m.batching.mean_batch_size;
    rows.push(el("tr", { "data-model": name, "data-pid": m && m.pid ? String(m.pid) : "", "data-rss": m ? String(m.rss_bytes) : "0" },
      el("td", {}, name, entry.spec && entry.spec.backend ? el("span", { class: "note" }, " " + entry.spec.backend) : "",
        ...((m && m.warnings) || []).map((w) => el("div", { class: "warning", "data-code": w.code }, "⚠ " + w.message))),
      el("td", { class: "state-" + st }, st),
      el("td", {}, m && m.pid ? m.pid : "–"),
      el("td", { class: "num" }, m ? mib(m.rss_bytes) : "–"),
      el("td", { class: "num" }, m && m.pss_bytes ? mib(m.pss_bytes) : "–"),
      el("td", { class: "num" }, m && m.vram_bytes ? mib(m.vram_bytes) : "–"),
      el("td", { class: "num" }, m ? m.in_flight : "–"),
      el("td", { class: "num" }, m ? m.queued : "–"),
      el("td", { class: "num" }, batch ? batch.toFixed(1) : "–"),
      el("td", { class: "num" }, m && m.keep_alive_left_s !== null && m.keep_alive_left_s !== undefined ? Math.round(m.keep_alive_left_s) + " s" : "–"),
      actions));
  }
  body.replaceChildren(...rows);
}

function drawLiveStderr() {
  const blocks = state.models
    .filter((m) => m.stderr_tail && m.stderr_tail.length)
    .map((m) => el("div", { "data-model": m.name, class: "live" },
      el("div", {}, el("strong", {}, m.name), ` pid ${m.pid}, running:`),
      el("pre", {}, m.stderr_tail.join("\n"))));
  $("stderr-live").replaceChildren(...blocks);
}

// ---- the charts ------------------------------------------------------

async function refreshHistory() {
  try {
    const h = await api("/api/history?since_ms=" + state.lastSample);
    const keep = 1024;
    state.history.host = state.history.host.concat(h.host).slice(-keep);
    for (const [name, samples] of Object.entries(h.models)) {
      const old = state.history.models[name] || [];
      // A load's or unload's own sample may land between two ticks.
      state.history.models[name] = old.concat(samples).sort((a, b) => a.at_unix_ms - b.at_unix_ms).slice(-keep);
    }
    for (const name of Object.keys(state.history.models)) {
      if (!(name in h.models)) delete state.history.models[name];
    }
    const last = state.history.host[state.history.host.length - 1];
    if (last) state.lastSample = last.at_unix_ms;
    drawCharts();
  } catch (e) {
    if (e instanceof Unauthorized) askForToken("The token was refused.");
  }
}

const MARKS = {
  loaded: ["mark-load", (e) => "loaded"],
  unloaded: ["mark-unload", (e) => "unloaded: reclaimed " + mib(e.report.reclaimed_bytes)],
  crashed: ["mark-crash", (e) => "crashed"],
  memory_limit_exceeded: ["mark-crash", (e) => "memory limit"],
  swap_completed: ["mark-other", (e) => "swapped"],
  recycled: ["mark-other", (e) => "recycled"],
  evicted: ["mark-other", (e) => "evicted"],
  slept: ["mark-other", (e) => "asleep"],
  woke: ["mark-other", (e) => "awake"],
};

function chart(title, id, series, marks) {
  const W = 600, H = 180, L = 66, R = 8, T = 10, B = 22;
  const all = series.flatMap((s) => s.points);
  const latest = series
    .filter((s) => s.points.length)
    .map((s) => `${s.label} ${mib(s.points[s.points.length - 1][1])}`)
    .join(", ");
  const box = el("div", { class: "chart", "data-chart": id },
    el("h3", {}, title, latest ? el("span", { class: "note" }, " · " + latest) : ""));
  const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  box.append(plot);
  const now = Date.now();
  const first = Math.min(now, ...all.map((p) => p[0]), ...marks.map((m) => m.at));
  const t0 = Math.min(first, now - 20000);
  const t1 = now;
  const top = Math.max(1048576, ...all.map((p) => p[1])) * 1.1;
  const x = (t) => L + ((t - t0) / Math.max(1, t1 - t0)) * (W - L - R);
  const y = (v) => T + (1 - v / top) * (H - T - B);
  plot.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  for (const f of [0, 0.5, 1]) {
    const v = (top / 1.1) * f;
    plot.append(svg("text", { class: "label", x: L - 4, y: y(v) + 3, "text-anchor": "end" }, mib(v)));
  }
  plot.append(svg("text", { class: "label", x: L, y: H - 6 }, clock(t0)));
  plot.append(svg("text", { class: "label", x: W - R, y: H - 6, "text-anchor": "end" }, clock(t1)));
  for (const s of series) {
    if (s.points.length === 0) continue;
    const d = s.points.map((p, i) => (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[1]).toFixed(1)).join(" ");
    plot.append(svg("path", { class: s.class, d }));
  }
  let row = 0;
  for (const m of marks) {
    const mx = x(m.at);
    plot.append(svg("line", { class: "mark " + m.class, x1: mx, x2: mx, y1: T, y2: H - B }));
    plot.append(svg("text", { class: "mark " + m.class, x: mx + 3, y: T + 10 + 11 * (row++ % 4), "data-event": m.type }, m.label));
  }
  return box;
}

function drawCharts() {
  const charts = [];
  const host = state.history.host;
  charts.push(chart("host", "host", [
    { class: "avail", label: "available", points: host.map((s) => [s.at_unix_ms, s.available_bytes]) },
    { class: "rss", label: "workers", points: host.map((s) => [s.at_unix_ms, s.workers_rss_bytes]) },
  ], []));
  const names = new Set([...Object.keys(state.history.models), ...state.events.filter((e) => MARKS[e.type] && e.model).map((e) => e.model)]);
  const since = host.length ? host[0].at_unix_ms : Date.now() - 60000;
  for (const name of [...names].sort()) {
    const samples = state.history.models[name] || [];
    const marks = state.events
      .filter((e) => e.model === name && MARKS[e.type] && e.at_unix_ms >= since)
      .map((e) => ({ at: e.at_unix_ms, type: e.type, class: MARKS[e.type][0], label: MARKS[e.type][1](e) }));
    charts.push(chart(name, name, [
      { class: "rss", label: "RSS", points: samples.map((s) => [s.at_unix_ms, s.rss_bytes]) },
    ], marks));
  }
  $("charts").replaceChildren(...charts);
}

// ---- start -----------------------------------------------------------

async function start() {
  try {
    await api("/api/ps");
  } catch (e) {
    if (e instanceof Unauthorized) return askForToken(state.token ? "The token was refused." : "");
    setStatus("cannot reach berth: " + e.message, "down");
    setTimeout(start, 2000);
    return;
  }
  $("login").hidden = true;
  $("console").hidden = false;
  refreshModels();
  refreshHistory();
  if (!state.started) {
    state.started = true;
    setInterval(refreshModels, 2000);
    setInterval(refreshHistory, 2000);
  }
  if (!state.following) {
    state.following = true;
    follow();
  }
}

start();
