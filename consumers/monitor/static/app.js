// jetrl monitor: the web page's script. Plain JavaScript, no framework; plotly.js (served by
// jetrl from the installed plotly package) draws the charts. Data comes from the server-sent
// events of /events (every step point, then the new ones and the snapshot about every second),
// or, where EventSource is missing, from polling /api/points and /api/snapshot. Every value may
// be missing (a run that has not stepped yet, a trainer that reports no such metric): the page
// shows a dash and goes on.
"use strict";

(function () {
  const S = {
    points: [], // the step points, in step order
    index: new Map(), // step -> position in points
    keys: new Set(), // every scalar name seen
    snapshot: null,
    lastStep: -1,
    conn: "connecting",
    inspect: null, // the loaded step's inspector answer
    selected: 0, // the rollout shown token by token
    charted: new Set(), // charts plotted once (click handlers attached)
    timer: null,
  };

  // ---------------------------------------------------------------- helpers

  const $ = (id) => document.getElementById(id);
  const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
  const get = (p, key) => (p && Object.prototype.hasOwnProperty.call(p, key) ? num(p[key]) : null);
  const sumValues = (o) => {
    if (!o || typeof o !== "object") return null;
    let n = 0;
    for (const v of Object.values(o)) if (num(v) !== null) n += v;
    return n;
  };

  function fmt(v, kind) {
    v = num(v);
    if (v === null) return "–";
    switch (kind) {
      case "int":
        return String(Math.round(v));
      case "f2":
        return v.toFixed(2);
      case "f3":
        return v.toFixed(3);
      case "pct":
        return (v * 100).toFixed(v < 0.1 && v > 0 ? 1 : 0) + "%";
      case "rate":
        return v >= 100 ? String(Math.round(v)) : v.toFixed(1);
      default: {
        // "g": short, readable across magnitudes (a KL of 3e-6, a loss of 0.42)
        const a = Math.abs(v);
        if (a === 0) return "0";
        if (a < 1e-3 || a >= 1e5) return v.toExponential(2);
        return String(Number(v.toPrecision(4)));
      }
    }
  }

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    if (attrs) {
      for (const [k, v] of Object.entries(attrs)) {
        if (v === null || v === undefined) continue;
        if (k === "class") e.className = v;
        else if (k === "text") e.textContent = v;
        else if (k === "dataset") Object.assign(e.dataset, v);
        else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
        else e.setAttribute(k, v);
      }
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function fillBody(table, rows, cols, empty) {
    const body = $(table).querySelector("tbody");
    body.replaceChildren();
    if (!rows.length) {
      body.append(el("tr", null, el("td", { class: "empty", colspan: String(cols), text: empty })));
      return;
    }
    for (const r of rows) body.append(r);
  }

  function ago(seconds) {
    seconds = num(seconds);
    if (seconds === null) return "";
    if (seconds < 90) return seconds.toFixed(seconds < 10 ? 1 : 0) + " s";
    if (seconds < 5400) return (seconds / 60).toFixed(0) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }

  // ---------------------------------------------------------------- data in

  function addPoints(list) {
    if (!Array.isArray(list)) return;
    for (const p of list) {
      if (!p || num(p.step) === null) continue;
      for (const k of Object.keys(p)) S.keys.add(k);
      const at = S.index.get(p.step);
      if (at !== undefined) {
        S.points[at] = p; // the same step again (a reconnect): the newer copy wins
      } else if (p.step > S.lastStep) {
        S.index.set(p.step, S.points.length);
        S.points.push(p);
        S.lastStep = p.step;
      } else {
        // an older step arriving late: keep the series in step order
        S.points.push(p);
        S.points.sort((a, b) => a.step - b.step);
        S.index = new Map(S.points.map((q, i) => [q.step, i]));
      }
    }
    document.body.dataset.points = String(S.points.length);
    document.body.dataset.lastStep = S.lastStep >= 0 ? String(S.lastStep) : "";
    schedule();
  }

  function setSnapshot(s) {
    if (!s || typeof s !== "object") return;
    S.snapshot = s;
    schedule();
  }

  function setConn(state) {
    S.conn = state;
    const c = $("conn");
    c.dataset.state = state;
    c.textContent = state === "connected" ? "" : state;
    schedule();
  }

  function connect() {
    if (typeof window.EventSource !== "function") {
      poll();
      return;
    }
    const es = new EventSource("events");
    es.addEventListener("points", (e) => addPoints(safeParse(e.data)));
    es.addEventListener("snapshot", (e) => setSnapshot(safeParse(e.data)));
    es.onopen = () => setConn("connected");
    es.onerror = () => setConn(es.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting");
  }

  async function poll() {
    for (;;) {
      try {
        const [pts, snap] = await Promise.all([
          fetch("api/points?after=" + S.lastStep).then((r) => r.json()),
          fetch("api/snapshot").then((r) => r.json()),
        ]);
        addPoints(pts);
        setSnapshot(snap);
        setConn("connected");
      } catch (err) {
        setConn("reconnecting");
      }
      await new Promise((r) => setTimeout(r, 2000));
    }
  }

  function safeParse(text) {
    try {
      return JSON.parse(text);
    } catch (err) {
      return null;
    }
  }

  // ---------------------------------------------------------------- rendering

  function schedule() {
    if (S.timer === null) S.timer = setTimeout(render, 100);
  }

  function latest() {
    const last = S.points.length ? S.points[S.points.length - 1] : null;
    const snap = S.snapshot && S.snapshot.latest ? S.snapshot.latest : null;
    if (last && snap) return snap.step > last.step ? snap : last;
    return last || snap;
  }

  function render() {
    S.timer = null;
    const errors = [];
    for (const part of [renderHeader, renderTiles, renderCharts, renderTables]) {
      try {
        part();
      } catch (err) {
        errors.push(err);
      }
    }
    if (errors.length && window.console) console.error("monitor: rendering failed", errors);
  }

  function renderHeader() {
    const s = S.snapshot || {};
    const l = latest();
    $("run-id").textContent = s.run_id || "…";
    document.title = s.run_id ? "jetrl · " + s.run_id : "jetrl monitor";
    const status = s.status || "";
    const st = $("run-status");
    st.textContent = status || "…";
    st.dataset.value = status;
    const step = l ? num(l.step) : null;
    const rs = $("run-step");
    rs.textContent = fmt(step, "int");
    rs.dataset.value = step === null ? "" : String(step);
    let mode = "connecting";
    if (S.snapshot) {
      if (status && status !== "running") mode = status === "completed" ? "finished" : status;
      else mode = s.live ? "live" : "recorded";
    }
    if (S.conn === "disconnected" && mode === "live") mode = "disconnected";
    const badge = $("run-mode");
    badge.dataset.state = mode;
    badge.textContent = mode;
    const age = l && num(s.now) !== null && num(l.t) !== null ? s.now - l.t : null;
    $("run-age").textContent = age === null ? "" : "last step " + ago(Math.max(0, age)) + " ago";
  }

  // The tiles: id (#tile-<id>), label, value from the snapshot (s) and the latest point (l), format.
  const TILES = [
    ["step", "step", (s, l) => (l ? num(l.step) : null), "int"],
    ["reward", "reward", (s, l) => get(l, "reward/mean"), "f3"],
    ["loss", "loss", (s, l) => get(l, "trainer/loss"), "g"],
    ["kl", "mismatch KL", (s, l) => get(l, "trainer/mismatch_kl"), "g"],
    ["kl-max", "mismatch KL max", (s, l) => get(l, "trainer/mismatch_kl_max"), "g"],
    ["entropy", "entropy", (s, l) => get(l, "trainer/entropy"), "g"],
    ["grad-norm", "grad norm", (s, l) => get(l, "trainer/grad_norm"), "g"],
    ["staleness", "staleness", (s, l) => get(l, "staleness/mean"), "f2"],
    ["tokens-per-s", "tokens / s", (s, l) => get(l, "throughput/tokens_per_s"), "rate"],
    ["trainer-idle", "trainer idle", (s, l) => get(l, "trainer/trainer_idle_frac"), "pct"],
    ["weight-wait", "inference weight wait", (s, l) => get(l, "inference/weight_wait_frac"), "pct"],
    [
      "pending-rollouts",
      "pending rollouts",
      (s, l) => (num(s.pending_rollouts) !== null ? s.pending_rollouts : get(l, "queue/pending_rollouts")),
      "int",
    ],
    [
      "pending-samples",
      "pending samples",
      (s, l) => (num(s.pending_samples) !== null ? s.pending_samples : get(l, "queue/pending_samples")),
      "int",
    ],
    ["withheld", "withheld", (s) => (s.withheld ? sumValues(s.withheld) : null), "int"],
    ["dead-letters", "dead letters", (s) => (s.dead_letters ? sumValues(s.dead_letters) : null), "int"],
    [
      "alerts",
      "alerts firing",
      (s) => (Array.isArray(s.alerts) ? s.alerts.filter((a) => a && a.state === "firing").length : null),
      "int",
    ],
  ];

  function renderTiles() {
    const box = $("tiles");
    if (!box.childElementCount) {
      for (const [id, label] of TILES) {
        box.append(
          el(
            "div",
            { class: "tile", id: "tile-" + id, dataset: { value: "" } },
            el("div", { class: "label", text: label }),
            el("div", { class: "value", text: "–" }),
          ),
        );
      }
    }
    const s = S.snapshot || {};
    const l = latest();
    for (const [id, , f, kind] of TILES) {
      let v = null;
      try {
        v = num(f(s, l));
      } catch (err) {
        v = null;
      }
      const tile = $("tile-" + id);
      tile.dataset.value = v === null ? "" : String(v);
      tile.querySelector(".value").textContent = fmt(v, kind);
      tile.classList.toggle("alarm", (id === "dead-letters" || id === "alerts") && v !== null && v > 0);
    }
  }

  // The charts: each a list of series (a scalar name, a legend name, the right axis for shares).
  const prefixed = (prefix, label) =>
    [...S.keys]
      .filter((k) => k.startsWith(prefix))
      .sort()
      .map((k) => ({ key: k, name: label + " " + k.slice(prefix.length), dash: "dot" }));

  const CHARTS = [
    {
      id: "chart-reward",
      title: "Reward (click a point to inspect its step)",
      series: () => {
        const tenants = prefixed("reward/tenant/", "tenant");
        return [
          { key: "reward/mean", name: "mean", width: 3 },
          ...prefixed("reward/env/", "env"),
          ...(tenants.length > 1 ? tenants : []),
        ];
      },
    },
    {
      id: "chart-loss",
      title: "Loss and learning rate",
      y2: "learning rate",
      series: () => [
        { key: "trainer/loss", name: "loss" },
        { key: "trainer/lr", name: "learning rate", y2: true, dash: "dot" },
      ],
    },
    {
      id: "chart-kl",
      title: "Train / inference mismatch KL",
      series: () => [
        { key: "trainer/mismatch_kl", name: "mean" },
        { key: "trainer/mismatch_kl_max", name: "max" },
      ],
    },
    {
      id: "chart-entropy",
      title: "Entropy and masked share",
      y2: "share",
      series: () => [
        { key: "trainer/entropy", name: "entropy" },
        { key: "trainer/masked_frac", name: "masked share", y2: true },
      ],
    },
    {
      id: "chart-staleness",
      title: "Staleness (steps)",
      series: () => [
        { key: "staleness/mean", name: "trained, mean" },
        { key: "staleness/max", name: "trained, max" },
        { key: "staleness/queued_mean", name: "queued, mean", dash: "dot" },
      ],
    },
    {
      id: "chart-throughput",
      title: "Throughput and idle shares",
      y2: "share",
      series: () => [
        { key: "throughput/tokens_per_s", name: "tokens / s" },
        { key: "trainer/trainer_idle_frac", name: "trainer idle", y2: true },
        { key: "inference/weight_wait_frac", name: "inference weight wait", y2: true },
        { key: "rollouts/truncated_frac", name: "truncated", y2: true, dash: "dot" },
      ],
    },
    {
      id: "chart-queues",
      title: "Queue depths",
      series: () => [
        { key: "queue/pending_rollouts", name: "pending rollouts" },
        { key: "queue/pending_samples", name: "pending samples" },
        { key: "rollouts/withheld", name: "withheld since the step before", dash: "dot" },
        { key: "rollouts/late_samples", name: "late samples since the step before", dash: "dot" },
        { key: "rollouts/dead_letters", name: "dead letters since the step before", dash: "dot" },
      ],
    },
  ];

  function renderCharts() {
    if (typeof window.Plotly === "undefined") {
      for (const c of CHARTS) {
        const div = $(c.id);
        if (!div.querySelector(".empty")) div.replaceChildren(el("div", { class: "empty", text: c.title + ": plotly.js did not load" }));
      }
      return;
    }
    const xs = S.points.map((p) => p.step);
    for (const c of CHARTS) {
      try {
        renderChart(c, xs);
      } catch (err) {
        if (window.console) console.error("monitor: chart " + c.id, err);
      }
    }
  }

  function renderChart(c, xs) {
    const div = $(c.id);
    const series = c.series().filter((s) => S.keys.has(s.key));
    const traces = series.map((s) => ({
      type: "scatter",
      mode: xs.length > 60 ? "lines" : "lines+markers",
      name: s.name,
      x: xs,
      y: S.points.map((p) => get(p, s.key)),
      yaxis: s.y2 ? "y2" : "y",
      line: { width: s.width || 1.5, dash: s.dash || "solid" },
      marker: { size: 4 },
      connectgaps: false,
    }));
    const layout = {
      title: { text: c.title, font: { size: 13 }, x: 0.02, xanchor: "left" },
      margin: { l: 50, r: c.y2 ? 50 : 16, t: 30, b: 36 },
      xaxis: { title: { text: "step", font: { size: 11 } }, zeroline: false },
      yaxis: { zeroline: false, rangemode: "tozero" },
      legend: { orientation: "h", y: -0.22, font: { size: 11 } },
      showlegend: traces.length > 1,
      hovermode: "x unified",
      uirevision: c.id, // zoom and hidden traces survive updates
      paper_bgcolor: "#ffffff",
      plot_bgcolor: "#ffffff",
      annotations: traces.length
        ? []
        : [{ text: "no data yet", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: { color: "#6b7280" } }],
    };
    if (c.y2) {
      layout.yaxis2 = { overlaying: "y", side: "right", range: [0, 1], dtick: 0.25, tickformat: ".0%", showgrid: false, zeroline: false };
    }
    if (c.id === "chart-reward" && S.inspect && num(S.inspect.step) !== null) {
      layout.shapes = [
        {
          type: "line",
          x0: S.inspect.step,
          x1: S.inspect.step,
          yref: "paper",
          y0: 0,
          y1: 1,
          line: { color: "#b91c1c", width: 1, dash: "dot" },
        },
      ];
    }
    window.Plotly.react(div, traces, layout, { displaylogo: false, responsive: true });
    if (c.id === "chart-reward" && !S.charted.has(c.id) && typeof div.on === "function") {
      div.on("plotly_click", (ev) => {
        const p = ev && ev.points && ev.points[0];
        if (p && num(p.x) !== null) openStep(Math.round(p.x));
      });
    }
    S.charted.add(c.id);
    div.dataset.traces = String(traces.length);
    div.dataset.points = String(xs.length);
  }

  function renderTables() {
    const s = S.snapshot || {};
    const workers = Array.isArray(s.workers) ? s.workers : [];
    fillBody(
      "workers",
      workers.map((w) => {
        const age = num(w.heartbeat_age_s);
        return el(
          "tr",
          { class: age !== null && age > 10 ? "stale" : null, dataset: { worker: w.worker_id || "" } },
          el("td", { text: w.worker_id || "?" }),
          el("td", { text: w.kind || "" }),
          el("td", { text: w.status || "" }),
          el("td", { text: num(w.loaded_version) === null ? "–" : String(w.loaded_version) }),
          el("td", { text: fmt(w.inflight, "int") }),
          el("td", { text: age === null ? "–" : age.toFixed(1) + " s" }),
        );
      }),
      6,
      "no worker seen yet",
    );
    const queues = Array.isArray(s.queues) ? s.queues : [];
    fillBody(
      "queues",
      queues.map((q) =>
        el("tr", null, el("td", { text: q.consumer || "?" }), el("td", { text: fmt(q.pending, "int") }), el("td", { text: fmt(q.ack_pending, "int") })),
      ),
      3,
      s.live ? "no durable consumer (yet)" : "only while the run is live",
    );
    const reasons = [];
    for (const [what, o] of [
      ["withheld", s.withheld],
      ["dead letter", s.dead_letters],
    ]) {
      for (const [reason, n] of Object.entries(o || {})) {
        reasons.push(el("tr", null, el("td", { text: what }), el("td", { text: reason }), el("td", { text: fmt(n, "int") })));
      }
    }
    fillBody("reasons", reasons, 3, "none");
    const alerts = Array.isArray(s.alerts) ? s.alerts : [];
    fillBody(
      "alerts",
      alerts.map((a) =>
        el(
          "tr",
          { class: a.state === "firing" ? "firing" : "resolved", dataset: { rule: a.rule || "", state: a.state || "" } },
          el("td", { text: a.rule || "" }),
          el("td", { text: a.key || "" }),
          el("td", { text: a.state || "" }),
          el("td", { text: a.severity || "" }),
          el("td", { text: fmt(a.step, "int") }),
          el("td", { class: "msg", text: a.message || "" }),
          el("td", { text: num(s.now) !== null && num(a.t) !== null ? ago(Math.max(0, s.now - a.t)) + " ago" : "" }),
        ),
      ),
      7,
      "no alert",
    );
    const counts = Object.entries(s.alert_counts || {}).map(([rule, n]) => rule + " ×" + n);
    $("alert-counts").textContent = counts.length ? "fired: " + counts.join(", ") : "";
  }

  // ---------------------------------------------------------------- the inspector

  let inspectSeq = 0;

  async function openStep(step) {
    step = Math.round(Number(step));
    if (!Number.isFinite(step) || step < 0) return;
    const my = ++inspectSeq;
    const box = $("inspector");
    $("step-input").value = String(step);
    box.dataset.state = "loading";
    box.dataset.step = String(step);
    status("loading step " + step + " …");
    try {
      if (location.hash !== "#step=" + step) history.replaceState(null, "", "#step=" + step);
    } catch (err) {
      /* a page opened from a file: no history */
    }
    let body = null;
    let code = 0;
    try {
      const r = await fetch("api/steps/" + step + "/rollouts");
      code = r.status;
      body = await r.json();
    } catch (err) {
      body = { error: String(err) };
    }
    if (my !== inspectSeq) return; // another step was asked for meanwhile
    if (code !== 200 || !body || !Array.isArray(body.rollouts)) {
      box.dataset.state = code === 404 ? "missing" : "error";
      status((body && body.error) || "step " + step + ": no answer (" + code + ")");
      S.inspect = null;
      $("inspector-summary").textContent = "";
      fillBody("rollout-list", [], 11, "no rollouts");
      showRollout(null);
      schedule();
      return;
    }
    S.inspect = body;
    S.selected = 0;
    box.dataset.state = "loaded";
    const n = body.rollouts.length;
    status(
      "step " + step + ": " + n + " rollout" + (n === 1 ? "" : "s") +
        (body.recorded === false ? " · the trainer's per-token log-probs were not recorded for this step" : ""),
    );
    const m = body.metrics || {};
    const parts = [];
    if (num(body.policy_version) !== null) parts.push("trained into version " + body.policy_version);
    if (num(m.mismatch_kl) !== null) parts.push("mismatch KL " + fmt(m.mismatch_kl, "g"));
    if (num(m.mismatch_kl_max) !== null) parts.push("max " + fmt(m.mismatch_kl_max, "g"));
    $("inspector-summary").textContent = parts.join(" · ");
    renderRolloutList();
    showRollout(0);
    schedule(); // the reward chart marks the step
  }

  function status(text) {
    $("inspector-status").textContent = text;
  }

  function renderRolloutList() {
    const rs = S.inspect ? S.inspect.rollouts : [];
    fillBody(
      "rollout-list",
      rs.map((r, i) => {
        if (r.error) {
          return el("tr", { class: "rollout error", dataset: { index: String(i) }, onclick: () => showRollout(i) }, el("td", { text: String(i) }), el("td", { colspan: "10", text: r.error }));
        }
        const parts = Object.entries(r.reward_parts || {})
          .map(([k, v]) => k + "=" + fmt(v, "g"))
          .join(" ");
        const vs = num(r.policy_version_start);
        const ve = num(r.policy_version_end);
        const versions = vs === null ? "–" : ve === null || ve === vs ? String(vs) : vs + "→" + ve;
        return el(
          "tr",
          {
            class: "rollout" + (i === S.selected ? " selected" : ""),
            dataset: { index: String(i), rolloutId: r.rollout_id || "", reward: num(r.reward) === null ? "" : String(r.reward) },
            onclick: () => showRollout(i),
          },
          el("td", { text: String(i) }),
          el("td", { text: r.env || "" }),
          el("td", { text: r.tenant || "" }),
          el("td", { text: fmt(r.reward, "f3") }),
          el("td", { text: parts }),
          el("td", { text: versions }),
          el("td", { text: fmt(r.staleness, "int") }),
          el("td", { text: r.finish_reason || "–" }),
          el("td", { text: fmt(r.gap_abs_mean, "g") }),
          el("td", { text: fmt(r.gap_abs_max, "g") }),
          el("td", { text: fmt(r.route_diff_tokens, "int") }),
        );
      }),
      11,
      "no rollouts",
    );
  }

  // A diverging scale (ColorBrewer RdBu): blue where the trainer gives the token a lower
  // log-prob than inference did, red where higher, white where they agree.
  const BLUE = [33, 102, 172];
  const MID = [247, 247, 247];
  const RED = [178, 24, 43];

  function gapColour(gap, scale) {
    const t = Math.max(-1, Math.min(1, gap / scale));
    const end = t < 0 ? BLUE : RED;
    const a = Math.abs(t);
    const c = MID.map((m, i) => Math.round(m + (end[i] - m) * a));
    return { bg: "rgb(" + c.join(",") + ")", ink: a > 0.6 ? "#ffffff" : "#111827" };
  }

  function gapScale() {
    const chosen = $("gap-scale").value;
    if (chosen !== "auto") return Number(chosen);
    let m = 0;
    for (const r of (S.inspect && S.inspect.rollouts) || []) {
      for (const t of r.tokens || []) {
        const g = num(t.gap);
        if (g !== null) m = Math.max(m, Math.abs(g));
      }
    }
    return m > 0 ? Number(m.toPrecision(2)) : 0.01;
  }

  function renderLegend(scale) {
    const bar = "linear-gradient(to right, rgb(" + BLUE.join(",") + "), rgb(" + MID.join(",") + "), rgb(" + RED.join(",") + "))";
    $("gap-legend").replaceChildren(
      el("span", { text: "gap = trainer log-prob − inference log-prob" }),
      el(
        "span",
        null,
        el("div", { class: "bar", style: "background:" + bar }),
        el("div", { class: "ends" }, el("span", { text: "−" + fmt(scale, "g") }), el("span", { text: "0" }), el("span", { text: "+" + fmt(scale, "g") })),
      ),
      el("span", null, el("span", { class: "token-sample routed", text: "tok" }), " the trainer's router disagreed with the replayed route"),
      el("span", null, el("span", { class: "token-sample env", text: "tok" }), " environment tokens (not trained)"),
      el("span", null, el("span", { class: "token-sample nogap", text: "tok" }), " no gap known"),
    );
  }

  function visible(text) {
    if (text === "") return "∅";
    return text.replace(/\n/g, "↵\n").replace(/\t/g, "⇥");
  }

  function tooltip(t, i) {
    const lines = ["token " + i + (num(t.id) !== null ? " · id " + t.id : "") + " · " + JSON.stringify(t.text)];
    lines.push(t.model === false ? "environment token (not trained)" : "model token");
    lines.push("inference log-prob " + fmt(t.inference_lp, "g"));
    lines.push("trainer log-prob " + fmt(t.train_lp, "g"));
    const g = num(t.gap);
    lines.push("gap " + (g === null ? "–" : (g > 0 ? "+" : "") + fmt(g, "g")));
    const rd = num(t.route_diff);
    lines.push("route differences " + (rd === null ? "–" : rd + " layer" + (rd === 1 ? "" : "s")));
    return lines.join("\n");
  }

  function showRollout(i) {
    const rs = S.inspect ? S.inspect.rollouts : [];
    const box = $("tokens");
    const r = i === null || i === undefined ? null : rs[i];
    for (const tr of $("rollout-list").querySelectorAll("tbody tr.rollout")) {
      tr.classList.toggle("selected", Number(tr.dataset.index) === i);
    }
    if (!r) {
      box.replaceChildren();
      box.dataset.count = "0";
      $("rollout-prompt").textContent = "";
      $("rollout-head").textContent = "";
      $("gap-legend").replaceChildren();
      return;
    }
    S.selected = i;
    const scale = gapScale();
    const tokens = Array.isArray(r.tokens) ? r.tokens : [];
    if (tokens.length) renderLegend(scale);
    else $("gap-legend").replaceChildren();
    $("rollout-head").textContent =
      "rollout " + i + (r.rollout_id ? " · " + r.rollout_id : "") + " · reward " + fmt(r.reward, "f3") +
      (r.turns ? " · " + r.turns + " turn" + (r.turns === 1 ? "" : "s") : "");
    $("rollout-prompt").textContent = r.prompt_text || "";
    const spans = tokens.map((t, k) => {
      const g = num(t.gap);
      const rd = num(t.route_diff);
      const cls = ["token"];
      if (t.model === false) cls.push("env");
      else if (g === null) cls.push("nogap");
      if (rd !== null && rd > 0) cls.push("routed");
      if (/^<[^<>\s]+>$/.test(t.text || "")) cls.push("special");
      const span = el("span", {
        class: cls.join(" "),
        title: tooltip(t, k),
        dataset: {
          index: String(k),
          gap: g === null ? "" : String(g),
          routeDiff: rd === null ? "" : String(rd),
          model: t.model === false ? "false" : "true",
        },
        text: visible(String(t.text === undefined || t.text === null ? "" : t.text)),
      });
      if (t.model !== false && g !== null) {
        const c = gapColour(g, scale);
        span.style.background = c.bg;
        span.style.color = c.ink;
      }
      return span;
    });
    if (!spans.length) {
      const why = r.error || r.note || (r.completion_text ? "" : "no tokens for this rollout");
      box.replaceChildren(el("span", { class: "muted", text: why || r.completion_text }));
    } else {
      box.replaceChildren(...spans);
    }
    box.dataset.count = String(spans.length);
  }

  // ---------------------------------------------------------------- wiring

  function wire() {
    $("step-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const v = $("step-input").value;
      if (v !== "") openStep(v);
    });
    const current = () => {
      const v = Number($("step-input").value);
      return Number.isFinite(v) && $("step-input").value !== "" ? v : S.lastStep;
    };
    $("step-prev").addEventListener("click", () => openStep(Math.max(0, current() - 1)));
    $("step-next").addEventListener("click", () => openStep(current() + 1));
    $("step-latest").addEventListener("click", () => {
      if (S.lastStep >= 0) openStep(S.lastStep);
    });
    $("gap-scale").addEventListener("change", () => {
      if (S.inspect) showRollout(S.selected);
    });
    const m = /^#step=(\d+)$/.exec(location.hash);
    if (m) openStep(Number(m[1]));
    window.jetrlMonitor = { state: S, openStep }; // for a console (and a browser test) to look at
  }

  wire();
  render();
  connect();
})();
