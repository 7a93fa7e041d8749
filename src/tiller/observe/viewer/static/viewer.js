// tiller view: a single page over the /api routes (src/tiller/observe/viewer/app.py).
// Routes live in the URL hash, so every view (a filtered list, an episode) is a link:
//   #/episodes?status=env_error&offset=50   #/episode/ID   #/group/ID   #/curves
"use strict";

const main = document.getElementById("main");
const PAGE = 50;
const FILTERS = ["phase", "status", "step_min", "step_max", "reward_min", "reward_max",
  "env_error", "tool_errors_min", "tokens_min", "tokens_max", "trained", "q", "order", "desc"];
const STATUSES = ["completed", "truncated", "aborted", "env_error"];
const ORDERS = ["id", "rl_step", "reward", "n_tokens", "n_generated", "tool_calls", "tool_errors"];
let run = null;
let lastList = "#/episodes";

// ---------------------------------------------------------------- helpers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

async function api(path) {
  const response = await fetch(path);
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    throw new Error(`${path}: HTTP ${response.status}: ${detail}`);
  }
  return body;
}

function showError(e) {
  const box = document.getElementById("error");
  box.hidden = false;
  box.textContent = String(e.message || e);
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "n/a";
  if (typeof v === "number" && !Number.isInteger(v)) return v.toPrecision(digits);
  return String(v);
}

function table(headers, rows, attrs = {}) {
  return el("table", attrs,
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))),
    el("tbody", {}, rows));
}

function facts(pairs) {
  return el("table", { class: "facts" },
    pairs.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", {}, v))));
}

// ---------------------------------------------------------------- the episode list

function filterForm(params) {
  const input = (name, label, type = "number", step = "any") =>
    el("label", {}, label, el("input", { name, type, step, value: params.get(name) ?? "" }));
  const select = (name, label, options) => {
    const s = el("select", { name },
      options.map(([value, text]) => el("option", { value, text })));
    s.value = params.get(name) ?? "";
    return el("label", {}, label, s);
  };
  const phases = Object.entries(run.phases).map(([p, n]) => [p, `${p} (${n})`]);
  const statuses = STATUSES.map((s) => [s, `${s} (${run.statuses[s] ?? 0})`]);
  const yesNo = [["", "any"], ["true", "yes"], ["false", "no"]];
  const form = el("form", { id: "filters" },
    select("phase", "phase", [["", "any"], ...phases]),
    select("status", "status", [["", "any"], ...statuses]),
    input("step_min", "RL step from", "number", "1"), input("step_max", "to", "number", "1"),
    input("reward_min", "reward from"), input("reward_max", "to"),
    select("env_error", "env_error", yesNo),
    input("tool_errors_min", "tool errors at least", "number", "1"),
    input("tokens_min", "tokens from", "number", "1"), input("tokens_max", "to", "number", "1"),
    select("trained", "trained", yesNo),
    el("label", {}, "search (task id, conversation)",
      el("input", { name: "q", type: "search", value: params.get("q") ?? "", size: 24 })),
    select("order", "order by", ORDERS.map((o) => [o, o])),
    select("desc", "direction", [["", "ascending"], ["true", "descending"]]),
    el("button", { type: "submit", id: "apply" }, "apply"),
    el("button", { type: "button", id: "reset", onclick: () => { location.hash = "#/episodes"; } },
      "reset"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const next = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v !== "" && !(k === "order" && v === "id")) next.set(k, v);
    location.hash = `#/episodes?${next}`;
  });
  return form;
}

async function showList(params) {
  lastList = location.hash || "#/episodes";
  const query = new URLSearchParams();
  for (const k of FILTERS) if (params.get(k)) query.set(k, params.get(k));
  const offset = Number(params.get("offset") || 0);
  query.set("offset", offset);
  query.set("limit", PAGE);
  const page = await api(`/api/episodes?${query}`);
  const rows = page.episodes.map((e) =>
    el("tr", { "data-id": e.id, onclick: () => { location.hash = `#/episode/${e.id}`; } },
      el("td", {}, el("a", { href: `#/episode/${e.id}`, text: e.id })),
      el("td", { text: e.phase }), el("td", { text: fmt(e.rl_step) }),
      el("td", { text: e.task_id }), el("td", { text: e.sample_index }),
      el("td", { class: `status-${e.status}`, text: e.status }),
      el("td", { text: fmt(e.reward) }), el("td", { text: e.env_error ? "yes" : "" }),
      el("td", { text: e.n_tokens }), el("td", { text: e.n_generated }),
      el("td", { text: e.n_turns }), el("td", { text: e.tool_calls }),
      el("td", { text: e.tool_errors || "" }),
      el("td", { text: e.trained_step === null ? "" : e.trained_step })));
  const to = (o) => { const p = new URLSearchParams(params); p.set("offset", o); return `#/episodes?${p}`; };
  const last = Math.min(offset + page.episodes.length, page.total);
  const pager = el("div", { class: "pager" },
    el("button", { id: "prev", disabled: offset === 0 ? "" : null,
      onclick: () => { location.hash = to(Math.max(offset - PAGE, 0)); } }, "previous"),
    el("span", { id: "page-info", text: page.total ? `${offset + 1}-${last} of ${page.total}` : "no episode matches" }),
    el("button", { id: "next", disabled: last >= page.total ? "" : null,
      onclick: () => { location.hash = to(offset + PAGE); } }, "next"));
  main.replaceChildren(
    filterForm(params), pager,
    table(["id", "phase", "RL step", "task", "sample", "status", "reward", "env_error",
      "tokens", "generated", "turns", "tool calls", "tool errors", "trained at"], rows,
    { id: "episodes", "data-total": page.total }));
}

// ---------------------------------------------------------------- one episode

function conversation(messages, calls) {
  // tool calls by assistant turn: the turn's results sit under the call that asked for them
  return el("div", { class: "conversation" }, messages.map((m) => {
    const extra = Object.fromEntries(Object.entries(m).filter(([k]) => k !== "role" && k !== "content"));
    const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content, null, 1);
    return el("div", { class: `msg role-${m.role}` },
      el("div", { class: "role", text: m.role }),
      el("pre", { text: content }),
      Object.keys(extra).length ? el("pre", { class: "muted", text: JSON.stringify(extra, null, 1) }) : null);
  }), calls && calls.length ? toolCalls(calls) : null);
}

function toolCalls(calls) {
  return table(["turn", "#", "tool", "arguments", "result", "outcome", "latency s"],
    calls.map((c) => el("tr", {},
      el("td", { text: c.turn }), el("td", { text: c.idx }), el("td", { text: c.name }),
      el("td", {}, el("code", { text: JSON.stringify(c.arguments) })),
      el("td", {}, el("code", { text: c.result })),
      el("td", { class: `outcome-${c.outcome}`, text: c.outcome }),
      el("td", { text: c.latency_s === undefined ? "" : fmt(c.latency_s, 2) }))),
    { class: "tool-calls" });
}

function advantageColour(a, scale) {
  if (a === null || a === undefined || scale === 0) return "";
  const alpha = Math.min(Math.abs(a) / scale, 1) * 0.6;
  return a >= 0 ? `rgba(27,127,59,${alpha})` : `rgba(180,35,24,${alpha})`;
}

function tokenStrip(ep, threshold) {
  const a = ep.arrays;
  const scale = Math.max(0, ...(a.advantages || []).map((x) => Math.abs(x ?? 0)));
  let flagged = 0;
  const spans = a.token_ids.map((id, i) => {
    const mask = a.loss_mask[i];
    const train = a.train_mask ? a.train_mask[i] : null;
    const rollout = a.logprobs[i];
    const trainer = a.trainer_logprobs ? a.trainer_logprobs[i] : null;
    // the trainer's logprobs are scored on the train mask only (0 off it: "dropped" tokens)
    const scored = train === null ? mask : train;
    const delta = scored && trainer !== null && rollout !== null ? Math.abs(rollout - trainer) : null;
    const flag = delta !== null && delta > threshold;
    flagged += flag;
    const adv = a.advantages ? a.advantages[i] : null;
    const text = a.text[i].replace(/\n/g, "\u21b5\n");
    return el("span", {
      class: "tok", "data-i": i, "data-mask": mask, "data-train": train,
      "data-flag": flag ? 1 : 0,
      style: mask && train !== 0 && adv !== null ? `background:${advantageColour(adv, scale)}` : null,
      title: `#${i} id ${id} ${JSON.stringify(a.text[i])}\nloss_mask ${mask}` +
        (train === null ? "" : `  train_mask ${train}`) +
        (scored ? `\nlogp rollout ${fmt(rollout, 5)}  trainer ${fmt(trainer, 5)}  |diff| ${fmt(delta, 3)}` : "") +
        (adv === null ? "" : `\nadvantage ${fmt(adv, 4)}`) +
        (a.token_versions[i] >= 0 ? `\nweight version ${a.token_versions[i]}` : ""),
    }, text);
  });
  const legend = el("div", { class: "legend" },
    el("span", {}, el("span", { class: "tok", "data-mask": "0" }, "context"), " loss mask 0 (prompt, tool output, template)"),
    el("span", {}, el("span", { class: "tok", "data-mask": "1" }, "generated"), " loss mask 1, shaded green/red by advantage"),
    el("span", {}, el("span", { class: "tok", "data-mask": "1", "data-train": "0" }, "dropped"), " generated but masked out of the loss"),
    el("span", {}, el("span", { class: "tok", "data-flag": "1" }, "flag"), " |logp rollout - logp trainer| > threshold"));
  const note = ep.trained_step !== null
    ? `trained at RL step ${ep.trained_step}; advantages up to ${fmt(scale)} in magnitude`
    : ep.at_end
      ? "not trained: the end of RL left it (at_end: its group was running or waiting for a step): no advantages, no trainer logprobs"
      : "not trained (an eval episode, or trained before traces of it were written): no advantages, no trainer logprobs";
  return el("div", {},
    legend, el("p", { class: "muted", id: "strip-note" }, `${note}; ${flagged} token(s) flagged`),
    el("div", { id: "token-strip", "data-flagged": flagged }, spans));
}

async function showEpisode(id, params) {
  const ep = await api(`/api/episodes/${id}`);
  const threshold = Number(params.get("threshold") || 1e-3);
  const thresholdInput = el("input", { id: "threshold", type: "number", step: "any", value: threshold });
  thresholdInput.addEventListener("change", () => {
    location.hash = `#/episode/${id}?threshold=${thresholdInput.value}`;
  });
  main.replaceChildren(
    el("p", {}, el("a", { href: lastList, id: "back" }, "\u2190 episode list"), "  ",
      el("a", { href: `#/group/${id}`, id: "group-link" }, "its group side by side")),
    el("h2", { text: `Episode ${ep.id}: ${ep.task_id} sample ${ep.sample_index}` }),
    facts([
      ["phase / split", `${ep.phase} / ${ep.split}`], ["RL step", fmt(ep.rl_step)],
      ["status", el("span", { class: `status-${ep.status}`, text: ep.status })],
      ["reward", fmt(ep.reward)], ["checks", JSON.stringify(ep.checks)],
      ["env_error", ep.env_error ? "yes" : "no"],
      ["tokens (generated)", `${ep.n_tokens} (${ep.n_generated}), prompt ${ep.prompt_len}`],
      ["turns", ep.n_turns], ["tool calls (errors)", `${ep.tool_calls} (${ep.tool_errors})`],
      ["weight versions", JSON.stringify(ep.versions)], ["seed", fmt(ep.seed)],
      ["sampled as (tag, draw)", `${JSON.stringify(ep.tag)}, draw ${ep.draw}`],
      ["info", JSON.stringify(ep.info)]]),
    el("h3", { text: "Conversation" }), conversation(ep.messages, ep.tool_calls_list),
    el("h3", { text: "Tokens" }),
    el("label", {}, "flag threshold ", thresholdInput),
    tokenStrip(ep, threshold));
}

// ---------------------------------------------------------------- a group side by side

async function showGroup(id) {
  const { members } = await api(`/api/episodes/${id}/group`);
  // the rewarded members: the best reward, when the group's rewards differ at all
  const best = Math.max(...members.map((m) => m.reward));
  const spread = best > Math.min(...members.map((m) => m.reward));
  const checks = [...new Set(members.flatMap((m) => Object.keys(m.checks)))].sort();
  const rows = [
    ["reward", (m) => fmt(m.reward)], ["status", (m) => m.status],
    ["tool calls", (m) => m.tool_calls], ["tool errors", (m) => m.tool_errors],
    ["turns", (m) => m.n_turns], ["generated tokens", (m) => m.n_generated],
    ...checks.map((c) => [`check: ${c}`, (m) => fmt(m.checks[c])]),
  ].map(([name, get]) => {
    const values = members.map(get);
    return el("tr", { class: new Set(values).size > 1 ? "differs" : "" },
      el("th", { text: name }), values.map((v) => el("td", { text: v })));
  });
  const first = members[0];
  main.replaceChildren(
    el("p", {}, el("a", { href: `#/episode/${id}` }, "\u2190 episode"), "  ",
      el("a", { href: lastList }, "episode list")),
    el("h2", { text: `Group of ${first.task_id}, draw ${first.draw} (${first.phase}, RL step ${fmt(first.rl_step)}): ${members.length} episodes` }),
    el("p", { class: "muted", text: "Rows that differ between the members are highlighted; the best-rewarded members (when rewards differ) have a green border." }),
    table(["", ...members.map((m) => `#${m.id} (sample ${m.sample_index})`)], rows, { id: "group-compare" }),
    el("div", { class: "group" }, members.map((m) =>
      el("div", { class: `member${spread && m.reward === best ? " rewarded" : ""}${m.id === Number(id) ? " current" : ""}`, "data-id": m.id },
        el("h4", {}, el("a", { href: `#/episode/${m.id}`, text: `episode ${m.id}` }),
          ` reward ${fmt(m.reward)}, ${m.status}`),
        conversation(m.messages.filter((x) => x.role !== "system"), m.tool_calls_list)))));
}

// ---------------------------------------------------------------- learning curves

function lineChart(title, xs, ys) {
  const W = 320, H = 170, L = 46, B = 22, T = 8, R = 8;
  const pts = xs.map((x, i) => [x, ys[i]]).filter(([x, y]) => x !== null && y !== null);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const add = (tag, attrs, text) => {
    const n = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n);
  };
  if (pts.length) {
    const [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    add("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" });
    add("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#999" });
    add("text", { x: 2, y: T + 8, "font-size": 10 }, fmt(y1));
    add("text", { x: 2, y: H - B, "font-size": 10 }, fmt(y0));
    add("text", { x: L, y: H - 6, "font-size": 10 }, `step ${x0}`);
    add("text", { x: W - R - 40, y: H - 6, "font-size": 10 }, `step ${x1}`);
    add("polyline", { fill: "none", stroke: "#4c78a8", "stroke-width": 1.5,
      points: pts.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" ") });
    for (const [x, y] of pts) {
      add("circle", { cx: sx(x), cy: sy(y), r: 2.5, fill: "#4c78a8" });
    }
  }
  return el("div", { class: "chart", "data-metric": title, "data-points": pts.length },
    el("h4", { text: title }), svg);
}

async function showCurves() {
  const c = await api("/api/curves");
  const evals = c.evals.map((e) => el("tr", {},
    el("td", { text: e.label }), el("td", { text: fmt(e.success) }),
    el("td", { text: `[${fmt(e.ci_low)}, ${fmt(e.ci_high)}]` }),
    el("td", { text: e.tasks }), el("td", { text: e.samples })));
  main.replaceChildren(
    el("h2", { text: "Held-out success" }),
    evals.length ? table(["phase", "pass@1", "95% CI", "tasks", "samples"], evals)
      : el("p", { class: "muted", text: "No held-out evaluation logged yet." }),
    el("h2", { text: "RL learning curves" }),
    c.steps.length ? el("div", { class: "charts" },
      Object.entries(c.series).map(([k, ys]) => lineChart(k, c.steps, ys)))
      : el("p", { class: "muted", text: "No RL step logged yet." }));
}

// ---------------------------------------------------------------- routing

async function route() {
  document.getElementById("error").hidden = true;
  main.dataset.view = "loading";
  const [path, query] = (location.hash.slice(1) || "/episodes").split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean);
  try {
    if (run === null) {
      run = await api("/api/run");
      document.getElementById("run-name").textContent = `${run.name}: ${run.total} episodes`;
    }
    if (parts[0] === "episode") await showEpisode(parts[1], params);
    else if (parts[0] === "group") await showGroup(parts[1]);
    else if (parts[0] === "curves") await showCurves();
    else await showList(params);
    main.dataset.view = parts[0] || "episodes";
  } catch (e) {
    showError(e);
  }
}

window.addEventListener("hashchange", route);
route();
