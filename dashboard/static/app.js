// The dashboard page: polls the JSON API and redraws. No framework, no CDN: it works offline.
"use strict";

const REFRESH_MS = 3000;
// the peer table is one page of /api/run's peers, sorted by the server: a run of 1,000 peers draws 50 rows
const PAGE_SIZE = 50;
const table = { offset: 0, limit: PAGE_SIZE, sort: "peer_id", order: "asc" };
let requests = 0;  // a slow answer to an older request must not overwrite a newer page
const $ = (id) => document.getElementById(id);
const finite = (x) => typeof x === "number" && Number.isFinite(x);
const fmt = (x, digits = 1) => (finite(x) ? x.toFixed(digits) : "–");

function duration(seconds) {
  if (!finite(seconds)) return "–";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function text(el, value) { el.textContent = value; }

function epochCell(p) {
  if (finite(p.merges_per_minute)) {
    // gossip: how often it merges, how far the last merge moved it, how far it is from the replicas' mean
    const far = finite(p.distance_to_mean) ? `, ${fmt(100 * p.distance_to_mean, 2)}% from mean` : "";
    return `${p.epoch} (${fmt(p.merges_per_minute, 0)} merges/min, last |Δ| ${fmt(p.merge_update_norm, 3)}${far})`;
  }
  if (!finite(p.inner_steps)) return p.epoch;
  const norm = finite(p.pseudo_gradient_norm) ? `, last |Δ| ${fmt(p.pseudo_gradient_norm, 3)}` : "";
  return `${p.epoch} (+${p.inner_steps} inner${norm})`;
}

function renderRun(run) {
  text($("run-id"), run.run_id);
  text($("epoch"), run.global_epoch);
  // diloco: an epoch is an outer step; each peer shows its inner steps since and its last pseudo-gradient's norm
  // gossip: no global step; the epoch counts the swarm's samples, and the replicas' spread says how close they are
  const spread = finite(run.replica_spread) ? `, replicas within ${fmt(100 * run.replica_spread, 2)}%` : "";
  text($("epoch-label"), run.mode === "diloco" ? "outer step (diloco)"
    : run.mode === "gossip" ? `epoch (gossip${spread})` : "global epoch");
  const target = run.target_batch_size;
  const done = finite(target) && target > 0 ? Math.min(1, Math.max(0, run.samples_accumulated / target)) : 0;
  $("progress-fill").style.width = `${(done * 100).toFixed(1)}%`;
  text($("progress-text"), finite(target) ? `${run.samples_accumulated} / ${target} samples` : "");
  text($("eta"), duration(run.eta_seconds));
  // counted by the server over every peer, not over the page shown
  text($("peers-online"), finite(run.peers_online) ? run.peers_online : run.peers.filter((p) => p.online).length);
  text($("sps"), fmt(run.samples_per_second));
  text($("rejected"), run.rejected_records);
  // B_noise against the target: the number a researcher would tune the target batch by
  const noise = run.noise_scale;
  text($("noise-scale"), finite(noise) ? `${fmt(noise, 0)} samples` : "not measured yet");
  $("noise-scale").title = finite(noise) && finite(target) && target > 0
    ? `${fmt(noise / target, 2)}x the target batch of ${target}; from ${run.noise_scale_peers} peer(s)` : "";
  // goodput (Pollux) and the schedule in scale-invariant steps (collab.adaptive.batch_plan)
  text($("goodput"), finite(run.goodput) ? `${fmt(run.goodput)} samples/s` : "not measured yet");
  $("goodput").title = finite(run.efficiency)
    ? `${fmt(run.samples_per_second)} samples/s x efficiency ${fmt(run.efficiency, 2)} at target ${target} (base batch ${run.base_batch_size})` : "";
  text($("schedule"), finite(run.progress_steps)
    ? `${fmt(run.progress_steps, 1)} / ${run.total_steps} steps` + (finite(run.lr_gain) ? `, lr gain ${fmt(run.lr_gain, 2)}` : "")
      + (finite(run.eta_to_end_seconds) ? `, ends in ${duration(run.eta_to_end_seconds)}` : "")
    : "–");
  // why, so an organizer can tell a forged-id attack from a peer on an old version
  $("rejected").title = Object.entries(run.rejected_by_reason || {}).map(([why, n]) => `${n}: ${why}`).join("\n");
  text($("status"), `updated ${new Date(run.time * 1000).toLocaleTimeString()}`);

  renderPager(run);
  const body = $("peers").querySelector("tbody");
  body.replaceChildren(...run.peers.map((p) => {
    const row = document.createElement("tr");
    row.dataset.peerId = p.peer_id;
    row.className = p.suspect ? "suspect" : !p.online ? "stale" : p.straggler ? "straggler" : "";
    const state = p.suspect ? "suspect" : !p.online ? "stale"
      : p.straggler ? `straggler${p.straggler_reason ? ` (${p.straggler_reason.split(":")[0]})` : ""}` : "online";
    const refused = p.contributions_rejected ? `${p.contributions_rejected} (by ${p.reported_by})` : "0";
    const cells = [p.peer_id.slice(-10), p.client_mode ? "client / NAT" : "full", fmt(p.samples_per_second),
      `${fmt(100 * p.contribution, 0)}%`, fmt(p.loss, 3), epochCell(p), traffic(p), `${duration(p.last_seen)} ago`, refused,
      state];
    for (const value of cells) {
      const cell = document.createElement("td");
      cell.textContent = value;
      row.appendChild(cell);
    }
    // and, in a run with token shards, where it reads them: with the shard list, exactly which text it trained on
    row.firstChild.title = p.peer_id + (finite(p.data_start)
      ? `\ndata: entered the ring of shards at ${fmt(p.data_start, 4)}, ${p.data_position} windows read` : "");
    // what was refused, and why: a clipped part (odd data, or an attack) reads differently from a NaN
    row.children[8].title = Object.entries(p.rejected_by_reason || {}).map(([why, n]) => `${n}: ${why}`).join("\n")
      + (p.batches_dropped ? `\nits own dropped micro-batches: ${p.batches_dropped}` : "");
    row.lastChild.title = p.straggler_reason || "";  // the whole reason: compute or link, with its numbers
    return row;
  }));

  // over every peer (the server ranks them), not over the page shown
  const ranked = run.leaderboard
    || [...run.peers].sort((a, b) => b.samples_contributed - a.samples_contributed).slice(0, 10);
  text($("leaderboard-of"), finite(run.peers_total) ? `of ${run.peers_total.toLocaleString()} peers` : "");
  $("leaderboard").replaceChildren(...ranked.map((p) => {
    const item = document.createElement("li");
    item.textContent = `${p.peer_id.slice(-10)} — ${p.samples_contributed} samples`;
    return item;
  }));
}

// "showing 51-100 of 1,000", the buttons, and the column the rows are sorted by
function renderPager(run) {
  const page = run.page || { offset: 0, limit: run.peers.length, total: run.peers.length };
  const shown = run.peers.length;
  const [from, to, total] = [page.offset + 1, page.offset + shown, page.total].map((n) => n.toLocaleString());
  text($("peers-range"), shown ? `showing ${from}-${to} of ${total}` : `showing 0 of ${total}`);
  $("peers-prev").disabled = page.offset <= 0;
  $("peers-next").disabled = page.offset + shown >= page.total;
  text($("peers-not-listed"), run.peers_not_listed > 0
    ? `${run.peers_not_listed.toLocaleString()} more peers are counted above but not listed: the dashboard lists the `
      + `${run.peers_cap.toLocaleString()} most recently seen` : "");
  for (const th of $("peers").querySelectorAll("th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === table.sort);
    th.classList.toggle("asc", th.dataset.sort === table.sort && table.order === "asc");
    th.classList.toggle("desc", th.dataset.sort === table.sort && table.order === "desc");
  }
}

function turnPage(step) {
  table.offset = Math.max(0, table.offset + step * table.limit);
  refresh();
}

function sortBy(column) {
  // a second click reverses the order; a new column starts with what a reader looks for first: the largest
  // numbers, but the lowest loss, the most recently seen, the most alarming state, and ids from the start
  table.order = column === table.sort ? (table.order === "asc" ? "desc" : "asc")
    : ["peer_id", "loss", "state", "last_seen"].includes(column) ? "asc" : "desc";
  table.sort = column;
  table.offset = 0;
  refresh();
}

// MB per gradient round and, in brackets, how many times fewer bytes than fp32 ("-" before its first round)
function traffic(p) {
  if (!finite(p.mb_per_round)) return "-";
  return fmt(p.mb_per_round, 2) + (finite(p.fewer_bytes_than_fp32) ? ` (${fmt(p.fewer_bytes_than_fp32, 1)}x)` : "");
}

// A line chart in plain SVG. Non-finite values are gaps; the scale ignores them, so one absurd
// value cannot flatten the chart (the API already rejects NaN and 1e30 at the schema).
function drawChart(svg, points, key) {
  const values = points.map((p) => (finite(p[key]) ? p[key] : null));
  const present = values.filter((v) => v !== null);
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  if (present.length < 2) return;
  const [w, h, pad] = [400, 140, 18];
  let lo = Math.min(...present), hi = Math.max(...present);
  if (hi === lo) { hi += 1; lo -= 1; }
  const x = (i) => pad + (i / (values.length - 1)) * (w - 2 * pad);
  const y = (v) => h - pad - ((v - lo) / (hi - lo)) * (h - 2 * pad);
  let d = "", pen = "M";
  values.forEach((v, i) => {
    if (v === null) { pen = "M"; return; }
    d += `${pen}${x(i).toFixed(1)},${y(v).toFixed(1)} `;
    pen = "L";
  });
  const path = document.createElementNS(ns, "path");
  path.setAttribute("class", "line");
  path.setAttribute("d", d.trim());
  svg.appendChild(path);
  for (const [v, yy] of [[hi, pad - 4], [lo, h - 4]]) {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("class", "axis");
    label.setAttribute("x", 2);
    label.setAttribute("y", yy + 8);
    label.textContent = Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(2);
    svg.appendChild(label);
  }
}

async function refresh() {
  try {
    const ticket = ++requests;
    const [runResponse, historyResponse] = await Promise.all([
      fetch(`/api/run?${new URLSearchParams(table)}`), fetch("/api/history")]);
    if (ticket !== requests) return;
    if (runResponse.ok) {
      const run = await runResponse.json();
      const total = run.page ? run.page.total : run.peers.length;
      if (run.peers.length === 0 && table.offset > 0 && total > 0) {  // peers left: back to the last page
        table.offset = Math.floor((total - 1) / table.limit) * table.limit;
        refresh();
        return;
      }
      renderRun(run);
    } else text($("status"), (await runResponse.json()).detail || `HTTP ${runResponse.status}`);
    if (historyResponse.ok) {
      const history = await historyResponse.json();
      drawChart($("chart-loss"), history.points, "loss");
      drawChart($("chart-sps"), history.points, "samples_per_second");
      drawChart($("chart-peers"), history.points, "peers_online");
      drawChart($("chart-noise"), history.points, "noise_scale");
      drawChart($("chart-goodput"), history.points, "goodput");
    }
  } catch (error) {
    text($("status"), `dashboard unreachable: ${error}`);
  }
}

$("peers-prev").addEventListener("click", () => turnPage(-1));
$("peers-next").addEventListener("click", () => turnPage(1));
for (const th of $("peers").querySelectorAll("th[data-sort]")) {
  th.addEventListener("click", () => sortBy(th.dataset.sort));
}
refresh();
setInterval(refresh, REFRESH_MS);
