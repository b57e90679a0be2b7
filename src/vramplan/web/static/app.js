// vramplan's local page. Plain JavaScript, no build step, no network beyond this server.
// The page state is the query string; every figure comes from the same JSON as the CLI's --json.
"use strict";

const GiB = 2 ** 30;
const MAIN = ["task", "batch", "seq", "new-tokens", "grad-accum", "precision", "optimizer", "checkpointing",
  "checkpoint-fraction", "peft", "quant", "recipe"];
const PAGE_KEYS = ["model", "config", "gpu", "method", "tab", "gpus", "budget", "allow-peft", "sort"];
const DEFAULTS = { tab: "timeline" }; // + model, gpu, method: the server's (boot.defaults)
const SVGNS = "http://www.w3.org/2000/svg";

const page = {
  state: {}, catalog: null, fields: [], legend: null, gen: 0, controller: null,
  report: null, reportMethod: null, tabDone: {}, t0: null,
};
window.__vramplan = { firstAnalyticMs: null, renders: 0, traces: 0 };

// ------------------------------------------------------------------ state <-> URL
function readUrl() {
  const p = new URLSearchParams(location.search);
  const s = { ...DEFAULTS };
  for (const [k, v] of p) s[k] = v;
  return s;
}

function recipeDefaults(state = page.state) {
  // the knobs the chosen --recipe sets (server: web.params.recipe_defaults), for this PEFT mode
  const r = state.recipe || "plain";
  const byPeft = (page.catalog && page.catalog.recipes && page.catalog.recipes[r]) || {};
  return byPeft[state.peft || "none"] || {};
}

function isDefault(key, value) {
  if (key in DEFAULTS) return false; // always written: a link names its model and GPU
  const f = page.fields.find((x) => x.key === key);
  if (!f) return value === "" || value == null;
  const rd = recipeDefaults()[key]; // a recipe's default: only a different value is sent
  if (rd !== undefined) return f.kind === "bool" ? truthy(value) === truthy(rd) : String(rd) === String(value);
  if (f.kind === "bool") return !truthy(value);
  return String(f.default) === String(value);
}

function truthy(v) { return ["1", "true", "on", "yes"].includes(String(v).toLowerCase()); }

function query(extra = {}) {
  const p = new URLSearchParams();
  const s = { ...page.state, ...extra };
  for (const [k, v] of Object.entries(s)) {
    if (v === "" || v == null || k === "tab") continue;
    if (k !== "method" && isDefault(k, v)) continue;
    p.set(k, v);
  }
  return p.toString();
}

function writeUrl() {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(page.state)) {
    if (v == null || (v === "" && !(k in DEFAULTS))) continue; // "gpu=" (no GPU) differs from the default GPU
    if (isDefault(k, v) && !(k in DEFAULTS)) continue;
    if (k in DEFAULTS && v === DEFAULTS[k] && (k === "method" || k === "tab")) continue;
    p.set(k, v);
  }
  const url = `${location.pathname}?${p.toString()}`;
  if (url !== location.pathname + location.search) history.replaceState(null, "", url);
}

// ------------------------------------------------------------------ fetching
async function getJSON(path, signal) {
  const r = await fetch(path, { signal });
  let body = null;
  try { body = await r.json(); } catch (e) { body = { error: `${r.status} ${r.statusText}` }; }
  return { status: r.status, body };
}

function refresh(preloaded) {
  page.gen += 1;
  const gen = page.gen;
  if (page.controller) page.controller.abort();
  page.controller = new AbortController();
  const signal = page.controller.signal;
  page.tabDone = {};
  clearErrors();
  writeUrl();
  updateLinks();
  const qs = query({ method: "analytic" });
  setStatus("analytic…", true);
  // The page's first answer comes inside the page itself (the server computed it for this URL).
  const first = preloaded ? Promise.resolve(preloaded) : getJSON(`/api/estimate?${qs}`, signal);
  first.then(({ status, body }) => {
    if (gen !== page.gen) return;
    // no closed form for this model (CNN, UNet): with "analytic, then trace" the trace still runs
    const noFormula = status === 400 && body.field === "method" && page.state.method !== "analytic";
    page.noFormula = noFormula;
    if (status !== 200 && !noFormula) { page.lastError = body; showError(body); markStale(true); setStatus("", false); return; }
    page.lastError = null;
    if (status === 200) {
      render(body, "analytic");
      // measured when the frame that shows the answer is about to be painted (not when the JS ran)
      if (window.__vramplan.firstAnalyticMs === null) {
        requestAnimationFrame(() => { if (window.__vramplan.firstAnalyticMs === null) window.__vramplan.firstAnalyticMs = performance.now(); });
      }
      if (page.state.method === "analytic") { setStatus("analytic", false); loadTab(gen, signal); return; }
      loadTab(gen, signal);
    } else {
      markStale(true);
      document.getElementById("stale").hidden = false;
      document.getElementById("stale").textContent = `${body.error}: tracing the model instead…`;
    }
    setStatus("tracing…", true);
    getJSON(`/api/estimate?${query({ method: page.state.method })}`, signal).then(({ status: st, body: b }) => {
      if (gen !== page.gen || st === 409) return;
      if (st !== 200) { showError(b); markStale(true); setStatus("trace failed", false); return; }
      window.__vramplan.traces += 1;
      render(b, b.method, page.state.method);
      setStatus(b.method === "trace" ? "trace" : `${b.method} (not traceable)`, false);
      page.tabDone = {};
      loadTab(gen, signal);
    }).catch(ignoreAbort);
  }).catch(ignoreAbort);
}

function ignoreAbort(e) { if (e.name !== "AbortError") showError({ error: String(e) }); }

function setStatus(text, busy) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.classList.toggle("busy", !!busy);
  el.dataset.state = busy ? "busy" : "idle";
}

// ------------------------------------------------------------------ errors
function clearErrors() {
  document.querySelectorAll(".err").forEach((e) => { e.textContent = ""; });
  document.querySelectorAll(".invalid").forEach((e) => e.classList.remove("invalid"));
  const b = document.getElementById("error");
  b.hidden = true; b.textContent = "";
}

function showError(body, where) {
  const msg = (body && body.error) || "error";
  const field = body && body.field;
  const slot = field && document.getElementById(`err-${field}`);
  if (slot) {
    slot.textContent = msg;
    const input = document.getElementById(field);
    if (input) input.classList.add("invalid");
    const det = slot.closest("details");
    if (det) det.open = true;
    return;
  }
  const target = where || document.getElementById("error");
  target.hidden = false;
  target.textContent = msg;
}

// ------------------------------------------------------------------ formatting
const gib = (n) => (n / GiB).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
const gib1 = (n) => (n / GiB).toLocaleString("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
const usd = (x, d = 2) => (x == null ? "–" : x.toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d }));
function secs(s) { return s >= 100 ? `${Math.round(s)} s` : s >= 1 ? `${s.toFixed(2)} s` : `${(s * 1e3).toFixed(1)} ms`; }
function esc(s) { return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c])); }
function color(k) { return (page.legend && page.legend.colors[k]) || "#BAB0AC"; }
function label(k) { return (page.legend && page.legend.labels[k]) || k; }

// ------------------------------------------------------------------ main view
function markStale(on) {
  // a bad input never leaves the last answer looking current
  document.getElementById("results").classList.toggle("stale", on);
  const note = document.getElementById("stale");
  note.hidden = !on || !page.report;
  note.textContent = "These figures are for the last valid inputs: fix the field marked in red.";
}

function render(r, method, asked) {
  markStale(false);
  page.report = r;
  page.reportMethod = method;
  page.asked = asked || method;
  window.__vramplan.renders += 1;
  window.__vramplan.shown = { model: r.model, method: r.method, workload: r.workload };
  const set = (id, bytes) => {
    const el = document.getElementById(id);
    el.textContent = `${gib(bytes)} GiB`;
    el.dataset.bytes = String(bytes);
  };
  set("fig-allocated", r.peak.allocated);
  set("fig-reserved", r.peak.reserved);
  set("fig-device-used", r.peak.device_used);
  const v = document.getElementById("verdict");
  v.classList.remove("fits", "nofit");
  if (r.gpu) {
    v.textContent = r.fits ? "FITS" : "DOES NOT FIT";
    v.classList.add(r.fits ? "fits" : "nofit");
    v.dataset.fits = String(r.fits);
    const room = document.createElement("small");
    room.className = "room";
    room.textContent = r.headroom >= 0 ? `${gib(r.headroom)} GiB headroom` : `${gib(-r.headroom)} GiB short`;
    v.appendChild(room);
  } else { v.textContent = "no GPU chosen"; delete v.dataset.fits; }
  const w = r.workload;
  let sum = `<b>${esc(r.model)}</b> · ${(r.params / 1e9).toFixed(3)} B params · ${esc(w.task)}, batch ${w.batch}, seq ${w.seq}, ${esc(w.precision)}` +
    ` · peak in <b>${esc(r.peak_phase)}</b> · method <b id="method-used">${esc(r.method)}</b>`;
  if (r.gpu) {
    const room = r.headroom >= 0 ? `${gib(r.headroom)} GiB headroom` : `${gib(-r.headroom)} GiB short`;
    sum += `<br>${esc(r.gpu.full_name)}: ${gib(r.gpu.capacity)} GiB, usable ${gib(r.gpu.usable)} GiB — ${room}` +
      (r.max_batch != null ? ` · largest batch that fits: <b id="max-batch">${r.max_batch}</b>` : "");
  }
  document.getElementById("summary").innerHTML = sum;
  document.getElementById("bar").replaceChildren(barChart(r));
  legendRow(r);
  document.getElementById("cli").textContent = cliLine("estimate", page.asked);
  tableRows("top-modules", ["module", "peak GiB"], (r.top_modules || []).slice(0, 8).map((m) => [m.module || "(root)", gib(m.peak)]));
  tableRows("top-tensors", ["tensor", "category", "module", "MiB"], (r.top_tensors || []).slice(0, 8).map((t) =>
    [`${t.dtype}[${t.shape.join(",")}]`, t.category, t.module || "–", (t.nbytes / 2 ** 20).toFixed(1)]));
  const keys = ["weights", "gradients", "optimizer", "activations", "temporaries", "kv_cache"];
  tableRows("phases", ["phase", "allocated GiB", ...keys], (r.phases || []).map((p) =>
    [p.phase, gib(p.allocated), ...keys.map((k) => gib(p.breakdown[k] || 0))]));
  document.getElementById("notes").innerHTML = (r.notes || []).map((n) => `<li>${esc(n)}</li>`).join("");
}

function tableRows(id, head, rows) {
  const t = document.getElementById(id);
  if (!rows.length) { t.innerHTML = `<tr><td class="l muted">none (the analytic method does not list them; the trace does)</td></tr>`; return; }
  t.innerHTML = `<tr>${head.map((h, i) => `<th class="${i ? "" : "l"}">${esc(h)}</th>`).join("")}</tr>` +
    rows.map((r) => `<tr>${r.map((c, i) => `<td class="${i < 3 && isNaN(parseFloat(c)) ? "l" : ""}">${esc(c)}</td>`).join("")}</tr>`).join("");
}

function segments(r) {
  const order = ["weights", "gradients", "optimizer", "activations", "temporaries", "kv_cache", "unknown"];
  const segs = order.filter((k) => r.breakdown[k]).map((k) => [k, r.breakdown[k]]);
  const cache = r.peak.reserved - r.peak.allocated;
  if (cache > 0) segs.push(["cache", cache]);
  if (r.breakdown.overhead) segs.push(["overhead", r.breakdown.overhead]);
  return segs;
}

function el(tag, attrs = {}, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  return e;
}

function barChart(r) {
  const W = 900, H = 96, L = 10, R = 10, top = 26, h = 34;
  const usable = r.gpu ? r.gpu.usable : 0;
  const max = Math.max(r.peak.device_used, usable) * 1.04 || 1;
  const x = (b) => L + (b / max) * (W - L - R);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "breakdown at the peak against usable capacity" });
  if (usable) svg.appendChild(el("rect", { x: L, y: top, width: x(usable) - L, height: h, fill: "#f1f1f1", stroke: "#ddd" }));
  let acc = 0;
  for (const [k, b] of segments(r)) {
    const rect = el("rect", { x: x(acc), y: top, width: Math.max(x(acc + b) - x(acc), 0.5), height: h, fill: color(k), "data-key": k });
    rect.appendChild(el("title", {}, `${label(k)}: ${gib(b)} GiB`));
    svg.appendChild(rect);
    acc += b;
  }
  svg.appendChild(el("text", { x: L, y: 16, "font-size": 12 }, `allocated ${gib(r.peak.allocated)} · reserved ${gib(r.peak.reserved)} · device used ${gib(r.peak.device_used)} GiB`));
  if (usable) {
    const ux = x(usable);
    svg.appendChild(el("line", { x1: ux, x2: ux, y1: top - 8, y2: top + h + 8, stroke: "#C00000", "stroke-width": 2, "stroke-dasharray": "5 3" }));
    svg.appendChild(el("text", { x: Math.min(ux, W - 4), y: top + h + 22, "font-size": 12, fill: "#C00000", "text-anchor": ux > W - 200 ? "end" : "middle" },
      `usable ${gib(usable)} GiB`));
  }
  return svg;
}

function legendRow(r) {
  document.getElementById("legend").innerHTML = segments(r).map(([k, b]) =>
    `<span data-key="${k}"><i style="background:${color(k)}"></i>${esc(label(k))} <b>${gib(b)}</b></span>`).join("");
}

function cliLine(cmd, method, extra = "") {
  const s = page.state;
  const parts = ["vramplan", cmd, s.config ? "config.json" : s.model];
  for (const f of page.fields) {
    const v = s[f.key];
    if (v == null || v === "" || isDefault(f.key, v)) continue;
    parts.push(f.kind === "bool" ? (truthy(v) ? `--${f.key}` : `--no-${f.key}`) : `--${f.key} ${v}`);
  }
  if (s.gpu && !extra.includes("--rank-gpus")) parts.push(`--gpu ${s.gpu}`);
  if (method && method !== "auto") parts.push(`--method ${method}`);
  if (cmd === "plan") { // the search flags the page sends (see Plan search)
    if (s.gpus && !extra.includes("--gpus")) parts.push(`--gpus ${s.gpus}`);
    if (s.budget) parts.push(`--budget ${s.budget}`);
    if (truthy(s["allow-peft"] || "")) parts.push("--allow-peft");
    if (s.sort) parts.push(`--sort ${s.sort}`);
  }
  if (extra) parts.push(extra);
  parts.push("--json");
  return parts.join(" ");
}

// ------------------------------------------------------------------ timeline (same data as --plot)
function timelineChart(d) {
  const W = 900, H = 330, L = 58, R = 12, T = 22, B = 40;
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": d.title });
  const keys = Object.keys(d.stacked);
  const n = d.x.length;
  const totals = d.x.map((_, i) => keys.reduce((a, k) => a + d.stacked[k][i], 0));
  const lineMax = Math.max(0, ...Object.values(d.lines).flat());
  const dataMax = Math.max(1, ...totals, lineMax);
  const levels = Object.entries(d.levels).filter(([, v]) => v <= dataMax * 2.5);
  const ymax = Math.max(dataMax, ...levels.map(([, v]) => v)) * 1.08;
  const unit = d.unit === "MiB" ? 2 ** 20 : GiB;
  const phases = d.kind === "phases";
  const x0 = phases ? -0.5 : d.x[0], x1 = phases ? n - 0.5 : d.x[n - 1] || 1;
  const X = (v) => L + ((v - x0) / (x1 - x0 || 1)) * (W - L - R);
  const Y = (b) => T + (1 - b / ymax) * (H - T - B);
  const groups = []; // labels: a backward interleaved with recomputes (checkpointing) is one span
  for (const [a, b, name] of d.spans) {
    const g = name === "recompute" ? "backward" : name;
    const last = groups[groups.length - 1];
    if (last && last[2] === g) { last[1] = b; last[3] = last[3] || name === "recompute"; } else groups.push([a, b, g, name === "recompute"]);
  }
  if (!phases) {
    for (const [a, b, g, rec] of groups) {
      if (X(b) - X(a) > 40) svg.appendChild(el("text", { x: (X(a) + X(b)) / 2, y: T - 6, "font-size": 11, "text-anchor": "middle", fill: "#555" }, rec ? `${g} + recompute` : g));
    }
  }
  for (const [a, b, name] of d.spans) {
    if (!phases) {
      svg.appendChild(el("rect", { x: X(a), y: T, width: Math.max(X(b) - X(a), 0.5), height: H - T - B, fill: name === "backward" || name === "recompute" ? "#0000000d" : name === "optimizer" ? "#4E79A714" : "none" }));
    } else {
      svg.appendChild(el("text", { x: X((a + b) / 2), y: H - B + 16, "font-size": 12, "text-anchor": "middle" }, name));
    }
  }
  const step = niceStep(ymax / unit / 5);
  for (let t = 0; t * step * unit <= ymax; t++) {
    const b = t * step * unit;
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: Y(b), y2: Y(b), stroke: "#eee" }));
    svg.appendChild(el("text", { x: L - 6, y: Y(b) + 4, "font-size": 11, "text-anchor": "end" }, +(t * step).toFixed(3)));
  }
  svg.appendChild(el("text", { x: 12, y: T + (H - T - B) / 2, "font-size": 11, transform: `rotate(-90 12 ${T + (H - T - B) / 2})`, "text-anchor": "middle" }, d.unit));
  const base = new Array(n).fill(0);
  for (const k of keys) {
    const col = d.stacked[k];
    if (phases) {
      for (let i = 0; i < n; i++) {
        if (!col[i]) continue;
        const r = el("rect", { x: X(i - 0.3), y: Y(base[i] + col[i]), width: X(i + 0.3) - X(i - 0.3), height: Y(base[i]) - Y(base[i] + col[i]), fill: color(k) });
        r.appendChild(el("title", {}, `${label(k)}: ${gib(col[i])} GiB`));
        svg.appendChild(r);
        base[i] += col[i];
      }
    } else {
      const up = [], down = [];
      for (let i = 0; i < n; i++) { up.push(`${X(d.x[i]).toFixed(1)},${Y(base[i] + col[i]).toFixed(1)}`); down.push(`${X(d.x[i]).toFixed(1)},${Y(base[i]).toFixed(1)}`); }
      const poly = el("polygon", { points: up.concat(down.reverse()).join(" "), fill: color(k), stroke: "none" });
      poly.appendChild(el("title", {}, label(k)));
      svg.appendChild(poly);
      for (let i = 0; i < n; i++) base[i] += col[i];
    }
  }
  for (const [name, vals] of Object.entries(d.lines)) {
    svg.appendChild(el("polyline", { points: vals.map((b, i) => `${X(d.x[i]).toFixed(1)},${Y(b).toFixed(1)}`).join(" "), fill: "none", stroke: "#333", "stroke-width": 1.2, "stroke-dasharray": "4 2" }));
    svg.appendChild(el("text", { x: W - R - 4, y: Y(Math.max(...vals)) + 14, "font-size": 11, "text-anchor": "end" }, `- - ${name}`));
  }
  const off = Object.entries(d.levels).filter(([, v]) => v > dataMax * 2.5);
  off.forEach(([name, v], i) => svg.appendChild(el("text", { x: W - R - 4, y: T + 14 + 14 * i, "font-size": 11, fill: "#C00000", "text-anchor": "end" },
    `${name} ${gib(v)} GiB (off the scale)`)));
  for (const [name, v] of levels) {
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), stroke: "#C00000", "stroke-dasharray": "6 3", "stroke-width": 1.5 }));
    svg.appendChild(el("text", { x: L + 4, y: Y(v) - 4, "font-size": 11, fill: "#C00000" }, `${name} ${gib(v)} GiB`));
  }
  svg.appendChild(el("text", { x: (L + W - R) / 2, y: H - 6, "font-size": 11, "text-anchor": "middle", fill: "#555" }, phases ? "phase (analytic: one bar per phase)" : d.x_label));
  return svg;
}

function niceStep(raw) {
  const p = 10 ** Math.floor(Math.log10(raw || 1));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

// ------------------------------------------------------------------ tabs
function selectTab(name) {
  page.state.tab = name;
  for (const b of document.querySelectorAll("#tabs button")) b.setAttribute("aria-selected", String(b.dataset.tab === name));
  for (const t of document.querySelectorAll(".tab")) t.hidden = t.id !== `tab-${name}`;
}

function showTab(name) {
  selectTab(name);
  writeUrl();
  loadTab(page.gen, page.controller ? page.controller.signal : undefined);
}

function loadTab(gen, signal) {
  const tab = page.state.tab || "timeline";
  const method = page.reportMethod || "analytic";
  const key = `${tab}:${method}`;
  if (page.tabDone[key]) return;
  page.tabDone[key] = true;
  if (tab === "timeline") {
    getJSON(`/api/timeline?${query({ method: method === "analytic" ? "analytic" : page.state.method })}`, signal).then(({ status, body }) => {
      if (gen !== page.gen) return;
      const box = document.getElementById("timeline");
      if (status !== 200) { box.textContent = body.error || "no timeline"; return; }
      box.replaceChildren(timelineChart(body));
      box.dataset.kind = body.kind;
    }).catch(ignoreAbort);
  } else if (tab === "fit") {
    if (page.tabDone[`fit:analytic`] && key !== "fit:analytic") return;
    searchView("fit", gen, signal, renderFit);
  } else if (tab === "plans") {
    if (key !== "plans:analytic" && page.tabDone["plans:analytic"]) return;
    searchView("plan", gen, signal, renderPlans);
  } else if (tab === "gpus") {
    if (key !== "gpus:analytic" && page.tabDone["gpus:analytic"]) return;
    searchView("rank", gen, signal, renderRank);
  }
}

// the searches screen with the analytic method; a model without one (CNN, UNet) is traced
function searchMethod() { return page.noFormula ? page.state.method : "analytic"; }

function searchView(kind, gen, signal, draw) {
  const box = document.getElementById(kind === "rank" ? "gpus-view" : kind === "plan" ? "plans" : "fit");
  if (kind !== "rank" && !page.state.gpu) { box.innerHTML = `<p class="muted">Choose a GPU to search what fits on it.</p>`; return; }
  box.innerHTML = `<p class="muted busy">searching (${searchMethod()})…</p>`;
  getJSON(`/api/${kind}?${query({ method: searchMethod() })}`, signal).then(({ status, body }) => {
    if (gen !== page.gen || status === 409) return;
    if (status !== 200) { box.innerHTML = `<p class="error">${esc(body.error || "error")}</p>`; return; }
    draw(box, body);
  }).catch(ignoreAbort);
}

function renderFit(box, f) {
  const rows = [f.boundary.batch, f.boundary.seq].filter(Boolean).map((b) =>
    `<tr><td class="l">${b.axis}</td><td>${b.value.toLocaleString("en-US")}</td><td>${b.at ? gib1(b.at.device_used) : "–"}</td>` +
    `<td>${b.above ? (b.value + b.step).toLocaleString("en-US") : "–"}</td><td>${b.above ? gib1(b.above.device_used) : "–"}</td><td class="l">${esc(b.limited_by)}</td>` +
    `<td><button type="button" class="apply" data-set="${b.axis}=${b.value}">apply ${b.axis} ${b.value}</button></td></tr>`).join("");
  box.innerHTML = `<p>On <b>${f.num_gpus}× ${esc(f.gpu_name)}</b> (usable ${gib(f.usable)} GiB per GPU): largest batch <b id="fit-max-batch">${f.max_batch}</b>` +
    (f.max_seq != null ? `, longest sequence <b id="fit-max-seq">${f.max_seq.toLocaleString("en-US")}</b>` : "") +
    ` — ${f.evaluations.total} evaluations (${f.evaluations.traces} traces), method ${esc(f.method)}.</p>` +
    `<table><tr><th class="l">axis</th><th>largest that fits</th><th>GiB there</th><th>next step</th><th>GiB there</th><th class="l">limited by</th><th></th></tr>${rows}</table>` +
    `<p class="small">Same as <code>${esc(cliLine("fit", searchMethod()))}</code></p>`;
}

function plansTable(plans, withGpu, view) {
  const head = `<tr><th>#</th>${withGpu ? '<th class="l">offer</th>' : ""}<th class="l">plan</th><th>GPUs</th><th>GiB/GPU</th><th>step time</th><th>tokens/s</th><th>$/h</th><th>$/M tok</th><th></th><th class="l">config</th></tr>`;
  const rows = plans.map(({ p, offer }, i) => {
    const base = `${query({ method: searchMethod() })}&view=${view}&pick=${i + 1}`;
    const dl = p.workload.task === "train" ? ["deepspeed", "accelerate", "fsdp"].map((f) =>
      `<a class="btn" href="/api/download/emit?${base}&fmt=${f}" download>${f}</a>`).join(" ") : "";
    return `<tr><td>${i + 1}</td>${withGpu ? `<td class="l">${esc(offer)}</td>` : ""}<td class="l">${esc(p.label)}</td><td>${p.num_gpus}</td><td>${gib1(p.memory)}</td>` +
      `<td>${secs(p.step_time)}</td><td>${p.tokens_per_s >= 10 ? Math.round(p.tokens_per_s).toLocaleString("en-US") : p.tokens_per_s.toFixed(2)}</td>` +
      `<td>${usd(p.usd_per_hour)}</td><td>${usd(p.usd_per_mtok)}</td>` +
      `<td><button type="button" class="apply" data-plan="${i}">apply</button></td><td class="l">${dl}</td></tr>`;
  }).join("");
  return `<table class="plans">${head}${rows}</table>`;
}

function renderPlans(box, r) {
  page.plans = r.plans;
  const b = r.baseline;
  box.innerHTML = `<p>As given: ${esc(b.label)} — ${gib1(b.memory)} GiB per GPU, ${b.fits ? "fits" : "does not fit"}. ` +
    `Pareto front: <b>${r.plans.length}</b> plan(s) of ${r.candidates} candidates, sorted by ${esc(r.sort)}.</p>` +
    `<div id="front" class="chart"></div>` +
    plansTable(r.plans.map((p) => ({ p })), false, "plan") +
    `<p class="small">Same as <code>${esc(cliLine("plan", searchMethod()))}</code></p>`;
  box.querySelectorAll("button[data-plan]").forEach((btn) => btn.addEventListener("click", () => applyWorkload(r.plans[+btn.dataset.plan].workload, null)));
  if (r.plans.length) box.querySelector("#front").replaceChildren(frontChart(r));
}

// the Pareto front: memory per GPU against step time; a point is one click to apply
function frontChart(r) {
  const W = 900, H = 240, L = 58, R = 16, T = 16, B = 36;
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "plans: memory per GPU against step time" });
  const ts = r.plans.map((p) => p.step_time), ms = r.plans.map((p) => p.memory);
  const usable = r.plans[0].usable;
  const t0 = Math.min(...ts) * 0.9, t1 = Math.max(...ts) * 1.1;
  const ymax = Math.max(usable, ...ms) * 1.1;
  const lg = (t) => Math.log(t);
  const X = (t) => L + ((lg(t) - lg(t0)) / ((lg(t1) - lg(t0)) || 1)) * (W - L - R);
  const Y = (b) => T + (1 - b / ymax) * (H - T - B);
  const step = niceStep(ymax / GiB / 4);
  for (let k = 0; k * step * GiB <= ymax; k++) {
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: Y(k * step * GiB), y2: Y(k * step * GiB), stroke: "#eee" }));
    svg.appendChild(el("text", { x: L - 6, y: Y(k * step * GiB) + 4, "font-size": 11, "text-anchor": "end" }, +(k * step).toFixed(2)));
  }
  svg.appendChild(el("line", { x1: L, x2: W - R, y1: Y(usable), y2: Y(usable), stroke: "#C00000", "stroke-dasharray": "6 3" }));
  svg.appendChild(el("text", { x: W - R - 4, y: Y(usable) - 4, "font-size": 11, fill: "#C00000", "text-anchor": "end" }, `usable ${gib(usable)} GiB per GPU`));
  r.plans.forEach((p, i) => {
    const g = el("g", { class: "point", "data-plan": i, style: "cursor:pointer" });
    g.appendChild(el("circle", { cx: X(p.step_time), cy: Y(p.memory), r: 6, fill: "#4E79A7", stroke: "#fff" }));
    g.appendChild(el("text", { x: X(p.step_time) + 8, y: Y(p.memory) - 6, "font-size": 11 }, String(i + 1)));
    g.appendChild(el("title", {}, `${i + 1}. ${p.label}: ${gib1(p.memory)} GiB per GPU, ${secs(p.step_time)} per step — click to apply`));
    g.addEventListener("click", () => applyWorkload(p.workload, null));
    svg.appendChild(g);
  });
  svg.appendChild(el("text", { x: (L + W - R) / 2, y: H - 6, "font-size": 11, "text-anchor": "middle", fill: "#555" }, "step time (log scale) — each point a plan of the front; click to apply"));
  svg.appendChild(el("text", { x: 12, y: T + (H - T - B) / 2, "font-size": 11, transform: `rotate(-90 12 ${T + (H - T - B) / 2})`, "text-anchor": "middle" }, "GiB per GPU"));
  return svg;
}

function renderRank(box, r) {
  const top = r.ranked.slice(0, 25);
  box.innerHTML = `<p><b>${r.ranked.length}</b> offer(s) on which it fits, best first by ${esc(r.sort)}; ${r.not_fitting.length} do not fit.</p>` +
    plansTable(top.map((o) => ({ p: o, offer: `${o.offer} (${o.count}× ${o.gpu})` })), true, "rank") +
    `<p class="small">Same as <code>${esc(cliLine("plan", searchMethod(), `--rank-gpus --gpus ${page.state.gpus || 1}`))}</code>; prices are on-demand list prices (see the JSON for sources).</p>`;
  box.querySelectorAll("button[data-plan]").forEach((btn) => btn.addEventListener("click", () => {
    const o = top[+btn.dataset.plan];
    applyWorkload(o.workload, o.gpu);
  }));
}

function applyWorkload(w, gpu) {
  for (const f of page.fields) {
    let v = f.parallel ? w.parallel[f.key.replace(/-/g, "_")] : w[f.key.replace(/-/g, "_")];
    if (v === undefined) continue;
    if (Array.isArray(v)) v = v.join(",");
    if (typeof v === "boolean") v = v ? "1" : "";
    page.state[f.key] = String(v);
  }
  if (gpu) page.state.gpu = gpu;
  fillForm();
  refresh();
}

// ------------------------------------------------------------------ form
function buildForm() {
  const groups = { main: document.getElementById("workload"), more: document.getElementById("workload-more"), parallel: document.getElementById("workload-parallel") };
  for (const f of page.fields) {
    const g = f.parallel ? groups.parallel : MAIN.includes(f.key) ? groups.main : groups.more;
    const row = document.createElement("label");
    row.className = "row";
    row.htmlFor = f.key;
    row.title = f.doc;
    let input;
    if (f.kind === "enum") {
      input = document.createElement("select");
      for (const c of f.choices) { const o = document.createElement("option"); o.value = c; o.textContent = c; input.appendChild(o); }
    } else {
      input = document.createElement("input");
      if (f.kind === "bool") input.type = "checkbox";
      else if (f.kind === "int") { input.type = "number"; input.step = "1"; }
      else if (f.kind === "float") { input.type = "number"; input.step = "0.05"; }
      else input.type = "text";
    }
    input.id = f.key;
    input.name = f.key;
    const span = document.createElement("span");
    span.textContent = f.key;
    row.append(span, input);
    const err = document.createElement("div");
    err.className = "err";
    err.id = `err-${f.key}`;
    g.append(row, err);
  }
  const dl = document.getElementById("models");
  for (const m of page.catalog.models) {
    const o = document.createElement("option");
    o.value = m.alias;
    o.label = `${m.family} · ${(m.params / 1e9).toFixed(2)} B · ${m.hub_id}`;
    dl.appendChild(o);
  }
  const gsel = document.getElementById("gpu");
  for (const g of page.catalog.gpus) {
    const o = document.createElement("option");
    o.value = g.key;
    o.textContent = `${g.key} — ${(g.capacity / GiB).toFixed(0)} GiB`;
    o.title = g.name;
    gsel.appendChild(o);
  }
}

function fillForm() {
  for (const input of document.querySelectorAll("#form input, #form select")) {
    const k = input.name;
    if (!k) continue;
    const f = page.fields.find((x) => x.key === k);
    let v = page.state[k];
    if (v == null) v = recipeDefaults()[k] ?? (f ? f.default : "");
    if (input.type === "checkbox") input.checked = truthy(v);
    else if (input.type !== "file") input.value = v;
  }
  if (page.state.config) {
    document.getElementById("config-info").textContent = `using the dropped ${page.state.model} (choose a catalog model to go back)`;
  }
}

let debounce = null;
function onInput(e) {
  const input = e.target;
  if (!input.name || input.type === "file") return;
  const v = input.type === "checkbox" ? (input.checked ? "1" : "0") : input.value; // "0": off, sent when a recipe has it on
  if (input.name === "model") {
    if (e.type === "input" && !page.catalog.models.some((m) => m.alias === v)) return; // still typing
    delete page.state.config;
    document.getElementById("config-info").textContent = "";
  }
  if (input.name === "recipe" || input.name === "peft") {
    // the old recipe's defaults the user kept give way to the new ones (shown in the form)
    const before = recipeDefaults();
    const after = recipeDefaults({ ...page.state, [input.name]: v });
    for (const k of new Set([...Object.keys(before), ...Object.keys(after)])) {
      const cur = page.state[k];
      if (cur == null || String(cur) === String(before[k] ?? "") || (before[k] === "" && !truthy(cur))) delete page.state[k];
    }
    page.state[input.name] = v;
    fillForm();
  }
  page.state[input.name] = v;
  clearTimeout(debounce);
  debounce = setTimeout(refresh, e.type === "change" ? 0 : 150);
}

async function uploadConfig(file) {
  clearErrors();
  if (file.size > 256 * 1024) { showError({ error: `${file.name} is ${file.size.toLocaleString("en-US")} bytes; the page accepts up to 262,144`, field: "config" }); return; }
  const text = await file.text();
  const r = await fetch(`/api/config?name=${encodeURIComponent(file.name)}`, { method: "POST", body: text, headers: { "Content-Type": "application/json" } });
  const body = await r.json();
  if (r.status !== 200) { showError(body); return; }
  page.state.config = body.config;
  page.state.model = body.name;
  document.getElementById("model").value = "";
  document.getElementById("config-info").textContent = `using ${body.name}: ${body.model_type}, ${body.family}, ${(body.params / 1e6).toFixed(1)} M params`;
  refresh();
}

function updateLinks() {
  document.getElementById("dl-report").href = `/api/download/report?${query({ method: page.state.method === "analytic" ? "analytic" : page.state.method })}`;
  document.getElementById("dl-snapshot").href = `/api/download/snapshot?${query({ method: "trace" })}`;
}

function init() {
  // The server puts the page's defaults, the catalog and the analytic answer for this URL
  // into the page (no round trip before the first answer); /api/catalog serves the same.
  const boot = JSON.parse(document.getElementById("boot").textContent || "{}");
  Object.assign(DEFAULTS, boot.defaults || {});
  page.state = readUrl();
  page.catalog = boot.catalog;
  page.fields = boot.catalog.fields;
  page.legend = boot.catalog.legend;
  selectTab(page.state.tab || "timeline");
  refresh(boot.first);
  // the form is built after the first answer's frame: the answer does not wait for it
  requestAnimationFrame(() => setTimeout(() => {
    buildForm();
    fillForm();
    if (page.lastError) { clearErrors(); showError(page.lastError); }
    const form = document.getElementById("form");
    form.addEventListener("input", onInput);
    form.addEventListener("change", onInput);
  }, 0));
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  document.querySelectorAll("[data-goto]").forEach((a) => a.addEventListener("click", (e) => { e.preventDefault(); showTab(a.dataset.goto); }));
  document.getElementById("results").addEventListener("click", (e) => {
    const b = e.target.closest("button[data-set]");
    if (!b) return;
    const [k, v] = b.dataset.set.split("=");
    page.state[k] = v;
    fillForm();
    refresh();
  });
  const drop = document.getElementById("drop");
  const file = document.getElementById("config-file");
  file.addEventListener("change", () => { if (file.files[0]) uploadConfig(file.files[0]); file.value = ""; });
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => { e.preventDefault(); drop.classList.remove("over"); if (e.dataTransfer.files[0]) uploadConfig(e.dataTransfer.files[0]); });
  document.getElementById("copy-link").addEventListener("click", (e) => {
    e.preventDefault();
    if (navigator.clipboard) navigator.clipboard.writeText(location.href);
  });
}

document.addEventListener("DOMContentLoaded", init);
