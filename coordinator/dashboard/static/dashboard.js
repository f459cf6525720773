// The edgefil dashboard: polls /api/run (the run folder's live.json or results.json) and redraws.
// Every string from the run goes in as text (textContent), never as markup: device errors come from devices.
"use strict";

const params = new URLSearchParams(location.search);
const token = params.get("token");
const refreshMs = Math.max(200, Number(params.get("refresh")) || 1000);
const charts = {};
const STALE_S = 15;
// what every device daemon reports with its update (edge_client/device.py): not a method's own numbers
const STANDARD_METRICS = new Set(["loss", "device_seconds", "disk_full", "disk_free_bytes", "stored_samples",
  "stored_bytes", "bytes_sent", "bytes_received", "store_budget_bytes", "store_budget_samples"]);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %"; }

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return (h ? h + " h " : "") + (h || m ? m + " min " : "") + sec + " s";
}

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function drawHeader(view, run) {
  document.getElementById("fleet").textContent = run ? run.fleet : view.folder;
  const outcome = document.getElementById("outcome");
  const now = Date.now() / 1000;
  let state = run ? run.outcome : "waiting for the run";
  let cls = run ? state.split(":")[0] : "";
  if (!run && view.preparing) {  // before the first round: the fleet's preparation (coordinator/preparation.py)
    state = "preparing: " + view.preparing.step + " (" + duration(now - view.preparing.since) + ")";
    cls = "preparing";
  }
  if (run && state === "running" && run.updated_at && now - run.updated_at > STALE_S) {
    state = "running, not updated for " + duration(now - run.updated_at);
    cls = "stopped";
  }
  outcome.textContent = state;
  outcome.className = "pill " + cls;
  document.getElementById("updated").textContent =
    run && run.updated_at ? "updated " + new Date(run.updated_at * 1000).toLocaleTimeString() : "";
}

function drawProgress(run) {
  const done = run.steps_done !== undefined ? run.steps_done : (run.history || []).length;
  const total = run.steps_total || done;
  const text = document.getElementById("progress-text");
  let line = "round " + run.rounds_completed + " done · step " + done + " of " + total;
  if (run.eta_s !== null && run.eta_s !== undefined && run.outcome === "running") line += " · ETA " + duration(run.eta_s);
  const privacy = (run.settings || {}).privacy;
  if (run.epsilon !== null && run.epsilon !== undefined && privacy) {  // central DP (coordinator/privacy.py)
    line += " · ε " + run.epsilon.toFixed(2) + " at δ " + privacy.delta;
    if (privacy.epsilon_budget) line += " of a budget of " + privacy.epsilon_budget.toFixed(2);
  }
  if (run.local_epsilon !== null && run.local_epsilon !== undefined) {  // local DP (edge_client/privacy.py)
    line += " · local ε ≤ " + run.local_epsilon.toFixed(2) + " (the largest a device reported)";
  }
  text.textContent = line;
  text.dataset.done = done;
  text.dataset.total = total;
  text.dataset.round = run.rounds_completed;
  document.getElementById("progress-bar").style.width = (total ? 100 * done / total : 0) + "%";
  const open = run.open_round;
  document.getElementById("open-round").textContent = open
    ? "round " + open.round + " (task " + open.task + ") open: " + open.delivered.length + " of " +
      open.selected.length + " selected devices delivered, " + duration(open.remaining_s) + " to its deadline"
    : "";
}

function drawDevices(run) {
  const devices = run.devices || [];
  const online = devices.filter((d) => d.online).length;
  document.getElementById("device-count").textContent = "(" + online + " of " + devices.length + " online)";
  const rows = devices.map((d) => {
    const tr = el("tr");
    tr.dataset.device = d.device;
    const state = d.state === "unseen" ? "not seen" : (d.online && d.state !== "error" && d.state !== "no-data"
      ? "online" : d.state);
    tr.append(el("td", d.device), el("td", d.profile || "–"), el("td", d.backend || "–"),
      el("td", state, "state-" + (state === "not seen" ? "unseen" : state)), el("td", d.last_round || "–"));
    const store = el("td");
    const meter = (used, budget, text) => {
      const bar = el("span", null, "store");
      const fill = el("div", null, used > budget ? "over" : "");
      fill.style.width = Math.min(100, 100 * used / budget) + "%";
      bar.append(fill);
      store.append(bar, document.createTextNode(text));
    };
    if (d.budget_samples && d.stored_samples !== null && d.stored_samples !== undefined) {
      meter(d.stored_samples, d.budget_samples, d.stored_samples + " / " + d.budget_samples + " samples, " +
        bytes(d.stored_bytes));
    } else if (d.budget_bytes && d.stored_bytes !== null && d.stored_bytes !== undefined) {
      meter(d.stored_bytes, d.budget_bytes, bytes(d.stored_bytes) + " / " + bytes(d.budget_bytes));
    } else {
      store.textContent = d.stored_bytes === null || d.stored_bytes === undefined ? "–" : bytes(d.stored_bytes);
    }
    tr.append(store, el("td", d.error ? "round " + d.error_round + ": " + d.error : "", "error"));
    return tr;
  });
  replaceRows(document.querySelector("#devices tbody"), rows);
}

function drawMatrix(run) {
  const rows = run.accuracy_matrix || [];
  const table = document.getElementById("matrix");
  const tbody = el("tbody");
  if (!rows.length) {
    const tr = el("tr");
    tr.append(el("td", "no task completed yet", "muted"));
    tbody.append(tr);
  } else {
    const head = el("tr");
    head.append(el("th", ""));
    rows.forEach((_, j) => head.append(el("th", "task " + j)));
    tbody.append(head);
    rows.forEach((row, i) => {
      const tr = el("tr");
      tr.append(el("th", "after " + i));
      rows.forEach((_, j) => {
        const cell = el("td", j < row.length ? (100 * row[j]).toFixed(1) : "");
        if (j < row.length) cell.style.background = "hsl(" + (120 * row[j]) + ", 70%, 85%)";
        tr.append(cell);
      });
      tbody.append(tr);
    });
  }
  table.replaceChildren(tbody);
  document.getElementById("summary").textContent = rows.length
    ? "final " + pct(run.final_accuracy) + " · average " + pct(run.average_accuracy) + " · forgetting " +
      pct(run.forgetting) : "";
}

function drawRefusals(run) {
  const counters = Object.entries(run.counters || {}).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1]);
  const rows = counters.length ? counters.map(([reason, n]) => {
    const tr = el("tr");
    tr.append(el("td", reason), el("td", n));
    return tr;
  }) : [(() => { const tr = el("tr"); tr.append(el("td", "nothing refused", "muted")); return tr; })()];
  replaceRows(document.querySelector("#refusals tbody"), rows);
}

function lineChart(id, title, names, xs, series, format) {
  const box = document.getElementById(id);
  const key = names.join("|");
  const data = [xs, ...series];
  const width = Math.max(300, box.clientWidth - 10);
  if (!charts[id] || charts[id].key !== key) {
    if (charts[id]) charts[id].plot.destroy();
    const palette = ["#2563eb", "#16a34a", "#dc2626", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
      "#9333ea", "#475569"];
    const opts = {
      width, height: 220, title,
      scales: { x: { time: false } },
      axes: [{ label: "step (round)", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] },
        { values: (u, v) => v.map(format), size: 70 }],
      series: [{ label: "step" }, ...names.map((name, i) => ({
        label: name, stroke: palette[i % palette.length], width: 2, spanGaps: false,
        value: (u, v) => (v === null || v === undefined ? "–" : format(v)),
      }))],
    };
    charts[id] = { key, plot: new uPlot(opts, data, box) };
  } else {
    charts[id].plot.setData(data);
  }
}

// each metric's mean over the devices that reported it a number (as live.json's device_means)
function deviceMeans(metrics) {
  const sums = {};
  const counts = {};
  for (const m of Object.values(metrics)) {
    for (const [k, v] of Object.entries(m)) {
      if (typeof v !== "number") continue;
      sums[k] = (sums[k] || 0) + v;
      counts[k] = (counts[k] || 0) + 1;
    }
  }
  return Object.fromEntries(Object.keys(sums).map((k) => [k, sums[k] / counts[k]]));
}

function drawCharts(run) {
  const history = run.history || [];
  const xs = history.map((_, i) => i + 1);
  const tasks = history.reduce((n, e) => Math.max(n, e.accuracy.length), 0);
  if (history.length) {
    const names = [...Array(tasks).keys()].map((t) => "task " + t);
    const series = names.map((_, t) => history.map((e) => (t < e.accuracy.length ? e.accuracy[t] : null)));
    lineChart("curves", "", names, xs, series, (v) => (100 * v).toFixed(0) + "%");
    const traffic = ["bytes_sent", "bytes_received"];
    if (history.some((e) => e.bytes_sent !== undefined)) {
      lineChart("traffic-chart", "", ["coordinator sent", "coordinator received"], xs,
        traffic.map((k) => history.map((e) => (e[k] === undefined ? null : e[k] / 1048576))), (v) => v.toFixed(1) + " MiB");
    }
  }
  document.getElementById("traffic").textContent = "sent " + bytes(run.bytes_sent) + " · received " +
    bytes(run.bytes_received) + " · reconnects " + (run.reconnects || 0);
  // the method's own numbers: the rule's (coordinator side), and the mean over the devices of what their policy
  // reports beside the daemon's standard metrics (a detector's signal, a generator's progress, Re-Fed's PIM drift)
  const ruleNames = [...new Set(history.flatMap((e) => Object.entries(e.rule_metrics || {})
    .filter(([, v]) => typeof v === "number").map(([k]) => k)))].sort();
  // live.json gives each round's device means (device_means); results.json, each device's metrics
  const means = history.map((e) => e.device_means || deviceMeans(e.metrics || {}));
  const deviceNames = [...new Set(means.flatMap((m) => Object.keys(m).filter((k) => !STANDARD_METRICS.has(k))))]
    .sort();
  const names = [...ruleNames.map((k) => "rule: " + k), ...deviceNames.map((k) => "devices' mean: " + k)];
  document.getElementById("method-none").hidden = names.length > 0;
  if (names.length) {
    const ruleSeries = ruleNames.map((k) => history.map((e) => {
      const v = (e.rule_metrics || {})[k];
      return typeof v === "number" ? v : null;
    }));
    const deviceSeries = deviceNames.map((k) => means.map((m) => (typeof m[k] === "number" ? m[k] : null)));
    lineChart("method", "", names, xs, [...ruleSeries, ...deviceSeries],
      (v) => (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3)));
  }
}

function drawSettings(view, run) {
  const rows = [];
  const add = (name, value) => {
    if (value === undefined || value === null || value === "") return;
    const tr = el("tr");
    tr.append(el("th", name), el("td", typeof value === "object" ? JSON.stringify(value) : value));
    rows.push(tr);
  };
  const fleet = view.fleet || {};
  const scenario = run.scenario || {};
  add("scenario", scenario.preset || [scenario.dataset, scenario.kind, scenario.n_tasks && scenario.n_tasks + " tasks",
    scenario.n_clients && scenario.n_clients + " clients"].filter(Boolean).join(", ") || scenario.test_data);
  add("rule", run.strategy && run.strategy.name);
  add("policy", fleet.policy && fleet.policy.name);
  const store = fleet.store || {};
  add("budget M", [store.max_samples && store.max_samples + " samples", store.max_bytes && bytes(store.max_bytes)]
    .filter(Boolean).join(", "));
  add("rounds per task", run.settings && run.settings.rounds_per_task);
  const client = (run.settings && run.settings.client) || {};
  add("devices' round settings", Object.entries(client).map(([k, v]) => (k === "epochs" ? "E" : k) + " = " + v)
    .join(", "));
  const counted = {};
  (run.devices || []).forEach((d) => { counted[d.profile || "unknown"] = (counted[d.profile || "unknown"] || 0) + 1; });
  add("profiles", Object.entries(Object.keys(fleet.profiles || {}).length ? fleet.profiles : counted)
    .map(([name, n]) => n + " " + name).join(", "));
  replaceRows(document.querySelector("#settings tbody"), rows);
}

async function refresh() {
  try {
    const response = await fetch("/api/run" + (token ? "?token=" + encodeURIComponent(token) : ""),
      { cache: "no-store" });
    const view = await response.json();
    const run = view.run;
    drawHeader(view, run);
    if (run) {
      drawProgress(run);
      drawDevices(run);
      drawMatrix(run);
      drawRefusals(run);
      drawCharts(run);
      drawSettings(view, run);
    }
    document.body.dataset.loaded = "1";
  } catch (err) {
    document.getElementById("updated").textContent = "cannot reach the dashboard: " + err;
  } finally {
    setTimeout(refresh, refreshMs);
  }
}

refresh();
