// Polls /ui/state and renders it. No framework, no build step.
"use strict";
const POLL_MS = 1000;

function ms(s) { return s == null ? "–" : (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms"; }
function bytes(b) {
  const units = ["B/s", "KiB/s", "MiB/s", "GiB/s"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + units[i];
}
function set(id, text) { document.getElementById(id).textContent = text; }
function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}

function renderCluster(c) {
  set("cluster", c.name || "");
  set("model", c.served_model_name === c.model ? c.model
    : c.model + " (served as " + c.served_model_name + ")");
  set("prefill-policy", c.prefill_policy);
  set("decode-policy", c.decode_policy);
  set("fallback-policy", c.fallback_policy);
  set("kv", c.kv_mode + (c.kv_transport ? " over " + c.kv_transport : ""));
  set("version", c.version);
}

function renderNotServing(list) {
  const body = document.getElementById("not-serving");
  body.replaceChildren();
  for (const i of list) {
    const row = body.insertRow();
    row.dataset.instance = i.id;
    cell(row, i.id);
    cell(row, i.pool);
    cell(row, i.state, i.state);
    cell(row, i.since);
    cell(row, i.reason);
  }
  document.getElementById("not-serving-table").hidden = list.length === 0;
  document.getElementById("all-serving").hidden = list.length > 0;
}

function render(s) {
  renderCluster(s.cluster);
  renderNotServing(s.not_serving);
  const mode = document.getElementById("mode");
  mode.textContent = s.mode;
  mode.className = "mode " + s.mode;
  set("reason", s.fallback_reason ? "(" + s.fallback_reason + ")" : "");
  const live = s.live;
  set("ttft", ms(live.ttft_s));
  set("tpot", ms(live.tpot_s));
  set("rps", live.requests_per_s.toFixed(2));
  set("kvbw", bytes(live.kv_bytes_per_s));
  set("kvrate", live.kv_transfers_per_s.toFixed(2));
  set("kvexposed", ms(live.kv_exposed_s));
  set("total", String(s.requests_total));
  set("window", String(live.window_s));
  const body = document.getElementById("instances");
  body.replaceChildren();
  for (const i of s.instances) {
    const row = body.insertRow();
    row.dataset.instance = i.id;
    cell(row, i.id);
    cell(row, i.role);
    cell(row, i.state, i.state);
    cell(row, i.running, "n");
    cell(row, i.waiting, "n");
    cell(row, i.inflight, "n");
    cell(row, (i.kv_usage * 100).toFixed(1) + "%", "n");
    cell(row, i.address);
  }
  const events = document.getElementById("events");
  events.replaceChildren();
  const list = s.events.length ? s.events.slice().reverse() : ["none"];
  for (const e of list) {
    const li = document.createElement("li");
    li.textContent = e;
    events.appendChild(li);
  }
  set("updated", new Date().toLocaleTimeString());
}

async function poll() {
  try {
    const r = await fetch("/ui/state", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    set("error", "");
  } catch (e) {
    set("error", "cannot read /ui/state: " + e.message);
  }
  setTimeout(poll, POLL_MS);
}
poll();
