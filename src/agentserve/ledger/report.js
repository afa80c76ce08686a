"use strict";
// The ledger report page. It reads the JSON in #report-data (layout: ledger/html.py), fills the
// fleet table side by side per run, lists the skipped ledger lines, and keeps only one page of
// the trajectory list in the DOM (filtered, sorted, paged), so 1,000s of trajectories stay fast.
// The selected trajectory's waterfall is drawn on demand on one canvas. Every string from the
// ledger reaches the page through textContent (or canvas fillText), never as markup.
(function () {
  const D = JSON.parse(document.getElementById("report-data").textContent);
  const S = D.strings, T = D.traj, R = D.rows, C = D.colors;
  const NT = T.id.length;
  const PAGE = 50; // trajectories per page of the list
  const MAX_ATTEMPTS = 2000; // drawn per waterfall; the page says how many more there were
  const SEGMENTS = ["device", "host", "disk", "fresh", "recomputed", "generated"];
  const state = {query: "", run: -1, key: "tokens", desc: true, page: 0, order: [], selected: -1};

  // ---- helpers
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmtInt(n) {
    if (n === null || n === undefined) return "\u2014";
    return String(Math.round(n)).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  }
  function absent(x) { return x === null || x === undefined; }
  function fmtPct(x) { return absent(x) ? "\u2014" : (100 * x).toFixed(1) + "%"; }
  function fmtCost(x) {
    if (x === null || x === undefined) return "\u2014";
    const a = Math.abs(x);
    const v = a >= 1 ? x.toFixed(2) : a >= 0.01 ? x.toFixed(4) : x.toPrecision(3);
    return v + " " + D.currency;
  }
  function fmtS(x) {
    if (x === null || x === undefined) return "\u2014";
    return x < 10 ? x.toFixed(3) + " s" : x < 1000 ? x.toFixed(1) + " s" : fmtInt(x) + " s";
  }
  function fmtX(x) { return absent(x) || x === 0 ? "\u2014" : x.toFixed(2) + "\u00d7"; }
  function fmtOutcome(o) { return o === true ? "success" : o === false ? "failure" : "\u2014"; }
  function parentId(i) { return T.parent[i] === null ? "" : T.id[T.parent[i]]; }
  function str(i) { return i === null || i === undefined ? null : S[i]; }
  function row(cells, cls) {
    const tr = el("tr", cls);
    for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", "", c));
    return tr;
  }
  function td(text, cls) { return el("td", cls || "", text); }
  function attemptLabel(j) { return "t" + R.turn[j] + "." + R.attempt[j]; }
  function fresh(j) { return R.prompt[j] - R.device[j] - R.host[j] - R.disk[j]; }
  function missText(j) {
    const reason = str(R.miss[j]);
    if (reason === null) return "";
    if (reason === "evicted") {
      const policy = str(R.policy[j]);
      return "evicted (" + (str(R.cause[j]) || "unknown") + (policy ? ", " + policy : "") + ")";
    }
    if (reason === "diverged") {
      let s = "diverged at token " + R.token[j];
      if (R.exact[j] === 0) s += " (block " + R.block[j] + ", inexact)";
      if (R.message[j] !== null) s += ", message " + R.message[j];
      const role = str(R.role[j]);
      if (role) s += " (" + role + ")";
      return s;
    }
    return reason + " at block " + R.block[j];
  }

  // ---- fleet summary, side by side per run
  function renderFleet() {
    const p = D.prices;
    document.getElementById("prices").textContent = "Prices: " + p.name + " (" + D.currency +
      "; per million tokens: fresh input " + p.fresh_input_per_mtok + ", cached input " +
      p.cached_input_per_mtok + ", output " + p.output_per_mtok + "; accelerator per hour " +
      p.accelerator_per_hour + ")";
    const runs = D.runs;
    const table = el("table");
    table.id = "fleet-table";
    const head = row([el("th", "l", "")]);
    for (const r of runs) {
      const th = head.appendChild(el("th", "", r.label));
      th.title = r.path;
    }
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    const line = (name, f, key) => {
      const tr = row([td(name, "l")]);
      if (key) tr.dataset.key = key;
      for (const r of runs) tr.appendChild(td(f(r, r.summary, r.summary.totals)));
      body.appendChild(tr);
    };
    const tierPct = (t, tier) => fmtInt(t.reused_tokens_by_tier[tier]) + " (" +
      fmtPct(t.prompt_tokens ? t.reused_tokens_by_tier[tier] / t.prompt_tokens : 0) + ")";
    const pair = (a, b) => a + " / " + b;
    line("ledger rows / skipped lines", r => pair(fmtInt(r.rows), fmtInt(r.num_problems)), "rows");
    line("trajectories / tasks / sessions", (r, s) => fmtInt(s.trajectories) + " / " +
      fmtInt(s.tasks) + " / " + fmtInt(s.sessions), "trajectories");
    line("prompt tokens P", (r, s, t) => fmtInt(t.prompt_tokens), "prompt");
    for (const tier of ["device", "host", "disk"]) {
      line("reused from " + tier, (r, s, t) => tierPct(t, tier), "reused_" + tier);
    }
    line("fresh U = P \u2212 H", (r, s, t) => fmtInt(t.fresh_tokens), "fresh");
    line("generated O", (r, s, t) => fmtInt(t.generated_tokens), "generated");
    line("recomputed (preemption)", (r, s, t) => fmtInt(t.recomputed_tokens), "recomputed");
    line("reuse ratio H / P", (r, s, t) => fmtPct(t.reuse_ratio), "reuse_ratio");
    line("rebuild tax", (r, s, t) => fmtPct(t.rebuild_tax), "rebuild_tax");
    line("cost", (r, s, t) => fmtCost(t.cost), "cost");
    line("cost per success", (r, s) => fmtCost(s.cost_per_success), "cost_per_success");
    line("successes / failures", (r, s) => pair(fmtInt(s.successes), fmtInt(s.failures)),
      "outcomes");
    line("JCT p50 / p99 (tasks)", r => fmtS(r.jct_p50_s) + " / " + fmtS(r.jct_p99_s), "jct");
    line("fan-out amplification mean / max", (r, s) => fmtX(s.fanout_amplification_mean) + " / " +
      fmtX(r.fanout_max), "fanout");
    const reasons = [];
    for (const r of runs) {
      for (const k of Object.keys(r.summary.misses)) if (!reasons.includes(k)) reasons.push(k);
    }
    for (const k of reasons) line("miss: " + k, (r, s) => fmtInt(s.misses[k] || 0), "miss");
    line("outcomes for unseen trajectories", (r, s) => fmtInt(s.unknown_outcomes.length),
      "unknown");
    document.getElementById("fleet").appendChild(table);
  }

  function renderProblems() {
    const box = document.getElementById("problems");
    for (const r of D.runs) {
      if (!r.num_problems) continue;
      const what = "Skipped ledger lines: " + r.label + " (" + fmtInt(r.num_problems) + ")";
      box.appendChild(el("h2", "bad", what));
      let text = r.problems.join("\n");
      if (r.num_problems > r.problems.length) {
        const more = r.num_problems - r.problems.length;
        text += "\n\u2026 and " + fmtInt(more) + " more (problems.txt)";
      }
      box.appendChild(el("pre", "problems", text));
    }
  }

  function renderPlots() {
    const box = document.getElementById("plots");
    const names = {reuse: "Prompt tokens by source, per run",
      reuse_over_time: "Prompt tokens over time",
      misses: "Miss reasons (first missed block per attempt)"};
    for (const [key, caption] of Object.entries(names)) {
      if (!D.images[key]) continue;
      const img = el("img");
      img.alt = caption;
      img.src = D.images[key];
      box.appendChild(el("div", "muted", caption));
      box.appendChild(img);
    }
    if (D.waterfalls.length) {
      const p = el("p", "muted", "Waterfall PNGs (top trajectories by tokens): ");
      for (const w of D.waterfalls) {
        const a = el("a", "", w.file);
        a.href = w.file; // a file name this report wrote, next to the page
        a.title = T.id[w.traj];
        p.appendChild(a);
        p.appendChild(document.createTextNode(" "));
      }
      box.appendChild(p);
    }
  }

  // ---- trajectory list
  const COLS = [
    {key: "run", name: "run", get: i => D.runs[T.run[i]].label, cls: "l", show: D.runs.length > 1},
    {key: "id", name: "trajectory", get: i => T.id[i], cls: "l id"},
    {key: "parent", name: "parent", get: parentId, cls: "l id"},
    {key: "turns", name: "turns", get: i => T.turns[i], fmt: fmtInt},
    {key: "attempts", name: "attempts", get: i => T.rows[i], fmt: fmtInt},
    {key: "tokens", name: "tokens P+O", get: i => T.prompt[i] + T.generated[i], fmt: fmtInt},
    {key: "reuse", name: "reused", fmt: fmtPct,
      get: i => T.prompt[i] ? (T.device[i] + T.host[i] + T.disk[i]) / T.prompt[i] : 0},
    {key: "rebuilt", name: "rebuilt", get: i => T.rebuilt[i], fmt: fmtInt},
    {key: "cost", name: "cost (+ sub-agents)", get: i => T.all_cost[i], fmt: fmtCost},
    {key: "jct", name: "JCT", get: i => T.jct_s[i], fmt: fmtS},
    {key: "outcome", name: "outcome", get: i => T.outcome[i] === null ? null : T.outcome[i] ? 1 : 0,
      fmt: v => fmtOutcome(v === null ? null : v === 1), cls: "l"},
    {key: "fanout", name: "fan-out", get: i => T.fanout[i], fmt: fmtX},
  ].filter(c => c.show !== false);
  let haystack = null; // lower-cased id, sessions and parent per trajectory, built on first search

  function matches(i, q) {
    if (state.run >= 0 && T.run[i] !== state.run) return false;
    if (!q) return true;
    if (haystack === null) {
      haystack = new Array(NT);
      for (let k = 0; k < NT; k++) {
        haystack[k] = (T.id[k] + "\n" + T.sessions[k] + "\n" + parentId(k)).toLowerCase();
      }
    }
    return haystack[i].includes(q);
  }

  function refilter() {
    const q = state.query.toLowerCase();
    const col = COLS.find(c => c.key === state.key) || COLS[0];
    const order = [];
    for (let i = 0; i < NT; i++) if (matches(i, q)) order.push(i);
    const keys = new Map(order.map(i => [i, col.get(i)]));
    const dir = state.desc ? -1 : 1;
    order.sort((a, b) => {
      const x = keys.get(a), y = keys.get(b);
      if (x === y) return a - b;
      if (x === null) return 1; // absent values last, whichever the direction
      if (y === null) return -1;
      return (x < y ? -1 : 1) * dir;
    });
    state.order = order;
    state.page = Math.min(state.page, Math.max(0, Math.ceil(order.length / PAGE) - 1));
    renderList();
  }

  function renderHead() {
    const tr = el("tr");
    for (const c of COLS) {
      const th = el("th", (c.cls || "").replace(" id", ""), c.name);
      if (c.key === state.key) th.classList.add("sorted");
      if (c.key === state.key && !state.desc) th.classList.add("asc");
      th.addEventListener("click", () => {
        state.desc = c.key === state.key ? !state.desc : c.cls === undefined;
        state.key = c.key;
        renderHead();
        refilter();
      });
      tr.appendChild(th);
    }
    const head = document.querySelector("#traj-table thead");
    head.replaceChildren(tr);
  }

  function renderList() {
    const table = document.getElementById("traj-table");
    const body = table.querySelector("tbody");
    const n = state.order.length;
    const pages = Math.max(1, Math.ceil(n / PAGE));
    const start = state.page * PAGE;
    const rows = [];
    for (const i of state.order.slice(start, start + PAGE)) {
      const tr = el("tr", i === state.selected ? "selected" : "");
      tr.dataset.index = String(i);
      tr.tabIndex = 0;
      for (const c of COLS) {
        const v = c.get(i);
        const cell = td(c.fmt ? c.fmt(v) : v, c.cls);
        if (c.key === "id" || c.key === "parent") cell.title = v;
        tr.appendChild(cell);
      }
      tr.addEventListener("click", () => select(i));
      tr.addEventListener("keydown", e => { if (e.key === "Enter") select(i); });
      rows.push(tr);
    }
    body.replaceChildren(...rows);
    table.dataset.count = String(n);
    const text = (id, t) => { document.getElementById(id).textContent = t; };
    text("list-count", fmtInt(n) + " of " + fmtInt(NT) + " trajectories");
    text("page", " page " + (state.page + 1) + " of " + pages + " ");
    document.getElementById("prev").disabled = state.page === 0;
    document.getElementById("next").disabled = state.page >= pages - 1;
  }

  function initControls() {
    const sel = document.getElementById("run-filter");
    sel.appendChild(new Option("all runs", "-1"));
    D.runs.forEach((r, n) => sel.appendChild(new Option(r.label, String(n))));
    sel.hidden = D.runs.length < 2;
    sel.addEventListener("change", () => {
      state.run = Number(sel.value);
      state.page = 0;
      refilter();
    });
    let timer = 0;
    document.getElementById("search").addEventListener("input", e => {
      clearTimeout(timer);
      timer = setTimeout(() => {
        state.query = e.target.value.trim();
        state.page = 0;
        refilter();
      }, 120); // one refilter per pause in typing, not per key
    });
    const onClick = (id, f) => document.getElementById(id).addEventListener("click", f);
    onClick("prev", () => { state.page--; renderList(); });
    onClick("next", () => { state.page++; renderList(); });
  }

  // ---- the selected trajectory
  function select(i) {
    state.selected = i;
    for (const tr of document.querySelectorAll("#traj-table tbody tr")) {
      tr.classList.toggle("selected", Number(tr.dataset.index) === i);
    }
    renderDetail(i);
  }

  function trajButton(i) {
    const b = el("button", "linkish", T.id[i]);
    b.type = "button";
    b.addEventListener("click", () => select(i));
    return b;
  }

  function renderDetail(i) {
    const box = document.getElementById("detail");
    box.replaceChildren();
    box.dataset.index = String(i);
    box.appendChild(el("h2", "", T.id[i]));
    const meta = el("p");
    const bits = ["run " + D.runs[T.run[i]].label, "tenant " + (T.tenant[i] || "(none)"),
      "sessions " + (T.sessions[i] || "(none)"), "outcome " + fmtOutcome(T.outcome[i]),
      "JCT " + fmtS(T.jct_s[i]), "turns " + T.turns[i], "fan-out " + fmtX(T.fanout[i])];
    meta.appendChild(document.createTextNode(bits.join(" \u00b7 ")));
    box.appendChild(meta);
    if (T.parent[i] !== null) {
      const p = el("p", "", "parent:");
      p.appendChild(trajButton(T.parent[i]));
      box.appendChild(p);
    }
    const kids = [];
    for (let k = 0; k < NT && kids.length <= 50; k++) if (T.parent[k] === i) kids.push(k);
    if (kids.length) {
      const p = el("p", "", "sub-agents:");
      kids.slice(0, 50).forEach(k => p.appendChild(trajButton(k)));
      if (kids.length > 50) p.appendChild(document.createTextNode(" \u2026"));
      box.appendChild(p);
    }
    box.appendChild(totalsTable(i));
    box.appendChild(legend());
    const wrap = el("div");
    wrap.id = "wf-wrap";
    const canvas = el("canvas");
    canvas.id = "waterfall";
    const tip = el("div");
    tip.id = "tooltip";
    wrap.append(canvas, tip);
    box.appendChild(wrap);
    drawWaterfall(canvas, tip, i);
    box.appendChild(attemptsTable(i));
  }

  function totalsTable(i) {
    const t = el("table");
    const names = ["", "P", "device", "host", "disk", "fresh U", "O", "recomputed", "rebuilt",
      "cost"];
    t.appendChild(row(names.map((s, k) => el("th", k ? "" : "l", s))));
    t.appendChild(row([td("own", "l"), fmtInt(T.prompt[i]), fmtInt(T.device[i]), fmtInt(T.host[i]),
      fmtInt(T.disk[i]), fmtInt(T.fresh[i]), fmtInt(T.generated[i]), fmtInt(T.recomputed[i]),
      fmtInt(T.rebuilt[i]), fmtCost(T.cost[i])]));
    t.appendChild(row([td("with sub-agents", "l"), "", "", "", "", "", "", "", "",
      fmtCost(T.all_cost[i]) + " \u00b7 " + fmtInt(T.all_tokens[i]) + " tokens"]));
    return t;
  }

  function legend() {
    const p = el("p", "legend");
    for (const s of SEGMENTS) {
      const sw = el("span", "sw");
      sw.style.background = C[s];
      p.append(sw, document.createTextNode(s));
    }
    p.appendChild(el("span", "marker", "\u25bc first missed token (reason at the right)"));
    return p;
  }

  function segments(j) {
    return [R.device[j], R.host[j], R.disk[j], fresh(j), R.recomputed[j], R.generated[j]];
  }

  function drawWaterfall(canvas, tip, i) {
    const r0 = T.row0[i], n = Math.min(T.rows[i], MAX_ATTEMPTS);
    const W = Math.max(600, Math.min(1200, canvas.parentElement.clientWidth || 900));
    const rowH = 14, top = 18, left = 56, right = 300;
    const H = top + n * rowH + 4;
    const dpr = window.devicePixelRatio || 1;
    canvas.style.width = W + "px";
    canvas.style.height = H + "px";
    canvas.width = Math.round(W * dpr);
    canvas.height = Math.round(H * dpr);
    canvas.dataset.attempts = String(n);
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    let max = 1;
    for (let k = 0; k < n; k++) max = Math.max(max, segments(r0 + k).reduce((a, b) => a + b, 0));
    const scale = (W - left - right) / max;
    g.font = "11px system-ui, sans-serif";
    g.textBaseline = "middle";
    g.fillStyle = "#777";
    g.fillText("0", left, 8);
    g.textAlign = "right";
    g.fillText(fmtInt(max) + " tokens", W - right, 8);
    for (let k = 0; k < n; k++) {
      const j = r0 + k, y = top + k * rowH;
      g.textAlign = "right";
      g.fillStyle = "#444";
      g.fillText(attemptLabel(j), left - 6, y + rowH / 2);
      let x = left;
      segments(j).forEach((v, s) => {
        if (v <= 0) return;
        g.fillStyle = C[SEGMENTS[s]];
        g.fillRect(x, y + 2, v * scale, rowH - 4);
        x += v * scale;
      });
      const miss = missText(j);
      if (miss) {
        const mx = left + Math.min(R.token[j], R.prompt[j]) * scale;
        g.fillStyle = "#000";
        g.beginPath();
        g.moveTo(mx - 4, y);
        g.lineTo(mx + 4, y);
        g.lineTo(mx, y + 6);
        g.fill();
        g.textAlign = "left";
        g.fillStyle = "#b3261e";
        g.fillText(miss, Math.max(x, mx) + 6, y + rowH / 2);
      }
    }
    canvas.onmousemove = e => {
      const k = Math.floor((e.offsetY - top) / rowH);
      if (k < 0 || k >= n) { tip.style.display = "none"; return; }
      const j = r0 + k;
      tip.textContent = attemptLabel(j) + "  " + R.request_id[j] + "\nP " + fmtInt(R.prompt[j]) +
        " = device " + fmtInt(R.device[j]) + " + host " + fmtInt(R.host[j]) + " + disk " +
        fmtInt(R.disk[j]) + " + fresh " + fmtInt(fresh(j)) + "\nO " + fmtInt(R.generated[j]) +
        ", recomputed " + fmtInt(R.recomputed[j]) + ", " + str(R.finish[j]) +
        "\ncost " + fmtCost(R.cost[j]) + (missText(j) ? "\nmiss: " + missText(j) : "");
      tip.style.display = "block";
      tip.style.left = Math.min(e.offsetX + 12, W - 260) + "px";
      tip.style.top = (e.offsetY + 12) + "px";
    };
    canvas.onmouseleave = () => { tip.style.display = "none"; };
  }

  function attemptsTable(i) {
    const r0 = T.row0[i], n = Math.min(T.rows[i], MAX_ATTEMPTS);
    const t = el("table");
    t.id = "attempts";
    const names = ["attempt", "request", "start", "e2e", "P", "device", "host", "disk", "fresh U",
      "O", "recomputed", "cost", "finish", "decision", "miss"];
    const left = new Set(["attempt", "request", "finish", "decision", "miss"]);
    const head = names.map(s => el("th", left.has(s) ? "l" : "", s));
    t.appendChild(el("thead")).appendChild(row(head));
    const body = t.appendChild(el("tbody"));
    for (let k = 0; k < n; k++) {
      const j = r0 + k;
      const extra = D.text[String(j)] || {};
      const missCell = td(missText(j), "l");
      if (extra.old || extra.new) {
        missCell.appendChild(el("pre", "window", "old: " + (extra.old || "")));
        missCell.appendChild(el("pre", "window", "new: " + (extra.new || "")));
      }
      const finish = td(str(R.finish[j]) + (extra.error ? " (" + extra.error + ")" : ""), "l");
      const dec = str(R.decision[j]);
      const decision = td(dec ? dec + " p=" + R.p_return[j] : "", "l");
      if (extra.decision_reason) decision.title = extra.decision_reason;
      body.appendChild(row([td(attemptLabel(j), "l"), td(R.request_id[j], "l id"), fmtS(R.t[j]),
        fmtS(R.e2e[j]), fmtInt(R.prompt[j]), fmtInt(R.device[j]), fmtInt(R.host[j]),
        fmtInt(R.disk[j]), fmtInt(fresh(j)), fmtInt(R.generated[j]), fmtInt(R.recomputed[j]),
        fmtCost(R.cost[j]), finish, decision, missCell]));
    }
    const wrap = el("div");
    if (T.rows[i] > n) {
      wrap.appendChild(el("p", "muted", "first " + n + " of " + T.rows[i] + " attempts"));
    }
    wrap.appendChild(t);
    return wrap;
  }

  // ---- start
  renderFleet();
  renderProblems();
  renderPlots();
  initControls();
  renderHead();
  refilter();
  if (state.order.length) select(state.order[0]);
  window.reportReadyMs = performance.now();
  document.body.dataset.ready = "1";
})();
