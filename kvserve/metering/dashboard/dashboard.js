// kvserve dashboard: reads the admin APIs (usage, budgets, serving metrics) with the token from the URL
// fragment (#token=...) or this tab's storage, and draws tables and one SVG chart. No third-party code.
"use strict";

const $ = (id) => document.getElementById(id);
const usd = (v) => (v < 0 ? "-$" : "$") + Math.abs(v).toFixed(6);
const int = (v) => Math.round(v).toLocaleString("en-US");

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
  table(el, [name, "requests", "input tokens", "cached", "output tokens", "charged", "cost", "margin", "engine s"],
    sumBy(results, name).map(([k, g]) => [k, int(g.requests), int(g.input), int(g.cached), int(g.output),
      usd(g.charged), usd(g.cost), usd(g.charged - g.cost), g.engine.toFixed(2)]));
}

function chart(svg, buckets) {
  svg.replaceChildren();
  const ns = "http://www.w3.org/2000/svg";
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), pad = 30;
  const series = buckets.map((b) => ({
    t: b.start_time,
    charged: b.results.reduce((s, r) => s + r.amount.value, 0),
    cost: b.results.reduce((s, r) => s + r.cost.value, 0),
  }));
  const top = Math.max(1e-12, ...series.map((s) => Math.max(s.charged, s.cost)));
  const slot = (W - 2 * pad) / Math.max(1, series.length);
  series.forEach((s, i) => {
    [["charged", "#3b7ddd", 0], ["cost", "#e0a030", 0.45]].forEach(([k, color, off]) => {
      const h = (s[k] / top) * (H - 2 * pad);
      const rect = document.createElementNS(ns, "rect");
      rect.setAttribute("x", pad + i * slot + off * slot * 0.9);
      rect.setAttribute("y", H - pad - h);
      rect.setAttribute("width", slot * 0.4);
      rect.setAttribute("height", h);
      rect.setAttribute("fill", color);
      const title = document.createElementNS(ns, "title");
      title.textContent = k + " " + new Date(s.t * 1000).toISOString().slice(0, 16) + ": " + usd(s[k]);
      rect.appendChild(title);
      svg.appendChild(rect);
    });
  });
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", pad); label.setAttribute("y", 18);
  label.textContent = "max " + usd(top) + " per bucket (blue: charged, amber: cost)";
  svg.appendChild(label);
}

async function load() {
  if (!token()) { $("login").hidden = false; $("status").textContent = "needs an admin token"; return; }
  $("status").textContent = "loading";
  const width = $("bucket").value;
  const [usage, budgets, serving] = await Promise.all([
    api(`/v1/usage?bucket_width=${width}&limit=${width === "1d" ? 14 : 24}&group_by=tenant,model,tier`),
    api("/v1/admin/budgets"),
    api("/v1/metrics/serving"),
  ]);
  const results = usage.data.flatMap((b) => b.results);
  const total = (f) => results.reduce((s, r) => s + f(r), 0);
  const charged = total((r) => r.amount.value), cost = total((r) => r.cost.value);
  $("total-charged").textContent = usd(charged);
  $("total-cost").textContent = usd(cost);
  $("total-margin").textContent = usd(charged - cost);
  $("total-requests").textContent = int(total((r) => r.num_model_requests));
  $("total-input").textContent = int(total((r) => r.input_tokens));
  $("total-output").textContent = int(total((r) => r.output_tokens));
  const first = usage.data[0], last = usage.data[usage.data.length - 1];
  $("range").textContent = first ? new Date(first.start_time * 1000).toISOString().slice(0, 16) + " to " +
    new Date(last.end_time * 1000).toISOString().slice(0, 16) + " UTC" : "";
  chart($("chart"), usage.data);
  groupTable($("by-tenant"), "tenant", results);
  groupTable($("by-model"), "model", results);
  groupTable($("by-tier"), "tier", results);
  table($("budgets"), ["tenant", "model", "period", "budget", "spent", "held", "left", "used"],
    budgets.data.map((b) => [b.tenant, b.model ?? "all", b.period, usd(b.amount), usd(b.spent), usd(b.reserved),
      usd(b.remaining), bar(b.amount ? (b.spent + b.reserved) / b.amount : 1)]));
  table($("serving"), ["model", "requests", "TTFT p50 ms", "TTFT p99 ms", "queue (interactive / batch)", "running",
    "KV use", "prefix hit rate", "engine util"],
    serving.data.map((m) => [m.model, int(m.requests), m.ttft_p50_ms ?? "-", m.ttft_p99_ms ?? "-",
      `${m.queue_depth.interactive ?? 0} / ${m.queue_depth.batch ?? 0}`, int(m.running),
      m.kv_cache_used_pct.toFixed(1) + "%", (100 * m.prefix_cache_hit_rate).toFixed(1) + "%",
      (100 * m.engine_util).toFixed(1) + "%"]));
  const fleet = await (await fetch("/fleet/status")).json();  // a fleet gateway: per replica load
  $("replicas-section").hidden = !fleet.fleet;
  if (fleet.fleet) {
    const models = fleet.models;
    table($("replicas"), ["model", "replica", "version", "routed", "in flight", "running", "queued tokens", "KV use",
      "est. TTFT ms", "prefix hit rate"],
      Object.entries(models).flatMap(([model, m]) => m.replicas.map((r) => [model, r.id, r.version, int(r.routed),
        int(r.inflight), int(r.running ?? 0), int(r.queued_prompt_tokens ?? 0), (100 * (r.kv_usage ?? 0)).toFixed(1) + "%",
        ((r.est_ttft_s ?? 0) * 1000).toFixed(0), r.prefix_hit_rate == null ? "-" : (100 * r.prefix_hit_rate).toFixed(1) + "%"])));
  }
  $("main").hidden = false;
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
$("bucket").addEventListener("change", () => load().catch(fail));
load().catch(fail);
