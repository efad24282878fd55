// rlcore inspector: curves from metrics.jsonl and the sampled trajectories, token by token.
// Plain DOM and inline SVG, no library: the page must open with no network.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("run-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#bf3989", "#6e7781"];
  // The consistency check's counts (tokens judged, tensors compared): on a chart of their own, never on
  // the axis of the differences (1e-7 .. 0.3 beside ~1500 tokens would be flat at zero).
  const COUNT = (k) => /^check\/(tokens|weights_checked|weights_mismatch|weights_unreadable|nan_rewards)(\/|$)/.test(k);
  // The share of the weights a check verified (0..1): neither a difference nor a count.
  const COVERED = (k) => /^check\/weights_(covered|read_back)$/.test(k);
  // Each chart: a title, which metrics it draws (whatever of them the run logged), and its y scale.
  const CHARTS = [
    ["Reward", (k) => ["reward/score/mean", "critic/score/mean", "val/reward_mean", "episode/reward_mean"].includes(k)],  // critic/: runs before 2026-12-05
    ["Response length", (k) => ["response_length/mean", "response_length/max"].includes(k)],
    ["KL", (k) => /^actor\/.*kl/.test(k) && !/coeff/.test(k)],
    ["Trainer vs sampler: differences (check/*, IS weights, sample; log scale)",
      (k) => /^(check\/|actor\/is\/|sample\/logprob)/.test(k) && !COUNT(k) && !COVERED(k), "log"],
    ["Consistency check: counts", COUNT],
    ["Consistency check: share of the weights verified", COVERED],
    ["Staleness", (k) => /staleness|version_lag|stale_token|dropped_stale/.test(k)],
  ];
  // The consistency check's rows (check.jsonl): its warnings mark the curves at their steps.
  const CHECKS = DATA.checks || [];
  const warnedAt = new Map();
  for (const c of CHECKS.filter((c) => c.kind === "warning")) {
    if (!warnedAt.has(c.step)) warnedAt.set(c.step, new Set());
    warnedAt.get(c.step).add(c.cause);
  }
  const MODES = {
    advantage: "advantage",
    ratio: "trainer / sampler prob. ratio",
    version: "policy version lag",
    logprob: "sampler log-prob",
  };
  const state = { stepA: null, stepB: null, compare: false, mode: "advantage", source: "", rmin: "", rmax: "",
                  trunc: "all", extraCharts: [], open: new Set() };  // open: "step:row" of responses shown
  const steps = DATA.steps.map((s) => s.step);
  const byStep = new Map(DATA.steps.map((s) => [s.step, s.records.map(normalise)]));

  // A record with fields missing (hand-written, or an older writer) still shows: what it has.
  function normalise(r) {
    const n = Array.isArray(r.ids) ? r.ids.length : Array.isArray(r.pieces) ? r.pieces.length : 0;
    const version = typeof r.policy_version === "number" ? r.policy_version : 0;
    return { ...r, length: n, policy_version: version, pieces: r.pieces || (r.ids || []).map(String),
      ids: r.ids || Array(n).fill(null), prompt_pieces: r.prompt_pieces || [], versions: r.versions || Array(n).fill(version),
      mask: r.mask || Array(n).fill(1), segments: r.segments || (n ? [["policy", 0, n]] : []),
      reward: typeof r.reward === "number" ? r.reward : null, group: String(r.group ?? r.row) };
  }

  function el(tag, attrs, ...kids) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : v);
    }
    for (const kid of kids.flat()) if (kid !== null && kid !== undefined) node.append(kid);
    return node;
  }
  function svg(tag, attrs, ...kids) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    for (const kid of kids) node.append(kid);
    return node;
  }
  function fmt(v, digits = 3) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    if (v !== 0 && (Math.abs(v) >= 1e4 || Math.abs(v) < 1e-3)) return v.toExponential(2);
    return String(+v.toFixed(digits));
  }

  // ------------------------------------------------------------------ curves
  const ROWS = DATA.metrics.concat(DATA.sample_metrics || []);  // the run's metrics, then the page's own of the sample
  const metricKeys = [...new Set(ROWS.flatMap((r) => Object.keys(r)))]
    .filter((k) => k !== "step" && ROWS.some((r) => typeof r[k] === "number")).sort();

  function chart(title, keys, removable, scale) {
    const box = el("div", { class: "chart", "data-chart": title });
    const remove = removable ? el("button", { title: "remove", onclick: () => {
      state.extraCharts = state.extraCharts.filter((k) => k !== title); drawCurves(); } }, "×") : null;
    box.append(el("h3", {}, el("span", {}, title), remove));
    const series = keys.map((k, i) => ({ key: k, color: PALETTE[i % PALETTE.length], on: true,
      points: ROWS.filter((r) => typeof r[k] === "number").map((r) => [r.step, r[k]]) }))
      .filter((s) => s.points.length);
    if (!series.length) {
      box.append(el("div", { class: "empty" }, "not logged by this run"));
      return box;
    }
    const plot = el("div");
    const legend = el("div", { class: "legend" });
    const draw = () => { plot.replaceChildren(plotSvg(series.filter((s) => s.on), scale)); };
    for (const s of series) {
      const item = el("span", { title: s.key, onclick: () => { s.on = !s.on; item.classList.toggle("off", !s.on); draw(); } },
        el("i", { style: `background:${s.color}` }), s.key);
      legend.append(item);
    }
    draw();
    box.append(plot, legend);
    return box;
  }

  // A log scale that holds 0 and negative values (a signed mean difference): sign(y) log10(1 + |y| / lin),
  // lin half the smallest non-zero |value|, so every value stays apart from 0 and decades are even.
  function symlog(values) {
    const small = Math.min(...values.map(Math.abs).filter((v) => v > 0));
    const lin = Number.isFinite(small) ? Math.max(small / 2, 1e-300) : 1;
    const f = (y) => Math.sign(y) * Math.log10(1 + Math.abs(y) / lin);
    const ticks = (t0, t1) => {  // the decades (and 0) inside [t0, t1], at most 5
      const out = [];
      const top = Math.ceil(Math.log10(Math.max(...values.map(Math.abs), lin)));
      for (let k = Math.floor(Math.log10(lin)); k <= top; k++) {
        for (const v of [10 ** k, -(10 ** k)]) if (f(v) >= t0 && f(v) <= t1) out.push(v);
      }
      if (0 >= t0 && 0 <= t1) out.push(0);
      out.sort((a, b) => f(a) - f(b));
      const every = Math.ceil(out.length / 5);
      return out.filter((_, i) => i % every === 0);
    };
    return { f, ticks };
  }

  function plotSvg(series, scale) {
    const W = 300, H = 130, L = 44, R = 6, T = 6, B = 18;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-scale": scale || "linear" });
    const pts = series.flatMap((s) => s.points);
    if (!pts.length) return root;
    const log = scale === "log" ? symlog(pts.map((p) => p[1])) : null;
    const f = log ? log.f : (y) => y;
    let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...pts.map((p) => f(p[1]))), Math.max(...pts.map((p) => f(p[1])))];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const Y = (y) => T + (1 - (f(y) - y0) / (y1 - y0)) * (H - T - B);  // y: a value, on the chart's scale
    let ticks = log ? log.ticks(y0, y1) : [0, 0.5, 1].map((g) => y0 + g * (y1 - y0));
    if (log) {  // labels at least 11 units apart, the lowest first
      const kept = [];
      for (const y of ticks) if (!kept.length || Math.abs(Y(y) - Y(kept[kept.length - 1])) >= 11) kept.push(y);
      ticks = kept;
    }
    const label = (y) => log && y !== 0 && (Math.abs(y) < 1e-3 || Math.abs(y) >= 1e4)
      ? `${y < 0 ? "-" : ""}1e${Math.round(Math.log10(Math.abs(y)))}` : fmt(y, 3);
    for (const y of ticks) {
      root.append(svg("line", { class: "gridline", x1: L, x2: W - R, y1: Y(y), y2: Y(y) }));
      root.append(svg("text", { x: L - 3, y: Y(y) + 3, "text-anchor": "end" }, document.createTextNode(label(y))));
    }
    for (const [step, causes] of warnedAt) {  // the check warned at this step: a red mark across the chart
      if (step < x0 || step > x1) continue;
      const text = `consistency check, step ${step}: ${[...causes].join(", ")}`;
      root.append(svg("line", { class: "warn-marker", "data-step": step, x1: X(step), x2: X(step), y1: T, y2: H - B },
        svg("title", {}, document.createTextNode(text))));
      root.append(svg("path", { class: "warn-flag", d: `M${X(step) - 4},${T}L${X(step) + 4},${T}L${X(step)},${T + 6}Z` },
        svg("title", {}, document.createTextNode(text))));
    }
    root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
    root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    for (const x of [x0, x1]) {
      root.append(svg("text", { x: X(x), y: H - 5, "text-anchor": x === x0 ? "start" : "end" },
        document.createTextNode(`step ${fmt(x, 0)}`)));
    }
    for (const step of [state.stepA, state.compare ? state.stepB : null]) {
      if (step !== null && step >= x0 && step <= x1) {
        root.append(svg("line", { class: "cursor", x1: X(step), x2: X(step), y1: T, y2: H - B }));
      }
    }
    for (const s of series) {
      const d = s.points.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
      root.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.5, "vector-effect": "non-scaling-stroke" }));
      for (const [x, y] of s.points) {
        const warned = warnedAt.has(x);
        const dot = svg("circle", { cx: X(x), cy: Y(y), r: warned ? 3.2 : 2.2, fill: s.color, class: warned ? "warned" : "" },
          svg("title", {}, document.createTextNode(`${s.key}\nstep ${x}: ${fmt(y, 5)}`)));
        dot.addEventListener("click", () => { if (byStep.has(x)) { state.stepA = x; update(); } });
        root.append(dot);
      }
    }
    return root;
  }

  function drawCurves() {
    const grid = document.querySelector("#curves .grid");
    grid.replaceChildren(...CHARTS.map(([title, want, scale]) => chart(title, metricKeys.filter(want), false, scale)),
      ...state.extraCharts.map((k) => chart(k, [k], true)));
  }

  // ------------------------------------------------------------------ the check's verdicts
  function checkList() {
    const verdicts = CHECKS.filter((c) => c.kind === "verdict");
    const ok = verdicts.filter((c) => c.cause === "ok").length;
    const box = el("section", { id: "checks" }, el("h2", {}, "Consistency check"));
    if (!CHECKS.length) {
      box.append(el("div", { class: "note" }, "no check.jsonl in this run folder (a run from before it, the check " +
        "off, or no step judged yet)"));
      return box;
    }
    box.append(el("div", { class: "summary" }, `${verdicts.length} steps judged · ${ok} ok · ` +
      (warnedAt.size ? `warnings at step(s) ${[...warnedAt.keys()].join(", ")}` : "no warning")));
    const shown = CHECKS.filter((c) => c.kind !== "verdict");
    if (!shown.length) return box;
    const table = el("table", { class: "checks" },
      el("tr", {}, el("th", {}, "step"), el("th", {}, "kind"), el("th", {}, "cause"), el("th", {}, "message")));
    for (const c of shown) {
      const tensors = (c.tensors || []).length ? ` [tensors: ${c.tensors.slice(0, 5).join(", ")}` +
        `${c.tensors.length > 5 ? ", …" : ""}]` : "";
      table.append(el("tr", { class: c.kind, "data-step": c.step, title: byStep.has(c.step) ? "click: show this step" : "",
        onclick: () => { if (byStep.has(c.step)) { state.stepA = c.step; update(); } } },
        el("td", { class: "num" }, String(c.step)), el("td", {}, c.kind), el("td", {}, el("code", {}, c.cause)),
        el("td", {}, c.message + tensors)));
    }
    box.append(table);
    return box;
  }

  // ------------------------------------------------------------------ token colours
  const hasTrainer = (r) => Array.isArray(r.trainer_logprob) && Array.isArray(r.sampler_logprob);
  function tokenColour(r, j, scale) {
    if (r.versions[j] === -1) return "";  // env / tool text: not the policy's
    if (state.mode === "advantage") {
      const a = r.advantages ? r.advantages[j] : null;
      if (a === null) return "";
      const alpha = Math.min(1, Math.abs(a) / scale.adv) * 0.8;
      return a >= 0 ? `rgba(26,127,55,${alpha})` : `rgba(207,34,46,${alpha})`;
    }
    if (state.mode === "ratio") {
      if (!hasTrainer(r) || r.trainer_logprob[j] === null || r.sampler_logprob[j] === null) return "";
      const lr = r.trainer_logprob[j] - r.sampler_logprob[j];
      const alpha = Math.min(1, Math.abs(lr) / Math.log(1.2)) * 0.85;  // saturates at a ratio of 1.2 or 1/1.2
      return lr >= 0 ? `rgba(188,76,0,${alpha})` : `rgba(9,105,218,${alpha})`;
    }
    if (state.mode === "version") {
      const lag = r.policy_version - r.versions[j];
      return ["rgba(84,174,255,.35)", "rgba(212,167,44,.6)", "rgba(251,143,68,.75)"][lag] || "rgba(207,34,46,.75)";
    }
    const lp = r.sampler_logprob ? r.sampler_logprob[j] : null;
    return lp === null ? "" : `rgba(130,80,223,${(1 - Math.exp(lp)) * 0.8})`;
  }
  function legendFor(records) {
    const swatch = (c, t) => [el("b", { style: `background:${c}` }), t];
    const parts = {
      advantage: [...swatch("rgba(207,34,46,.8)", "< 0"), ...swatch("#fff", "0"), ...swatch("rgba(26,127,55,.8)", "> 0")],
      ratio: [...swatch("rgba(9,105,218,.85)", "trainer < sampler"), ...swatch("#fff", "equal"),
              ...swatch("rgba(188,76,0,.85)", "trainer > sampler (full at 1.2x)")],
      version: [...swatch("rgba(84,174,255,.35)", "lag 0"), ...swatch("rgba(212,167,44,.6)", "1"),
                ...swatch("rgba(251,143,68,.75)", "2"), ...swatch("rgba(207,34,46,.75)", "3+")],
      logprob: [...swatch("#fff", "p = 1"), ...swatch("rgba(130,80,223,.8)", "p → 0")],
    }[state.mode];
    const legend = el("span", { class: "legend", id: "legend" }, ...parts, " · struck through: out of the loss");
    if (state.mode === "ratio" && records.length && !records.some(hasTrainer)) {
      legend.append(el("span", { class: "note" }, "no trainer log-probs in this sample"));
    }
    return legend;
  }

  // ------------------------------------------------------------------ trajectories
  const source = (r) => String(r.data_source ?? "(none)");
  function passes(r) {
    if (state.source && source(r) !== state.source) return false;
    if (state.rmin !== "" && !(r.reward !== null && r.reward >= +state.rmin)) return false;
    if (state.rmax !== "" && !(r.reward !== null && r.reward <= +state.rmax)) return false;
    if (state.trunc === "truncated" && !r.truncated) return false;
    if (state.trunc === "complete" && r.truncated) return false;
    return true;
  }

  function tokenView(r, scale) {
    const detail = el("div", { class: "detail" }, "hover or click a token for its numbers");
    const show = (j) => {
      const parts = [`#${j}`, `id ${r.ids[j]}`, JSON.stringify(r.pieces[j])];
      const s = r.sampler_logprob ? r.sampler_logprob[j] : null, t = r.trainer_logprob ? r.trainer_logprob[j] : null;
      if (r.versions[j] === -1) parts.push("env / tool token");
      else {
        parts.push(`sampler lp ${fmt(s, 4)}`, `trainer lp ${fmt(t, 4)}`);
        if (s !== null && t !== null) parts.push(`ratio ${fmt(Math.exp(t - s), 4)}`);
        parts.push(`advantage ${fmt(r.advantages ? r.advantages[j] : null, 4)}`,
                   `version ${r.versions[j]} (lag ${r.policy_version - r.versions[j]})`);
      }
      parts.push(r.mask[j] ? "in the loss" : "masked out of the loss");
      detail.textContent = parts.join(" · ");
    };
    const box = el("div", { class: "tokens" });
    let turn = 0;
    for (const [kind, start, end] of r.segments) {
      if (kind === "policy") turn += 1;
      const label = kind === "env" ? "env / tool" : r.segments.length > 1 ? `policy · turn ${turn}` : "policy";
      const seg = el("div", { class: `seg ${kind}` }, el("span", { class: "label" }, `${label} · tokens ${start}–${end - 1}`));
      for (let j = start; j < end; j++) {
        const piece = r.pieces[j].replace(/\n/g, "↵\n");
        const tok = el("span", { class: "tok" + (r.mask[j] || kind === "env" ? "" : " masked"), "data-j": j,
          style: `background:${tokenColour(r, j, scale)}`, onmouseenter: () => show(j),
          onclick: (e) => { box.querySelectorAll(".tok.sel").forEach((n) => n.classList.remove("sel"));
                            e.currentTarget.classList.add("sel"); show(j); } }, piece);
        seg.append(tok);
      }
      box.append(seg);
    }
    box.append(detail);
    return box;
  }

  function responseRow(r, scale, label) {
    const text = r.pieces.join("");
    const row = el("div", { class: "resp", "data-row": r.row });
    const bar = el("div", { class: "bar", title: "click: show the tokens" },
      el("span", { class: "num" }, label),
      el("span", { class: "num" }, `reward ${fmt(r.reward)}`),
      el("span", { class: "num" }, `adv ${fmt(r.advantage)}`),
      el("span", { class: "num" }, `${r.length} tok`),
      r.num_turns ? el("span", { class: "badge" }, `${r.num_turns} turns`) : null,
      r.truncated ? el("span", { class: "badge trunc" }, "truncated") : null,
      el("span", { class: "preview" }, text.replace(/\n/g, "↵")));
    const key = `${r.step}:${r.row}`;
    const show = (open) => {
      row.classList.toggle("open", open);
      const old = row.querySelector(".tokens");
      if (old) old.remove();
      if (open) row.append(tokenView(r, scale));
    };
    bar.addEventListener("click", () => {
      const open = !row.classList.contains("open");
      if (open) state.open.add(key); else state.open.delete(key);
      show(open);
    });
    row.append(bar);
    if (state.open.has(key)) show(true);  // stays open when colours or filters redraw the panel
    return row;
  }

  function groupCard(records, scale) {
    const first = records[0];
    const rewards = records.map((r) => r.reward).filter((v) => v !== null);
    const mean = rewards.reduce((a, b) => a + b, 0) / (rewards.length || 1);
    const head = el("div", { class: "head" },
      el("span", { class: "tag" }, `group ${first.group}`),
      el("span", { class: "tag" }, `source ${source(first)}`),
      first.ground_truth !== null ? el("span", { class: "tag" }, `answer ${first.ground_truth}`) : null,
      el("span", { class: "tag" }, `mean reward ${fmt(mean)} over ${records.length}`),
      el("div", { class: "prompt" }, first.prompt_pieces.join("")));
    const card = el("div", { class: "group", "data-group": first.group }, head);
    const episodes = new Map();
    for (const r of records) {
      const key = r.episode ?? `row ${r.row}`;
      if (!episodes.has(key)) episodes.set(key, []);
      episodes.get(key).push(r);
    }
    for (const [key, segs] of episodes) {
      if (segs.length > 1) card.append(el("div", { class: "episode-head" }, `episode ${key} · ${segs.length} segments`));
      segs.forEach((r, i) => card.append(responseRow(r, scale, segs.length > 1 ? `segment ${i + 1}` : `row ${r.row}`)));
    }
    return card;
  }

  function stepPanel(step, which) {
    const records = byStep.get(step) || [];
    const shown = records.filter(passes);
    const advs = shown.flatMap((r) => (r.advantages || []).filter((v, j) => v !== null && r.mask[j]));
    const scale = { adv: Math.max(1e-6, ...advs.map(Math.abs)) };
    const groups = new Map();
    for (const r of shown) {
      if (!groups.has(r.group)) groups.set(r.group, []);
      groups.get(r.group).push(r);
    }
    const rewards = shown.map((r) => r.reward).filter((v) => v !== null);
    const panel = el("div", { class: "panel", "data-step": step, "data-which": which },
      el("h2", {}, `Step ${step}`),
      el("div", { class: "summary" }, `${shown.length} of ${records.length} responses · ${groups.size} groups · ` +
        `mean reward ${fmt(rewards.reduce((a, b) => a + b, 0) / (rewards.length || 1))} · ` +
        `policy version ${records.length ? records[0].policy_version : "–"} · |advantage| scale ${fmt(scale.adv)}`));
    if (!records.length) panel.append(el("div", { class: "note" }, "no trajectories sampled at this step"));
    for (const g of groups.values()) panel.append(groupCard(g, scale));
    return { panel, shown: shown.length, total: records.length };
  }

  // ------------------------------------------------------------------ controls
  function select(id, options, value, onchange) {
    const s = el("select", { id, onchange: (e) => onchange(e.target.value) },
      ...options.map(([v, t]) => el("option", { value: v, selected: String(v) === String(value) }, t)));
    return s;
  }

  function controls() {
    const stepOpts = steps.map((s) => [s, `step ${s}`]);
    const sources = [...new Set([...byStep.values()].flatMap((rs) => rs.map(source)))].sort();
    const num = (id, key) => el("input", { id, type: "number", step: "any", value: state[key],
      oninput: (e) => { state[key] = e.target.value; drawPanels(); } });
    return [
      el("label", {}, "Step ", select("step-a", stepOpts, state.stepA, (v) => { state.stepA = +v; update(); })),
      el("label", {}, el("input", { id: "compare", type: "checkbox", checked: state.compare,
        onchange: (e) => { state.compare = e.target.checked; update(); } }), " beside step ",
        select("step-b", stepOpts, state.stepB, (v) => { state.stepB = +v; update(); })),
      el("label", {}, "Colour by ", select("mode", Object.entries(MODES), state.mode, (v) => { state.mode = v; drawPanels(); })),
      el("label", {}, "Source ", select("source", [["", "all"], ...sources.map((s) => [s, s])], state.source,
        (v) => { state.source = v; drawPanels(); })),
      el("label", {}, "Reward ", num("reward-min", "rmin"), " to ", num("reward-max", "rmax")),
      el("label", {}, "Length ", select("trunc", [["all", "all"], ["truncated", "truncated only"], ["complete", "complete only"]],
        state.trunc, (v) => { state.trunc = v; drawPanels(); })),
      el("span", { id: "legend" }),
      el("span", { id: "shown" }),
    ];
  }

  function drawPanels() {
    const panels = document.getElementById("panels");
    const which = state.compare ? [[state.stepA, "a"], [state.stepB, "b"]] : [[state.stepA, "a"]];
    const built = which.filter(([s]) => s !== null).map(([s, w]) => stepPanel(s, w));
    panels.className = built.length > 1 ? "two" : "";
    panels.replaceChildren(...built.map((b) => b.panel));
    const records = which.flatMap(([s]) => byStep.get(s) || []);
    document.getElementById("legend").replaceWith(legendFor(records));
    document.getElementById("shown").textContent = built.length
      ? built.map((b) => `${b.shown}/${b.total}`).join(" · ") + " responses shown" : "";
  }

  function update() {
    for (const [id, v] of [["step-a", state.stepA], ["step-b", state.stepB]]) {
      const s = document.getElementById(id);
      if (s && v !== null) s.value = String(v);
    }
    drawCurves();
    drawPanels();
  }

  function start() {
    state.stepA = steps.length ? steps[steps.length - 1] : null;
    state.stepB = steps.length > 1 ? steps[steps.length - 2] : state.stepA;
    const cfg = Object.entries(DATA.config || {}).map(([k, v]) => el("span", {}, " · ", k, " ", el("code", {}, String(v))));
    const add = el("select", { id: "add-chart", onchange: (e) => {
      if (e.target.value && !state.extraCharts.includes(e.target.value)) state.extraCharts.push(e.target.value);
      e.target.value = ""; drawCurves(); } },
      el("option", { value: "" }, "add a chart of any metric…"), ...metricKeys.map((k) => el("option", { value: k }, k)));
    const app = document.getElementById("app");
    app.replaceChildren(
      el("header", {}, el("h1", {}, `${DATA.run} · rlcore inspector`),
        el("div", { class: "meta" }, el("code", {}, DATA.folder), ` · ${DATA.metrics.length} metric rows · `,
          `${steps.length} sampled steps`, ...cfg)),
      el("section", { id: "curves" }, el("h2", {}, "Curves ", add), el("div", { class: "grid" })),
      checkList(),
      el("section", { id: "controls" }, ...controls()),
      el("section", { id: "trajectories" }, steps.length ? el("div", { id: "panels" })
        : el("div", { class: "note" }, "no trajectories in this run folder (trainer.trajectory_groups=0, or no step finished)")));
    drawCurves();
    if (steps.length) drawPanels();
  }
  start();
})();
