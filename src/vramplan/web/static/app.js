// vramplan's local page. Plain JavaScript, no build step, no network beyond this server.
// The page state is the query string; every figure comes from the same JSON as the CLI's --json.
"use strict";

const GiB = 2 ** 30;
const MAIN = ["task", "batch", "seq", "new-tokens", "grad-accum", "precision", "optimizer", "checkpointing",
  "checkpoint-fraction", "peft", "quant", "recipe"];
const PAGE_KEYS = ["model", "config", "gpu", "method", "tab", "gpus", "budget", "allow-peft", "sort", "job"];
// The job views: each shows its own inputs beside the main ones, sets what makes the job (an
// objective, images) and, when the model in the form cannot run it, a catalog model that can.
const JOBS = {
  lm: { label: "language model: train, fine-tune, infer, generate", keys: [], set: {} },
  preference: { label: "preference tuning (DPO, KTO)", keys: ["objective", "reference"],
    set: { objective: "dpo", task: "train" } },
  rl: { label: "RL: GRPO (rollout, then the policy step)",
    keys: ["objective", "prompt", "generations", "rollout", "vllm-memory", "vllm-max-len", "vllm-sleep", "reference"],
    set: { objective: "grpo", task: "train" }, prompt: true }, // + a prompt: half the sequence, the rest completion
  vlm: { label: "vision-language (images in the sequence)", keys: ["images", "image-size", "image-height", "videos", "video-frames", "freeze-vision"],
    set: { images: "1" }, model: "qwen2.5-vl-7b" },
  diffusion: { label: "diffusion denoiser (one step at an image or video size)", keys: ["image-size", "image-height", "frames"],
    set: {}, model: "flux1-dev-transformer" },
};
const SERVE_KEYS = ["serve-engine", "memory-fraction", "max-model-len", "max-num-seqs", "avg-request-len", "kv-cache-dtype", "quantization",
  "spec-method", "spec-tokens", "limit-images", "limit-videos", "engine-version", "kv-offloading-size"];
const SLIDERS = { batch: [0, 10], seq: [7, 17] }; // log2 ranges: batch 1–1,024, seq 128–131,072
const DEFAULTS = { tab: "timeline" }; // + model, gpu, method: the server's (boot.defaults)
const SVGNS = "http://www.w3.org/2000/svg";

const page = {
  state: {}, snap: {}, lastKey: null, catalog: null, fields: [], legend: null, gen: 0, controller: null,
  report: null, reportMethod: null, tabDone: {}, draw: {},
};
window.__vramplan = { firstAnalyticMs: null, renders: 0, traces: 0, refreshes: 0 };

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

function isDefault(key, value, state = page.state) {
  if (key in DEFAULTS) return false; // always written: a link names its model and GPU
  const f = page.fields.find((x) => x.key === key);
  if (!f) return value === "" || value == null;
  const rd = recipeDefaults(state)[key]; // a recipe's default: only a different value is sent
  if (rd !== undefined) return f.kind === "bool" ? truthy(value) === truthy(rd) : String(rd) === String(value);
  if (f.kind === "bool") return !truthy(value);
  return String(f.default) === String(value);
}

function truthy(v) { return ["1", "true", "on", "yes"].includes(String(v).toLowerCase()); }

// The query string of a state (by default the one the figures on screen answer: page.snap).
// The serving view's keys go to the serving view only.
function query(extra = {}, state = page.snap, serve = false) {
  const p = new URLSearchParams();
  const s = { ...state, ...extra };
  for (const [k, v] of Object.entries(s)) {
    if (v === "" || v == null || k === "tab") continue;
    if (!serve && SERVE_KEYS.includes(k)) continue;
    if (k !== "method" && isDefault(k, v, state)) continue;
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

// What the figures answer: the inputs' query (without the view-only keys). An input left
// unchanged (a blur after typing, a slider let go where it was) asks nothing again.
function stateKey(state = page.state) { return query({ method: state.method }, state); }

function refresh(preloaded) {
  const key = stateKey();
  if (!preloaded && key === page.lastKey) { writeUrl(); return; }
  page.lastKey = key;
  page.snap = { ...page.state }; // every request of this generation asks for these inputs, whatever is typed meanwhile
  page.gen += 1;
  window.__vramplan.refreshes += 1;
  const gen = page.gen;
  if (page.controller) page.controller.abort(); // the server cancels the work for the old inputs
  page.controller = new AbortController();
  const signal = page.controller.signal;
  page.tabDone = {};
  page.traceError = null;
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
    const noFormula = status === 400 && body.field === "method" && page.snap.method !== "analytic";
    page.noFormula = noFormula;
    if (status !== 200 && !noFormula) { page.lastError = body; showError(body); markStale(true); setStatus("", false); return; }
    page.lastError = null;
    if (status === 200) {
      render(body, "analytic");
      // measured when the frame that shows the answer is about to be painted (not when the JS ran)
      if (window.__vramplan.firstAnalyticMs === null) {
        requestAnimationFrame(() => { if (window.__vramplan.firstAnalyticMs === null) window.__vramplan.firstAnalyticMs = performance.now(); });
      }
      loadTab(gen, signal);
      if (page.snap.method === "analytic") { setStatus("analytic", false); return; }
    } else {
      markStale(true, `${body.error}: tracing the model instead…`);
    }
    setStatus("tracing…", true);
    getJSON(`/api/estimate?${query({ method: page.snap.method })}`, signal).then(({ status: st, body: b }) => {
      if (gen !== page.gen || st === 409) return;
      if (st !== 200) {
        if (status === 200) { // the analytic figures of these very inputs stay, and say so
          page.traceError = b;
          showError(b, null, true);
          markTraceFailed(b.error);
          setStatus("trace failed", false);
        } else { showError(b); markStale(true); setStatus("trace failed", false); }
        return;
      }
      window.__vramplan.traces += 1;
      render(b, b.method, page.snap.method);
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

// A message beside the field it is about (opening its section), else in `where` or the banner.
// `quiet`: mark the field without opening the banner when there is no field.
function showError(body, where, quiet) {
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
  if (quiet) return;
  const target = where || document.getElementById("error");
  target.hidden = false;
  target.textContent = msg;
}

// ------------------------------------------------------------------ formatting
const gib = (n) => (n / GiB).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
const gib1 = (n) => (n / GiB).toLocaleString("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
const usd = (x, d = 2) => (x == null ? "–" : x.toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d }));
const num = (n) => Number(n).toLocaleString("en-US");
function secs(s) { return s >= 100 ? `${Math.round(s)} s` : s >= 1 ? `${+s.toFixed(2)} s` : s >= 1e-3 ? `${+(s * 1e3).toFixed(1)} ms` : `${+(s * 1e6).toFixed(0)} µs`; }
// a long name (module path, tensor shape) may break after its dots, underscores and commas only
function brk(s) { return { html: esc(s).replace(/([._,/])/g, "$1<wbr>") }; }
function esc(s) { return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c])); }
function color(k) { return (page.legend && page.legend.colors[k]) || "#BAB0AC"; }
function label(k) { return (page.legend && page.legend.labels[k]) || k; }

// ------------------------------------------------------------------ main view
function markStale(on, text) {
  // a bad input never leaves the last answer looking current
  document.getElementById("results").classList.toggle("stale", on);
  document.getElementById("headline").classList.toggle("stale", on);
  const note = document.getElementById("stale");
  note.hidden = !on || (!page.report && !text);
  note.className = "note stale";
  note.textContent = text || "These figures are for the last valid inputs: fix the input marked in red.";
}

function markTraceFailed(msg) {
  document.getElementById("results").classList.remove("stale");
  document.getElementById("headline").classList.remove("stale");
  const note = document.getElementById("stale");
  note.hidden = false;
  note.className = "note";
  note.textContent = `The trace failed: ${msg} — the figures are the analytic estimate of these inputs.`;
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
    el.innerHTML = `${gib(bytes)} <small class="unit">GiB</small>`;
    el.classList.toggle("long", gib(bytes).length > 8); // (a smaller font on a phone: no number broken in two)
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
    room.textContent = r.refused ? "refused at start-up" :
      r.headroom >= 0 ? `${gib(r.headroom)} GiB headroom` : `${gib(-r.headroom)} GiB short`;
    v.appendChild(room);
  } else { v.textContent = "no GPU chosen"; delete v.dataset.fits; }
  const w = r.workload;
  // no seq given and the default longer than the model's positions: the server (as the CLI) took the model's
  const seqField = page.fields.find((f) => f.key === "seq");
  const ownSeq = (page.snap.seq == null || page.snap.seq === "") && seqField && w.seq < seqField.default;
  const effective = ownSeq ? { seq: String(w.seq) } : {};
  if (JSON.stringify(effective) !== JSON.stringify(page.effective || {})) { page.effective = effective; fillFormSoon(); }
  let sum = `<b>${esc(r.model)}</b> · ${(r.params / 1e9).toFixed(3)} B params · ${esc(w.task)}, batch ${w.batch}, seq ${num(w.seq)}` +
    (ownSeq ? ` <span class="muted" id="seq-note">(the model's length: the default ${num(seqField.default)} exceeds it)</span>` : "") + `, ${esc(w.precision)}` +
    ` · peak in <b>${esc(r.peak_phase)}</b> · method <b id="method-used">${esc(r.method)}</b>`;
  if (r.gpu) {
    const room = r.headroom >= 0 ? `${gib(r.headroom)} GiB headroom` : `${gib(-r.headroom)} GiB short`;
    sum += `<br>${esc(r.gpu.full_name)}: ${gib(r.gpu.capacity)} GiB, usable ${gib(r.gpu.usable)} GiB — ${room}` +
      (r.max_batch != null ? ` · largest batch that fits: <b id="max-batch" data-value="${r.max_batch}">${r.max_batch >= 1 ? r.max_batch : "none"}</b>` : "") +
      (r.refused ? `<br><b id="refused">refused at start-up:</b> ${esc(r.refused)}` : "");
  }
  document.getElementById("summary").innerHTML = sum;
  draw("bar", (W) => barChart(r, W));
  legendRow(r);
  document.getElementById("cli").textContent = cliLine("estimate", page.asked);
  tableRows("top-modules", ["module", "peak GiB"], (r.top_modules || []).slice(0, 8).map((m) => [brk(m.module || "(root)"), gib(m.peak)]));
  tableRows("top-tensors", ["tensor", "category", "module", "MiB"], (r.top_tensors || []).slice(0, 8).map((t) =>
    [brk(`${t.dtype}[${t.shape.join(",")}]`), brk(t.category), brk(t.module || "–"), (t.nbytes / 2 ** 20).toFixed(1)]));
  const keys = ["weights", "gradients", "optimizer", "activations", "temporaries", "kv_cache"];
  tableRows("phases", ["phase", "allocated GiB", ...keys], (r.phases || []).map((p) =>
    [p.phase, gib(p.allocated), ...keys.map((k) => gib(p.breakdown[k] || 0))]));
  document.getElementById("notes").innerHTML = (r.notes || []).map((n) => `<li>${esc(n)}</li>`).join("");
}

// A table whose rows become labelled cards on a phone (each cell carries its column's name).
function tableHtml(head, rows, { left = 1, cls = "rt", foot = null, align = null } = {}) {
  const text = (c) => (c && c.html !== undefined ? c.html.replace(/<[^>]*>/g, "") : c);
  const cellCls = (c, i) => (c && c.cls !== undefined ? c.cls : align && align[i] ? (align[i] === "l" ? "l" : "") :
    i < left || (i < 3 && isNaN(parseFloat(text(c)))) ? "l" : "");
  const cell = (c, i, tag = "td") => `<${tag} class="${cellCls(c, i)}" data-label="${esc(head[i] || "")}">${c && c.html !== undefined ? c.html : esc(c == null ? "" : c)}</${tag}>`;
  return `<table class="${cls}"><tr class="head">${head.map((h, i) => `<th class="${rows.length ? cellCls(rows[0][i], i) : i < left ? "l" : ""}">${esc(h)}</th>`).join("")}</tr>` +
    rows.map((r) => `<tr>${r.map((c, i) => cell(c, i)).join("")}</tr>`).join("") +
    (foot ? `<tr class="foot">${foot.map((c, i) => cell(c, i)).join("")}</tr>` : "") + "</table>";
}

function tableRows(id, head, rows) {
  const t = document.getElementById(id);
  if (!rows.length) { t.innerHTML = `<tr><td class="l muted" data-label="">none (the analytic method does not list them; the trace does)</td></tr>`; return; }
  const tmp = document.createElement("div");
  tmp.innerHTML = tableHtml(head, rows);
  t.replaceChildren(...tmp.firstChild.childNodes);
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

// Charts are drawn at the width they are shown (1 SVG unit = 1 CSS pixel), so that their
// text is as large on a phone as on a desktop; they are drawn again when their box resizes.
function chartWidth(box) { return Math.max(280, Math.round(box.getBoundingClientRect().width || box.clientWidth || 900)); }

function draw(id, make) {
  const box = document.getElementById(id);
  if (!box) return;
  page.draw[id] = make;
  box.replaceChildren(make(chartWidth(box)));
}

let resizeTimer = null;
function redrawAll() {
  for (const [id, make] of Object.entries(page.draw)) {
    const box = document.getElementById(id);
    if (!box || !box.isConnected || !box.offsetParent) continue;
    const svg = box.querySelector("svg");
    const w = chartWidth(box);
    if (svg && Math.abs(+svg.getAttribute("width") - w) < 2) continue;
    box.replaceChildren(make(w));
  }
}

// text that stays inside the chart: anchored at its start near the left edge, its end near the right
function textAt(x, W, approx) {
  if (x - approx / 2 < 4) return { x: Math.max(x, 4), anchor: "start" };
  if (x + approx / 2 > W - 4) return { x: Math.min(x, W - 4), anchor: "end" };
  return { x, anchor: "middle" };
}

function barChart(r, W = 900) {
  const H = 100, L = 8, R = 8, top = W >= 600 ? 26 : 10, h = 34;
  const usable = r.gpu ? r.gpu.usable : 0;
  const max = Math.max(r.peak.device_used, usable) * 1.04 || 1;
  const x = (b) => L + (b / max) * (W - L - R);
  const svg = el("svg", { viewBox: `0 0 ${W} ${top + h + 34}`, width: W, role: "img", "aria-label": "breakdown at the peak against usable capacity" });
  if (usable) svg.appendChild(el("rect", { x: L, y: top, width: x(usable) - L, height: h, fill: "#f1f1f1", stroke: "#ddd" }));
  let acc = 0;
  for (const [k, b] of segments(r)) {
    const rect = el("rect", { x: x(acc), y: top, width: Math.max(x(acc + b) - x(acc), 0.5), height: h, fill: color(k), "data-key": k });
    rect.appendChild(el("title", {}, `${label(k)}: ${gib(b)} GiB`));
    svg.appendChild(rect);
    acc += b;
  }
  if (W >= 600) svg.appendChild(el("text", { x: L, y: 16, "font-size": 12 }, `allocated ${gib(r.peak.allocated)} · reserved ${gib(r.peak.reserved)} · device used ${gib(r.peak.device_used)} GiB`));
  if (usable) {
    const ux = x(usable);
    const text = `usable ${gib(usable)} GiB`;
    const t = textAt(ux, W, text.length * 7);
    svg.appendChild(el("line", { x1: ux, x2: ux, y1: top - 6, y2: top + h + 8, stroke: "#C00000", "stroke-width": 2, "stroke-dasharray": "5 3" }));
    svg.appendChild(el("text", { id: "usable-label", x: t.x, y: top + h + 24, "font-size": 12, fill: "#C00000", "text-anchor": t.anchor }, text));
  }
  svg.setAttribute("height", top + h + 34);
  return svg;
}

function legendRow(r) {
  document.getElementById("legend").innerHTML = segments(r).map(([k, b]) =>
    `<span data-key="${k}"><i style="background:${color(k)}"></i>${esc(label(k))} <b>${gib(b)}</b></span>`).join("");
}

function cliLine(cmd, method, extra = "") {
  const s = page.snap;
  const parts = ["vramplan", cmd, s.config ? "config.json" : s.model];
  for (const f of page.fields) {
    const v = s[f.key];
    if (v == null || v === "" || isDefault(f.key, v, s)) continue;
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

function serveLine() {
  const s = page.state;
  const parts = ["vramplan", "serve-plan", s.config ? "config.json" : s.model, `--gpu ${s.gpu}`];
  for (const k of ["tp", "pp"]) if (s[k] && String(s[k]) !== "1") parts.push(`--${k} ${s[k]}`);
  for (const k of SERVE_KEYS) {
    if (!s[k] || (k === "serve-engine" && s[k] === "vllm")) continue;
    parts.push(`--${k === "serve-engine" ? "engine" : k} ${s[k]}`);
  }
  parts.push("--json");
  return parts.join(" ");
}

// ------------------------------------------------------------------ timeline (same data as --plot)
function timelineChart(d, W = 900) {
  const H = W < 600 ? 280 : 340, R = 10, T = 38, B = 40;
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": d.title });
  const keys = Object.keys(d.stacked);
  const n = d.x.length;
  const totals = d.x.map((_, i) => keys.reduce((a, k) => a + d.stacked[k][i], 0));
  const lineMax = Math.max(0, ...Object.values(d.lines).flat());
  const pk = d.peak || {};
  // the chart reaches the figures shown above it: device used at the peak is drawn as a level
  const dataMax = Math.max(1, ...totals, lineMax, pk.device_used || 0);
  const levels = Object.entries(d.levels).filter(([, v]) => v <= dataMax * 2.5);
  const ymax = Math.max(dataMax, ...levels.map(([, v]) => v)) * 1.08;
  const unit = d.unit === "MiB" ? 2 ** 20 : GiB;
  const step = niceStep(ymax / unit / 5);
  const ticks = [];
  for (let t = 0; t * step * unit <= ymax; t++) ticks.push([t * step * unit, (+(t * step).toFixed(3)).toLocaleString("en-US")]);
  const L = Math.max(44, 24 + 7 * Math.max(...ticks.map(([, s]) => s.length))); // room for the longest label
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
      const text = rec ? `${g} + recompute` : g;
      if (X(b) - X(a) > text.length * 6.5) svg.appendChild(el("text", { x: (X(a) + X(b)) / 2, y: T - 4, "font-size": 11, "text-anchor": "middle", fill: "#555" }, text));
    }
  }
  for (const [a, b, name] of d.spans) {
    if (!phases) {
      const fill = SHADES[name];
      if (fill) svg.appendChild(el("rect", { x: X(a), y: T, width: Math.max(X(b) - X(a), 0.5), height: H - T - B, fill, "data-shade": name }));
    } else {
      svg.appendChild(el("text", { x: X((a + b) / 2), y: H - B + 16, "font-size": 12, "text-anchor": "middle" }, name));
    }
  }
  for (const [b, text] of ticks) {
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: Y(b), y2: Y(b), stroke: "#eee" }));
    svg.appendChild(el("text", { x: L - 6, y: Y(b) + 4, "font-size": 11, "text-anchor": "end" }, text));
  }
  svg.appendChild(el("text", { x: 12, y: T + (H - T - B) / 2, "font-size": 11, transform: `rotate(-90 12 ${T + (H - T - B) / 2})`, "text-anchor": "middle" }, d.unit));
  const base = new Array(n).fill(0);
  for (const k of keys) {
    const col = d.stacked[k];
    if (phases) {
      for (let i = 0; i < n; i++) {
        if (!col[i]) continue;
        const r = el("rect", { x: X(i - 0.3), y: Y(base[i] + col[i]), width: X(i + 0.3) - X(i - 0.3), height: Y(base[i]) - Y(base[i] + col[i]), fill: color(k), "data-key": k });
        r.appendChild(el("title", {}, `${label(k)}: ${gib(col[i])} GiB`));
        svg.appendChild(r);
        base[i] += col[i];
      }
    } else {
      const up = [], down = [];
      for (let i = 0; i < n; i++) { up.push(`${X(d.x[i]).toFixed(1)},${Y(base[i] + col[i]).toFixed(1)}`); down.push(`${X(d.x[i]).toFixed(1)},${Y(base[i]).toFixed(1)}`); }
      const poly = el("polygon", { points: up.concat(down.reverse()).join(" "), fill: color(k), stroke: "none", "data-key": k });
      poly.appendChild(el("title", {}, label(k)));
      svg.appendChild(poly);
      for (let i = 0; i < n; i++) base[i] += col[i];
    }
  }
  for (const [name, vals] of Object.entries(d.lines)) {
    svg.appendChild(el("polyline", { points: vals.map((b, i) => `${X(d.x[i]).toFixed(1)},${Y(b).toFixed(1)}`).join(" "), fill: "none", stroke: "#333", "stroke-width": 1.2, "stroke-dasharray": "4 2", "data-line": name }));
  }
  const off = Object.entries(d.levels).filter(([, v]) => v > dataMax * 2.5);
  off.forEach(([name, v], i) => svg.appendChild(el("text", { x: W - R - 4, y: T + 14 + 14 * i, "font-size": 11, fill: "#C00000", "text-anchor": "end" },
    `${name} ${gib(v)} GiB (off the scale)`)));
  for (const [name, v] of levels) {
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), stroke: "#C00000", "stroke-dasharray": "6 3", "stroke-width": 1.5 }));
    svg.appendChild(el("text", { x: L + 4, y: Y(v) - 4, "font-size": 11, fill: "#C00000" }, `${W < 600 ? name.replace(/^.* usable$/, "usable") : name} ${gib(v)} GiB`));
  }
  // the peak, marked as --plot marks it: where it is, and the figures above the chart
  if (pk.device_used) {
    const yd = Y(pk.device_used);
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: yd, y2: yd, stroke: "#333", "stroke-width": 1, "stroke-dasharray": "2 3", "data-level": "device_used" }));
    svg.appendChild(el("text", { x: W - R - 4, y: yd - 4, "font-size": 11, "text-anchor": "end", fill: "#333" }, `device used ${gib(pk.device_used)} GiB`));
  }
  let px = null;
  if (!phases && pk.x != null) px = X(pk.x);
  else if (phases) { const i = d.spans.findIndex((s) => s[2] === pk.phase); if (i >= 0) px = X(i); }
  if (px != null && pk.allocated != null) {
    // a line through the whole height (the peak of a trace is a spike a pixel wide) and a label above the plot
    const top = pk.allocated + (pk.overhead || 0);
    const g = el("g", { id: "peak-marker" });
    if (!phases) g.appendChild(el("line", { x1: px, x2: px, y1: T - 12, y2: H - B, stroke: "#000", "stroke-width": 1.5 }));
    g.appendChild(el("path", { d: `M${px - 6},${Y(top) - 10} L${px + 6},${Y(top) - 10} L${px},${Y(top) - 1} Z`, fill: "#000" }));
    const text = `peak ${gib(pk.allocated)} GiB allocated (${pk.phase})`;
    const t = textAt(px, W, text.length * 6.2);
    g.appendChild(el("text", { x: t.x, y: T - 24, "font-size": 11, "font-weight": 600, "text-anchor": t.anchor }, text));
    g.appendChild(el("title", {}, `peak: ${gib(pk.allocated)} GiB allocated, ${gib(pk.reserved)} reserved, ${gib(pk.device_used)} device used (${pk.phase})`));
    svg.appendChild(g);
  }
  svg.appendChild(el("text", { x: (L + W - R) / 2, y: H - 6, "font-size": 11, "text-anchor": "middle", fill: "#555" }, phases ? "phase (analytic: one bar per phase)" : d.x_label));
  return svg;
}

const SHADES = { backward: "#0000000d", recompute: "#0000000d", optimizer: "#4E79A71f" };

// every colour and line of the timeline, named
function timelineLegend(d) {
  const items = Object.keys(d.stacked).filter((k) => d.stacked[k].some((v) => v > 0)).map((k) => `<span data-key="${k}"><i style="background:${color(k)}"></i>${esc(label(k))}</span>`);
  const names = new Set(d.spans.map((s) => s[2]));
  if (d.kind !== "phases") {
    if (names.has("backward") || names.has("recompute")) items.push(`<span data-shade="backward"><i style="background:${SHADES.backward}"></i>backward${names.has("recompute") ? " + recompute" : ""} (shaded)</span>`);
    if (names.has("optimizer")) items.push(`<span data-shade="optimizer"><i style="background:${SHADES.optimizer}"></i>optimizer step (shaded)</span>`);
  }
  for (const name of Object.keys(d.lines)) items.push(`<span data-line="${esc(name)}"><i class="line"></i>${esc(name)}</span>`);
  if (Object.keys(d.levels).length) items.push(`<span data-level="usable"><i class="line red"></i>usable capacity</span>`);
  if (d.peak && d.peak.device_used) items.push(`<span data-level="device_used"><i class="line" style="border-top-style:dotted"></i>device used at the peak</span>`);
  if (d.peak) items.push(`<span data-peak><i class="peak"></i>peak</span>`);
  document.getElementById("timeline-legend").innerHTML = items.join("");
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
  requestAnimationFrame(redrawAll);
}

function loadTab(gen, signal) {
  const tab = page.state.tab || "timeline";
  const method = page.reportMethod || "analytic";
  const key = `${tab}:${method}`;
  if (page.tabDone[key]) return;
  page.tabDone[key] = true;
  if (tab === "timeline") {
    getJSON(`/api/timeline?${query({ method: method === "analytic" ? "analytic" : page.snap.method })}`, signal).then(({ status, body }) => {
      if (gen !== page.gen) return;
      const box = document.getElementById("timeline");
      if (status !== 200) { delete page.draw.timeline; box.textContent = body.error || "no timeline"; document.getElementById("timeline-legend").innerHTML = ""; return; }
      draw("timeline", (W) => timelineChart(body, W));
      timelineLegend(body);
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
  } else if (tab === "serve") {
    if (key !== "serve:analytic" && page.tabDone["serve:analytic"]) return;
    serveView();
  }
}

// the searches screen with the analytic method; a model without one (CNN, UNet) is traced
function searchMethod() { return page.noFormula ? page.snap.method : "analytic"; }

function searchView(kind, gen, signal, render) {
  const box = document.getElementById(kind === "rank" ? "gpus-view" : kind === "plan" ? "plans" : "fit");
  if (kind !== "rank" && !page.snap.gpu) { box.innerHTML = `<p class="muted">Choose a GPU to search what fits on it.</p>`; return; }
  box.innerHTML = `<p class="muted busy">searching (${searchMethod()})…</p>`;
  getJSON(`/api/${kind}?${query({ method: searchMethod() })}`, signal).then(({ status, body }) => {
    if (gen !== page.gen || status === 409) return;
    if (status !== 200) { // also beside its field (a Plan search option, say)
      box.innerHTML = `<p class="error">${esc(body.error || "error")}</p>`;
      if (body.field) showError(body, null, true);
      return;
    }
    render(box, body);
  }).catch(ignoreAbort);
}

function renderFit(box, f) {
  const rows = [f.boundary.batch, f.boundary.seq].filter(Boolean).map((b) => {
    const other = b.axis === "batch" ? "seq" : "batch";
    if (b.value < 1) { // nothing fits along this axis with the other one held where it is: nothing to apply
      return [b.axis, { html: `<span class="nofit">none fits at ${other} ${num(b.fixed)}</span>` }, "–",
        b.above ? num(b.value + b.step) : "–", b.above ? gib1(b.above.device_used) : "–", b.limited_by, ""];
    }
    return [b.axis, num(b.value), b.at ? gib1(b.at.device_used) : "–", b.above ? num(b.value + b.step) : "–",
      b.above ? gib1(b.above.device_used) : "–", b.limited_by,
      { html: `<button type="button" class="apply" data-set="${b.axis}=${b.value}">apply ${b.axis} ${num(b.value)}</button>` }];
  });
  const most = f.max_batch >= 1 ? `largest batch <b id="fit-max-batch">${f.max_batch}</b>` :
    `<span id="fit-max-batch" data-value="0">no batch fits at seq ${num(f.workload.seq)}</span>`;
  box.innerHTML = `<p>On <b>${f.num_gpus}× ${esc(f.gpu_name)}</b> (usable ${gib(f.usable)} GiB per GPU): ${most}` +
    (f.max_seq != null ? (f.max_seq >= 1 ? `, longest sequence <b id="fit-max-seq">${num(f.max_seq)}</b>` : `, no sequence fits at batch ${num(f.workload.batch)}`) : "") +
    ` — ${f.evaluations.total} evaluations (${f.evaluations.traces} traces), method ${esc(f.method)}.</p>` +
    (f.suggestion ? `<p class="note">${esc(f.suggestion)}</p>` : "") +
    tableHtml(["axis", "largest that fits", "GiB there", "next step", "GiB there", "limited by", ""], rows) +
    `<p class="small">Same as <code>${esc(cliLine("fit", searchMethod()))}</code></p>`;
}

function emitLinks(base, task) {
  const formats = (page.catalog.emit_formats || []).filter((f) => task === "train" || f === "alloc-conf");
  return formats.map((f) => `<a class="btn" href="/api/download/emit?${base}&fmt=${f}" download data-fmt="${f}">${f}</a>`).join(" ");
}

function plansTable(plans, withGpu, view) {
  const head = ["#", ...(withGpu ? ["offer"] : []), "plan", "GPUs", "GiB/GPU", "step time", "tokens/s", "$/h", "$/M tok", "", "config"];
  const rows = plans.map(({ p, offer }, i) => {
    const base = `${query({ method: searchMethod() })}&view=${view}&pick=${i + 1}`;
    return [String(i + 1), ...(withGpu ? [offer] : []), p.label, String(p.num_gpus), gib1(p.memory), secs(p.step_time),
      p.tokens_per_s >= 10 ? Math.round(p.tokens_per_s).toLocaleString("en-US") : p.tokens_per_s.toFixed(2),
      usd(p.usd_per_hour), usd(p.usd_per_mtok),
      { html: `<button type="button" class="apply" data-plan="${i}">apply</button>` },
      { html: emitLinks(base, p.workload.task), cls: "l configs" }];
  });
  return tableHtml(head, rows, { left: withGpu ? 3 : 2, cls: "rt plans" });
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
  if (r.plans.length) draw("front", (W) => frontChart(r, W));
}

// ticks of a log axis: 1, 2, 5 × 10^k within [t0, t1] (at least the two ends)
function logTicks(t0, t1) {
  const out = [];
  for (let e = Math.floor(Math.log10(t0)); e <= Math.ceil(Math.log10(t1)); e++) {
    for (const m of [1, 2, 5]) { const v = m * 10 ** e; if (v >= t0 && v <= t1) out.push(v); }
  }
  if (out.length < 2) return [t0, t1];
  return out;
}

// the Pareto front: memory per GPU against step time; a point is one click to apply
function frontChart(r, W = 900) {
  const H = 240, L = 50, R = 16, T = 16, B = 44;
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": "plans: memory per GPU against step time" });
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
  const ticks = logTicks(t0, t1);
  const every = Math.max(1, Math.ceil(ticks.length / Math.max(2, Math.floor((W - L - R) / 60))));
  ticks.forEach((t, i) => {
    svg.appendChild(el("line", { x1: X(t), x2: X(t), y1: T, y2: H - B, stroke: "#f3f3f3" }));
    if (i % every === 0) svg.appendChild(el("text", { class: "xtick", x: X(t), y: H - B + 14, "font-size": 11, "text-anchor": "middle", "data-seconds": t }, secs(t)));
  });
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
  svg.appendChild(el("text", { x: (L + W - R) / 2, y: H - 6, "font-size": 11, "text-anchor": "middle", fill: "#555" },
    W < 600 ? "step time (log scale); click a plan to apply" : "step time per optimizer step (log scale) — each point a plan of the front; click to apply"));
  svg.appendChild(el("text", { x: 12, y: T + (H - T - B) / 2, "font-size": 11, transform: `rotate(-90 12 ${T + (H - T - B) / 2})`, "text-anchor": "middle" }, "GiB per GPU"));
  return svg;
}

function renderRank(box, r) {
  const top = r.ranked.slice(0, 25);
  box.innerHTML = `<p><b>${r.ranked.length}</b> offer(s) on which it fits, best first by ${esc(r.sort)}; ${r.not_fitting.length} do not fit.</p>` +
    plansTable(top.map((o) => ({ p: o, offer: `${o.offer} (${o.count}× ${o.gpu})` })), true, "rank") +
    `<p class="small">Same as <code>${esc(cliLine("plan", searchMethod(), `--rank-gpus --gpus ${page.snap.gpus || 1}`))}</code>; prices are on-demand list prices (see the JSON for sources).</p>`;
  box.querySelectorAll("button[data-plan]").forEach((btn) => btn.addEventListener("click", () => {
    const o = top[+btn.dataset.plan];
    applyWorkload(o.workload, o.gpu);
  }));
}

// ------------------------------------------------------------------ serving (vramplan serve-plan)
function serveView() {
  // the serving view has inputs of its own: its requests are counted (and aborted) apart
  const sg = (page.serveGen = (page.serveGen || 0) + 1);
  if (page.serveController) page.serveController.abort();
  page.serveController = new AbortController();
  const signal = page.serveController.signal;
  const box = document.getElementById("serve");
  document.querySelectorAll("#tab-serve .err").forEach((e) => { e.textContent = ""; });
  document.querySelectorAll("#serve-options .invalid").forEach((e) => e.classList.remove("invalid"));
  if (!page.state.gpu) { box.innerHTML = `<p class="muted">Choose a GPU to size an inference server on it.</p>`; return; }
  box.innerHTML = `<p class="muted busy">sizing the server…</p>`;
  const fname = (page.catalog.serve && page.catalog.serve.fraction_names[page.state["serve-engine"] || "vllm"]) || "memory fraction";
  document.getElementById("fraction-name").textContent = fname;
  getJSON(`/api/serve?${query({}, page.state, true)}&doc=1`, signal).then(({ status, body }) => {
    if (sg !== page.serveGen || status === 409) return;
    if (status !== 200) {
      const slot = body.field && document.getElementById(`err-${body.field}`);
      if (slot && slot.closest("#tab-serve")) { showError(body); box.innerHTML = ""; } else box.innerHTML = `<p class="error">${esc(body.error || "error")}</p>`;
      return;
    }
    renderServe(box, body);
  }).catch(ignoreAbort);
}

function renderServe(box, p) {
  const doc = p.doc;
  const parts = [`<p id="serve-verdict"><b class="${p.starts ? "fits" : "nofit"}">${p.starts ? "starts" : "DOES NOT START"}</b> — ${esc(doc.title)}<br><span class="small muted">${esc(doc.subtitle)}</span></p>`,
    `<div id="serve-bar" class="chart"></div><div id="serve-legend" class="legend"></div>`];
  for (const s of doc.sections) {
    if (s.title) parts.push(`<h3>${esc(s.title)}</h3>`);
    if (s.kind === "table") parts.push(tableHtml(s.columns, s.rows, { foot: s.footer, align: s.align.length ? s.align : null }));
    else if (s.kind === "values") parts.push(tableHtml(["", ""], s.items, { cls: "rt values" }));
    else parts.push(`<ul class="notes${s.title === "The engine would log" || s.title === "Command" ? " serve-log" : ""}">${s.lines.map((l) => `<li>${esc(l)}</li>`).join("")}</ul>`);
  }
  parts.push(`<p class="small">Same as <code id="serve-cli">${esc(serveLine())}</code></p>`);
  box.innerHTML = parts.join("");
  const segs = [["weights", p.weights, "#4E79A7"], ["profile peak", p.profile_peak, "#F28E2B"], ["non-torch", p.non_torch, "#BAB0AC"],
    ["KV-cache pool", p.kv_pool, "#59A14F"], ["CUDA graphs", p.cuda_graph, "#B07AA1"], ["context", p.context, "#9C755F"]].filter((s) => s[1] > 0);
  draw("serve-bar", (W) => serveBar(p, segs, W));
  document.getElementById("serve-legend").innerHTML = segs.map(([k, b, c]) => `<span><i style="background:${c}"></i>${esc(k)} <b>${gib(b)}</b></span>`).join("") +
    `<span><i class="line red"></i>budget</span>`;
}

function serveBar(p, segs, W = 900) {
  const H = 76, L = 8, R = 8, top = 8, h = 30;
  const max = Math.max(p.total_memory, segs.reduce((a, s) => a + s[1], 0)) * 1.02 || 1;
  const x = (b) => L + (b / max) * (W - L - R);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": "the server's memory per GPU against the GPU's total" });
  svg.appendChild(el("rect", { x: L, y: top, width: x(p.total_memory) - L, height: h, fill: "#f1f1f1", stroke: "#ddd" }));
  let acc = 0;
  for (const [k, b, c] of segs) {
    const r = el("rect", { x: x(acc), y: top, width: Math.max(x(acc + b) - x(acc), 0.5), height: h, fill: c });
    r.appendChild(el("title", {}, `${k}: ${gib(b)} GiB`));
    svg.appendChild(r);
    acc += b;
  }
  const bx = x(p.budget);
  svg.appendChild(el("line", { x1: bx, x2: bx, y1: top - 4, y2: top + h + 6, stroke: "#C00000", "stroke-width": 2, "stroke-dasharray": "5 3" }));
  const text = `budget ${gib(p.budget)} of ${gib(p.total_memory)} GiB`;
  const t = textAt(bx, W, text.length * 7);
  svg.appendChild(el("text", { x: t.x, y: top + h + 22, "font-size": 12, fill: "#C00000", "text-anchor": t.anchor }, text));
  return svg;
}

// ------------------------------------------------------------------ applying an answer
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
// the job a state shows: its own, else what its inputs say (links made before the views)
function jobOf(state = page.state) {
  if (state.job && JOBS[state.job]) return state.job;
  const m = ((page.catalog && page.catalog.models) || []).find((x) => x.alias === state.model);
  if (state.objective === "grpo") return "rl";
  if (["dpo", "kto"].includes(state.objective)) return "preference";
  if (+(state.images || 0) > 0 || (m && m.job === "vlm")) return "vlm";
  return m && m.job === "diffusion" ? "diffusion" : "lm";
}

const rows = {}; // field key -> [its row, its error line]
function layoutJob() {
  // the job's own inputs sit with the main ones, in the fields' order; the rest stay in "more"
  const groups = { main: document.getElementById("workload"), more: document.getElementById("workload-more"), parallel: document.getElementById("workload-parallel") };
  const own = JOBS[jobOf()].keys;
  for (const f of page.fields) {
    const g = f.parallel ? groups.parallel : MAIN.includes(f.key) || own.includes(f.key) ? groups.main : groups.more;
    for (const el of rows[f.key] || []) {
      el.classList.toggle("job-own", own.includes(f.key));
      g.append(el);
    }
  }
  document.getElementById("job").value = jobOf();
}

function onJob(e) {
  const job = e.target.value;
  const spec = JOBS[job];
  if (!spec) return;
  for (const [k, v] of Object.entries(JOBS[jobOf()].set)) { // the last job's settings give way
    if (String(page.state[k] ?? "") === v && !(k in spec.set)) delete page.state[k];
  }
  page.state.job = job;
  Object.assign(page.state, spec.set);
  let extra = "";
  if (spec.prompt && !page.state.prompt) { // GRPO generates after a prompt: --prompt must be below --seq
    const f = page.fields.find((x) => x.key === "seq");
    const seq = +(page.state.seq || (page.effective || {}).seq || (f ? f.default : 0) || 2048);
    page.state.prompt = String(Math.max(1, Math.floor(seq / 2)));
    extra = ` Prompt set to ${page.state.prompt} tokens (half the sequence; the rest is the completion).`;
  }
  const m = (page.catalog.models || []).find((x) => x.alias === page.state.model);
  const fits = job === "lm" || job === "preference" || job === "rl" ? !m || m.job === "lm" : m && m.job === job;
  let note = `${spec.label}: its inputs are with the workload's.${extra}`;
  if (!fits && !page.state.config && spec.model) {
    page.state.model = spec.model;
    note += ` Model set to ${spec.model} (${page.state.model} takes this job; choose another of its kind).`;
  }
  formNote(note);
  layoutJob();
  fillForm();
  clearTimeout(debounce);
  debounce = setTimeout(refresh, 0);
}

function buildForm() {
  const groups = { main: document.getElementById("workload"), more: document.getElementById("workload-more"), parallel: document.getElementById("workload-parallel") };
  const jobRow = document.createElement("label");
  jobRow.className = "row";
  jobRow.htmlFor = "job";
  jobRow.title = "what kind of job: shows its own inputs with the main ones";
  const jobSel = document.createElement("select");
  jobSel.id = "job"; // a page key (not sent to the estimate): the inputs it shows are
  for (const [k, j] of Object.entries(JOBS)) { const o = document.createElement("option"); o.value = k; o.textContent = j.label; jobSel.appendChild(o); }
  jobSel.addEventListener("change", onJob);
  const jobSpan = document.createElement("span");
  jobSpan.textContent = "job";
  jobRow.append(jobSpan, jobSel);
  groups.main.append(jobRow);
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
    if (SLIDERS[f.key]) { // a slider beside the number: powers of two, for a quick sweep
      const [lo, hi] = SLIDERS[f.key];
      const range = document.createElement("input");
      range.type = "range"; range.min = lo; range.max = hi; range.step = 1;
      range.id = `${f.key}-slider`; range.dataset.for = f.key;
      range.setAttribute("aria-label", `${f.key} (powers of two)`);
      row.classList.add("slider");
      row.append(range);
    }
    const err = document.createElement("div");
    err.className = "err";
    err.id = `err-${f.key}`;
    g.append(row, err);
    rows[f.key] = [row, err];
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
  const sv = page.catalog.serve || { engines: ["vllm"], kv_cache_dtype: ["auto"], quantization: ["none"] };
  const fill = (id, values) => { const s = document.getElementById(id); for (const v of values) { const o = document.createElement("option"); o.value = v; o.textContent = v; s.appendChild(o); } };
  fill("serve-engine", sv.engines); fill("kv-cache-dtype", sv.kv_cache_dtype); fill("quantization", sv.quantization);
  fill("spec-method", sv.spec_methods || ["none"]);
}

// the version picker offers the chosen engine's releases (catalog.serve.engine_versions, newest first:
// the default); a link's version that is not among them is shown as it is sent (the server judges it)
function fillVersions() {
  const sel = document.getElementById("engine-version");
  if (!sel || !page.catalog) return;
  const engine = page.state["serve-engine"] || "vllm";
  const list = [...(((page.catalog.serve || {}).engine_versions || {})[engine] || [])];
  const cur = page.state["engine-version"];
  if (cur && !list.includes(cur)) list.unshift(cur);
  sel.replaceChildren(...list.map((v) => new Option(v, v)));
  sel.disabled = !list.length; // (TensorRT-LLM follows one release)
  sel.title = list.length ? `${engine} --engine-version: the release whose start-up sizing is followed` : `${engine} follows one release`;
}

function fillForm() {
  fillVersions();
  for (const input of document.querySelectorAll("#form input, #form select, #serve-options input, #serve-options select")) {
    const k = input.name;
    if (!k) continue;
    const f = page.fields.find((x) => x.key === k);
    let v = page.state[k];
    if (v == null) v = (page.effective || {})[k] ?? recipeDefaults()[k] ?? (f ? f.default : "");
    if (input.type === "checkbox") input.checked = truthy(v);
    else if (input.type !== "file") input.value = v;
    if (input.tagName === "SELECT" && input.selectedIndex < 0) input.selectedIndex = 0; // the engine's default
  }
  syncSliders();
  if (page.state.config) {
    document.getElementById("config-info").textContent = `using the dropped ${page.state.model} (choose a catalog model to go back)`;
  }
}

function syncSliders() {
  for (const r of document.querySelectorAll("input[type=range][data-for]")) {
    const v = +document.getElementById(r.dataset.for).value;
    if (v > 0) r.value = String(Math.round(Math.log2(v)));
  }
}

function formNote(text) {
  const n = document.getElementById("form-note");
  n.hidden = !text;
  n.textContent = text || "";
}

let debounce = null;
function onInput(e) {
  const input = e.target;
  if (!input.name || input.type === "file") return;
  let v = input.type === "checkbox" ? (input.checked ? "1" : "0") : input.value; // "0": off, sent when a recipe has it on
  if (input.name === "model") {
    if (e.type === "input" && !page.catalog.models.some((m) => m.alias === v)) return; // still typing
    delete page.state.config;
    document.getElementById("config-info").textContent = "";
  }
  if (page.state[input.name] !== undefined && String(page.state[input.name]) === String(v)) return; // (input, then change)
  formNote("");
  // PEFT (LoRA/QLoRA) is for training: leaving training clears it, choosing it chooses training
  if (input.name === "task" && v !== "train" && !["", "none", undefined].includes(page.state.peft)) {
    switchRecipeKnob("peft", "none");
    formNote(`PEFT set to none: LoRA/QLoRA applies to training, not to task ${v}.`);
  } else if (input.name === "peft" && v !== "none" && (page.state.task || "train") !== "train") {
    page.state.task = "train";
    formNote(`task set to train: ${v} applies to training.`);
  }
  if (input.name === "recipe" || input.name === "peft") switchRecipeKnob(input.name, v);
  page.state[input.name] = v;
  if (!page.state.job && ["model", "objective", "images"].includes(input.name)) layoutJob(); // (the view follows)
  if (SLIDERS[input.name]) syncSliders();
  fillFormSoon();
  clearTimeout(debounce);
  debounce = setTimeout(refresh, e.type === "change" ? 0 : 150);
}

// the old recipe's (or PEFT mode's) defaults the user kept give way to the new ones
function switchRecipeKnob(name, v) {
  const before = recipeDefaults();
  const after = recipeDefaults({ ...page.state, [name]: v });
  for (const k of new Set([...Object.keys(before), ...Object.keys(after)])) {
    const cur = page.state[k];
    if (cur == null || String(cur) === String(before[k] ?? "") || (before[k] === "" && !truthy(cur))) delete page.state[k];
  }
  page.state[name] = v;
}

let fillPending = false;
function fillFormSoon() {
  // the form shows what the state became (a recipe's knobs, PEFT cleared) without fighting the typing
  if (fillPending) return;
  fillPending = true;
  requestAnimationFrame(() => {
    fillPending = false;
    const active = document.activeElement;
    for (const input of document.querySelectorAll("#form input, #form select")) {
      if (input === active || !input.name || input.type === "file") continue;
      const f = page.fields.find((x) => x.key === input.name);
      let v = page.state[input.name];
      if (v == null) v = (page.effective || {})[input.name] ?? recipeDefaults()[input.name] ?? (f ? f.default : "");
      if (input.type === "checkbox") input.checked = truthy(v); else if (String(input.value) !== String(v)) input.value = v;
    }
    syncSliders();
  });
}

function onSlider(e) {
  const r = e.target;
  if (!r.dataset || !r.dataset.for) return;
  const key = r.dataset.for;
  const v = String(2 ** +r.value);
  document.getElementById(key).value = v;
  page.state[key] = v;
  clearTimeout(debounce);
  debounce = setTimeout(refresh, e.type === "change" ? 0 : 150);
}

function onServeInput(e) {
  const input = e.target;
  if (!input.name) return;
  if (input.name === "serve-engine" && (page.state["serve-engine"] || "vllm") !== input.value) {
    delete page.state["engine-version"]; // another engine's releases: its newest, the default
    page.state["serve-engine"] = input.value;
    fillVersions();
    document.getElementById("engine-version").selectedIndex = 0;
  }
  page.state[input.name] = input.value;
  writeUrl();
  clearTimeout(debounce);
  debounce = setTimeout(() => { page.tabDone["serve:analytic"] = false; loadTab(page.gen, page.controller ? page.controller.signal : undefined); }, e.type === "change" ? 0 : 250);
}

async function uploadConfig(file) {
  clearErrors();
  if (file.size > 256 * 1024) { showError({ error: `${file.name} is ${file.size.toLocaleString("en-US")} bytes; the page accepts up to 262,144`, field: "config" }); return; }
  const text = await file.text();
  const r = await fetch(`/api/config?name=${encodeURIComponent(file.name)}`, { method: "POST", body: text, headers: { "Content-Type": "application/json" } });
  const body = await r.json();
  if (r.status !== 200) { showError(body.field ? body : { ...body, field: "config" }); return; }
  page.state.config = body.config;
  page.state.model = body.name;
  document.getElementById("model").value = "";
  document.getElementById("config-info").textContent = `using ${body.name}: ${body.model_type}, ${body.family}, ${(body.params / 1e6).toFixed(1)} M params`;
  refresh();
}

function updateLinks() {
  document.getElementById("dl-report").href = `/api/download/report?${query({ method: page.snap.method === "analytic" ? "analytic" : page.snap.method })}`;
  document.getElementById("dl-snapshot").href = `/api/download/snapshot?${query({ method: "trace" })}`;
  const box = document.getElementById("dl-emit");
  if (!page.snap.gpu) { box.innerHTML = `<span class="muted">(choose a GPU)</span>`; return; }
  box.innerHTML = emitLinks(`${query({ method: "analytic" })}&view=plan&pick=1`, page.snap.task || "train");
}

async function copyLink(e) {
  e.preventDefault();
  const note = document.getElementById("copy-note");
  const url = location.href;
  let ok = false;
  try {
    if (navigator.clipboard && window.isSecureContext) { await navigator.clipboard.writeText(url); ok = true; }
  } catch (err) { ok = false; }
  if (!ok) { // a page on a non-local address is not a secure context: the old way
    const t = document.createElement("textarea");
    t.value = url; t.setAttribute("readonly", ""); t.style.position = "fixed"; t.style.opacity = "0";
    document.body.appendChild(t); t.select();
    try { ok = document.execCommand("copy"); } catch (err) { ok = false; }
    t.remove();
  }
  note.classList.toggle("failed", !ok);
  note.textContent = ok ? "✓ link copied" : "could not copy: copy the address bar";
  clearTimeout(copyLink.timer);
  copyLink.timer = setTimeout(() => { note.textContent = ""; }, 4000);
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
    layoutJob();
    if (page.lastError) { clearErrors(); showError(page.lastError); }
    const form = document.getElementById("form");
    form.addEventListener("input", onInput);
    form.addEventListener("change", onInput);
    form.addEventListener("input", onSlider);
    form.addEventListener("change", onSlider);
    const serve = document.getElementById("serve-options");
    serve.addEventListener("input", onServeInput);
    serve.addEventListener("change", onServeInput);
  }, 0));
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  document.querySelectorAll("[data-goto]").forEach((a) => a.addEventListener("click", (e) => { e.preventDefault(); showTab(a.dataset.goto); }));
  document.querySelectorAll("[data-open]").forEach((a) => a.addEventListener("click", (e) => {
    e.preventDefault();
    const d = document.getElementById(a.dataset.open);
    d.open = true; d.scrollIntoView({ block: "nearest" });
  }));
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
  document.getElementById("copy-link").addEventListener("click", copyLink);
  window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(redrawAll, 100); });
}

document.addEventListener("DOMContentLoaded", init);
