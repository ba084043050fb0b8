// kvserve dashboard: reads /v1/admin/dashboard with the admin token from the URL fragment (#token=...) or this
// tab's storage, and draws tables and uPlot charts (the vendored copy, vendor/uplot/README.md).
"use strict";

const $ = (id) => document.getElementById(id);
const COLORS = ["#3b7ddd", "#e0a030", "#2e9e6b", "#c0504d", "#8064a2", "#4bacc6", "#9b7a43", "#d16ba5"];
const UTC = (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC");
const charts = {};  // name -> uPlot instance (the browser test reads them)
window.kvCharts = charts;

// Dollars, the one place they are formatted, as metering/money.py's format_money writes them: cents, or three
// significant digits where cents would show fewer, no zeros past the cents ("$0.125", "$0.0000456").
function money(v) {
  if (v == null || !Number.isFinite(v)) return "–";
  const a = Math.abs(v);
  const decimals = a === 0 ? 2 : Math.min(100, Math.max(2, 2 - Math.floor(Math.log10(a))));
  const [whole, frac] = a.toFixed(decimals).split(".");
  return (v < 0 ? "-$" : "$") + Number(whole).toLocaleString("en-US") + "." + frac.replace(/0+$/, "").padEnd(2, "0");
}
const int = (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US"));
const ms = (v) => (v == null ? "–" : v < 100 ? v.toFixed(1) : int(v));  // milliseconds: at most 1 decimal
const pct = (fraction) => (fraction == null ? "–" : (100 * fraction).toFixed(1) + "%");
const marginPct = (charged, cost) => (charged > 0 ? (charged - cost) / charged : null);
const when = (ts) => new Date(ts * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC";
const sum = (vals) => vals.reduce((s, v) => s + (v ?? 0), 0);
const MEASURES = {
  charged: (r) => r.amount.value,
  cost: (r) => r.cost.value,
  margin: (r) => r.amount.value - r.cost.value,
};

function token() {
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromHash) sessionStorage.setItem("kvserve-token", fromHash);
  return fromHash || sessionStorage.getItem("kvserve-token");
}

async function api(path) {
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token() } });
  const body = await r.json();
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}

function table(el, header, rows) {
  el.replaceChildren();
  const tr = el.insertRow();
  for (const h of header) { const th = document.createElement("th"); th.textContent = h; tr.appendChild(th); }
  for (const row of rows) {
    const r = el.insertRow();
    for (const c of row) {
      const td = r.insertCell();
      if (c instanceof Node) td.appendChild(c); else td.textContent = c;
    }
  }
}

function bar(fraction) {
  const span = document.createElement("span");
  span.className = "bar";
  const fill = document.createElement("i");
  fill.style.width = Math.min(100, Math.max(0, fraction * 100)).toFixed(1) + "%";
  span.appendChild(fill);
  return span;
}

function sumBy(results, key) {
  const groups = new Map();
  for (const r of results) {
    const k = r[key] ?? "-";
    const g = groups.get(k) || { requests: 0, input: 0, cached: 0, output: 0, charged: 0, cost: 0, engine: 0 };
    g.requests += r.num_model_requests; g.input += r.input_tokens; g.cached += r.input_cached_tokens;
    g.output += r.output_tokens; g.charged += r.amount.value; g.cost += r.cost.value; g.engine += r.engine_seconds;
    groups.set(k, g);
  }
  return [...groups.entries()].sort((a, b) => b[1].charged - a[1].charged);
}

function groupTable(el, name, results) {
  table(el, [name, "requests", "in tokens", "out tokens", "charged", "cost", "margin", "margin %"],
    sumBy(results, name).map(([k, g]) => [k, int(g.requests), int(g.input), int(g.output), money(g.charged),
      money(g.cost), money(g.charged - g.cost), pct(marginPct(g.charged, g.cost))]));
}

// ---- charts ----------------------------------------------------------------------------------------------

const resizers = {};  // name -> the ResizeObserver keeping that chart as wide as its container

function drop(name) {
  charts[name].destroy();
  resizers[name].disconnect();
  delete charts[name];
  delete resizers[name];
}

function draw(name, el, opts, data) {
  if (charts[name]) drop(name);
  el.replaceChildren();
  const u = new uPlot({ width: el.clientWidth, tzDate: UTC, ...opts, axes: [{ values: timeTicks }, ...opts.axes] },
    data, el);
  charts[name] = u;
  // follow the container: the window's width, and the page's scrollbar appearing as the tables fill in
  resizers[name] = new ResizeObserver(() => el.clientWidth && u.width !== el.clientWidth &&
    u.setSize({ width: el.clientWidth, height: u.height }));
  resizers[name].observe(el);
}

// Time ticks in UTC, 24-hour (seconds when ticks are seconds apart): the date under the first tick of each day,
// days alone when ticks are days apart.
function timeTicks(u, splits, axis, space, incr) {
  let day = null;
  return splits.map((t) => {
    const iso = new Date(t * 1000).toISOString(), date = iso.slice(5, 10), hm = iso.slice(11, incr < 60 ? 19 : 16);
    if (incr >= 86400) return date;
    const label = date !== day ? hm + "\n" + date : hm;
    day = date;
    return label;
  });
}

// A legend entry: the value under the cursor, or `idle` when the cursor is off the chart.
const legend = (fmt, idle) => (u, v, s, idx) => (idx == null ? idle : fmt(v, idx));

const moneyAxis = { values: (u, vals) => vals.map(money), size: 80 };

// The time axis of a usage page: each bucket drawn at its middle, the x range its whole span, the legend its start.
function bucketAxis(buckets) {
  const width = buckets[0].end_time - buckets[0].start_time;
  const x0 = buckets[0].start_time, x1 = buckets[buckets.length - 1].start_time + width;
  return { xs: buckets.map((b) => b.start_time + width / 2), scale: { time: true, range: () => [x0, x1] },
    series: { label: "bucket", value: legend((v) => when(v - width / 2), "whole range") } };
}

// Bars of each group's value in each bucket, stacked: a group's bar reaches its running total (positives up,
// negatives down) and the groups are drawn largest total first, so each shows as its own band.
function stackedChart(usage, group, measure) {
  const buckets = usage.data, value = MEASURES[measure], axis = bucketAxis(buckets), xs = axis.xs;
  const keys = [...new Set(buckets.flatMap((b) => b.results.map((r) => r[group] ?? "-")))].sort();
  const raw = keys.map((k) => buckets.map((b) => b.results.filter((r) => (r[group] ?? "-") === k)
    .reduce((s, r) => s + value(r), 0)));
  const up = xs.map(() => 0), down = xs.map(() => 0);
  const stacked = raw.map((vals) => vals.map((v, i) => (v > 0 ? (up[i] += v) : v < 0 ? (down[i] += v) : null)));
  const order = keys.map((_, i) => i).reverse();
  const bars = uPlot.paths.bars({ size: [0.8, 64] });
  draw("stacked", $("chart-stacked"), {
    height: 280,
    scales: { x: axis.scale },
    axes: [moneyAxis],
    series: [axis.series,
      ...order.map((i) => ({ label: keys[i], fill: COLORS[i % COLORS.length], stroke: COLORS[i % COLORS.length],
        paths: bars, points: { show: false }, value: legend((v, idx) => money(raw[i][idx]), money(sum(raw[i]))) }))],
  }, [xs, ...order.map((i) => stacked[i])]);
}

function totalsChart(usage) {
  const buckets = usage.data, axis = bucketAxis(buckets);
  const total = (b, f) => b.results.reduce((s, r) => s + f(r), 0);
  const charged = buckets.map((b) => total(b, MEASURES.charged)), cost = buckets.map((b) => total(b, MEASURES.cost));
  const margin = charged.map((c, i) => c - cost[i]);
  const share = charged.map((c, i) => { const m = marginPct(c, cost[i]); return m == null ? null : 100 * m; });
  const line = (label, color, vals, extra) => ({ label, stroke: color, width: 2, points: { show: true, size: 5 },
    value: legend(money, money(sum(vals))), ...extra });
  const overall = marginPct(sum(charged), sum(cost));
  draw("totals", $("chart-totals"), {
    height: 240,
    scales: { x: axis.scale },
    axes: [moneyAxis, { scale: "%", side: 1, grid: { show: false }, values: (u, vals) => vals.map((v) => v + "%") }],
    series: [axis.series, line("charged", COLORS[0], charged), line("cost", COLORS[1], cost),
      line("margin", COLORS[2], margin),
      line("margin %", COLORS[3], share, { scale: "%", dash: [6, 4],
        value: legend((v) => (v == null ? "–" : v.toFixed(1) + "%"), pct(overall)) })],
  }, [axis.xs, charged, cost, margin, share]);
}

function loadCharts(serving, interval) {
  const box = $("load-charts");
  for (const name of Object.keys(charts)) if (name.startsWith("load:")) drop(name);
  box.replaceChildren();
  for (const m of serving) {
    const cell = document.createElement("div");
    const title = document.createElement("h3");
    title.textContent = m.model;
    const el = document.createElement("div");
    el.className = "chart";
    cell.append(title, el);
    box.appendChild(cell);
    const L = m.load, at = L.t.length - 1;
    const latest = (col, fmt) => legend(fmt, at < 0 ? "–" : fmt(col[at]));
    const count = (v) => int(v), share = (v) => (v == null ? "–" : v.toFixed(1) + "%");
    draw("load:" + m.model, el, {
      height: 180,
      scales: { x: { time: true }, "%": { range: [0, 100] }, n: { range: (u, lo, hi) => [0, Math.max(4, hi)] } },
      axes: [{ scale: "%", values: (u, vals) => vals.map((v) => v + "%") }, { scale: "n", side: 1, grid: { show: false },
        incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] }],
      series: [{ label: "at", value: legend((v) => new Date(v * 1000).toISOString().slice(11, 19), "latest") },
        { label: "KV use", scale: "%", stroke: COLORS[0], fill: COLORS[0] + "22", width: 2, value: latest(L.kv_used_pct, share) },
        { label: "waiting (interactive)", scale: "n", stroke: COLORS[1], width: 2, value: latest(L.waiting_interactive, count) },
        { label: "waiting (batch)", scale: "n", stroke: COLORS[3], width: 2, value: latest(L.waiting_batch, count) },
        { label: "running", scale: "n", stroke: COLORS[2], width: 2, value: latest(L.running, count) }],
    }, [L.t, L.kv_used_pct, L.waiting_interactive, L.waiting_batch, L.running]);
  }
  const span = Math.max(0, ...serving.map((m) => (m.load.t.length ? m.load.t[m.load.t.length - 1] - m.load.t[0] : 0)));
  $("load-note").textContent = `(sampled by the server every ${interval} s; the last ` +
    (span < 120 ? `${Math.round(span)} s)` : `${Math.round(span / 60)} min)`);
}

function redrawStacked() {
  if (!last) return;
  $("measure-title").textContent = $("measure").value;
  $("group-title").textContent = $("group").value;
  stackedChart(last.usage, $("group").value, $("measure").value);
}

// ---- the page --------------------------------------------------------------------------------------------

let last = null;  // the latest /v1/admin/dashboard body

async function load() {
  if (!token()) { $("login").hidden = false; $("status").textContent = "needs an admin token"; return; }
  $("status").textContent = "loading";
  const d = await api("/v1/admin/dashboard");
  last = d;
  const buckets = d.usage.data, results = buckets.flatMap((b) => b.results);
  const total = (f) => results.reduce((s, r) => s + f(r), 0);
  const charged = total(MEASURES.charged), cost = total(MEASURES.cost);
  $("total-charged").textContent = money(charged);
  $("total-cost").textContent = money(cost);
  $("total-margin").textContent = money(charged - cost);
  $("total-margin-pct").textContent = pct(marginPct(charged, cost));
  $("total-requests").textContent = int(total((r) => r.num_model_requests));
  $("total-input").textContent = int(total((r) => r.input_tokens));
  $("total-output").textContent = int(total((r) => r.output_tokens));
  $("range").textContent = when(buckets[0].start_time) + " to " + when(buckets[buckets.length - 1].end_time);
  $("bucket-note").textContent = `(${{ "1m": "minute", "1h": "hour", "1d": "day" }[d.bucket_width]} buckets)`;
  $("main").hidden = false;  // charts size themselves to their visible containers
  redrawStacked();
  totalsChart(d.usage);
  groupTable($("by-tenant"), "tenant", results);
  groupTable($("by-model"), "model", results);
  groupTable($("by-tier"), "tier", results);
  groupTable($("by-adapter"), "adapter", results);
  $("adapters-section").hidden = !results.some((r) => r.adapter != null);  // shown once an adapter has served
  table($("budgets"), ["tenant", "model", "period", "budget", "spent", "held", "left", "used", "burn / hour", "runs out"],
    d.budgets.map((b) => [b.tenant, b.model ?? "all", b.period, money(b.amount), money(b.spent), money(b.reserved),
      money(b.remaining), bar(b.amount ? (b.spent + b.reserved) / b.amount : 1), money(b.burn_per_hour),
      b.exhausts_at != null ? when(b.exhausts_at) : b.period_end != null ? "not this period" : "–"]));
  const window_s = d.serving.length ? d.serving[0].window_s : 60;
  $("serving-note").textContent = `(finished in the last ${window_s} s; milliseconds)`;
  table($("serving"), ["model", "requests", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "e2e p50", "e2e p99",
    "queue p50", "prefix hits", "engine util", "decode tok/s", "preempted"],
    d.serving.map((m) => [m.model, int(m.requests), ms(m.ttft_p50_ms), ms(m.ttft_p99_ms), ms(m.tpot_p50_ms),
      ms(m.tpot_p99_ms), ms(m.e2e_p50_ms), ms(m.e2e_p99_ms), ms(m.queue_time_p50_ms), pct(m.prefix_cache_hit_rate),
      pct(m.engine_util), m.tokens_per_s.toFixed(1), int(m.preemptions)]));
  loadCharts(d.serving, d.load_sample_interval_s);
  const busy = Object.values(d.prices).map((p) => p.break_even_utilization)[0];
  $("prices-note").textContent = `(per million tokens; the replica's cost per hour is the cost side; break-even: ` +
    `what an output token must fetch to pay for the engine time this traffic took, prompts included, at ` +
    `${pct(busy)} busy; kvserve plan prices gives input and output apart)`;
  table($("prices"), ["model", "input", "cached input", "output", "output break-even", "batch tier pays",
    "replica per hour"],
    Object.entries(d.prices).map(([model, p]) => [model, money(p.input), money(p.cached_input), money(p.output),
      money(p.break_even_output), pct(p.batch_discount), money(p.replica_cost_per_hour)]));
  const fleet = await (await fetch("/fleet/status")).json();  // a fleet gateway: per replica load
  $("replicas-section").hidden = !fleet.fleet;
  if (fleet.fleet) {
    table($("replicas"), ["model", "replica", "version", "routed", "in flight", "running", "queued tokens", "KV use",
      "est. TTFT ms", "prefix hit rate"],
      Object.entries(fleet.models).flatMap(([model, m]) => m.replicas.map((r) => [model, r.id, r.version, int(r.routed),
        int(r.inflight), int(r.running ?? 0), int(r.queued_prompt_tokens ?? 0), pct(r.kv_usage ?? 0),
        ms((r.est_ttft_s ?? 0) * 1000), pct(r.prefix_hit_rate)])));
  }
  $("status").className = "";
  $("status").textContent = "updated " + new Date().toISOString().slice(11, 19) + " UTC";
}

function fail(e) {
  $("status").textContent = e.message;
  $("status").className = "bad";
}

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("kvserve-token", $("token").value.trim());
  $("login").hidden = true;
  load().catch(fail);
});
$("refresh").addEventListener("click", () => load().catch(fail));
$("group").addEventListener("change", redrawStacked);
$("measure").addEventListener("change", redrawStacked);
load().catch(fail);
