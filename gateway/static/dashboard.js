// The dashboard: the scheduler's live view, pushed by /dashboard/ws about four
// times a second. Per worker the recent iterations (one column each), the K/V
// blocks and what runs; per tenant its VTC service over the last 2 minutes
// (kept here, bounded) and what waits and runs. Work is bounded: the elements
// are made once and reused, and at most one redraw happens per frame. Tenant
// names and server text are only ever set as text.
"use strict";

(function () {
  const { Connection, bindKeyInput, setBanner } = window.Orcapod;
  const MAX_STEPS = 64; // as many as a snapshot holds per worker
  const HISTORY_MS = 120000;
  const MIN_SPAN_MS = 10000;
  const MAX_HISTORY = 600; // snapshots kept: 2 minutes at 4 a second, with room
  const MAX_CHART_TENANTS = 64;
  const SVG_NS = "http://www.w3.org/2000/svg";

  const byId = (id) => document.getElementById(id);
  const view = byId("view");
  const summary = byId("summary");
  const workersElement = byId("workers");
  const tenantsBody = byId("tenants");
  const noTenants = byId("no-tenants");
  const chart = byId("service-chart");
  const banner = byId("banner");
  const settings = byId("settings");

  let latest = null; // the newest snapshot frame
  let drawScheduled = false;
  // [{timeMs, service: Map(tenant -> service)}], oldest first, within HISTORY_MS of the newest.
  const history = [];
  const workerCards = new Map(); // worker_id -> its elements
  const tenantRows = new Map(); // tenant -> its elements
  let connectionProblem = null; // [kind, text] while the socket is not open
  let unavailableText = null; // while the server says no scheduler publishes

  const connection = new Connection("/dashboard/ws", { onFrame, onStatus });

  function make(tag, className, text) {
    const element = document.createElement(tag);
    if (className) element.className = className;
    if (text !== undefined) element.textContent = text;
    return element;
  }

  function showBanner() {
    if (connectionProblem !== null) setBanner(banner, connectionProblem[0], connectionProblem[1]);
    else if (unavailableText !== null) setBanner(banner, "warn", unavailableText);
    else setBanner(banner, "info", "");
  }

  // --- frames -----------------------------------------------------------------------

  function onStatus(kind, text) {
    if (kind === "open") {
      connectionProblem = null;
    } else {
      connectionProblem = [kind === "reconnecting" ? "warn" : "error", text];
      view.classList.add("stale");
      if (kind === "refused") settings.open = true;
    }
    showBanner();
  }

  function onFrame(frame) {
    if (frame.type === "snapshot") {
      unavailableText = null;
      view.classList.remove("stale");
      record(frame);
      latest = frame;
      scheduleDraw();
    } else if (frame.type === "unavailable") {
      unavailableText = `No live view: ${frame.message}`;
      view.classList.add("stale");
    } else {
      return; // a frame type this page does not know
    }
    showBanner();
  }

  function record(frame) {
    const newest = history.length ? history[history.length - 1].timeMs : -Infinity;
    if (frame.time_ms <= newest) return;
    const service = new Map();
    for (const tenant of frame.tenants) service.set(tenant.tenant, tenant.service);
    history.push({ timeMs: frame.time_ms, service });
    while (
      history.length > MAX_HISTORY ||
      (history.length && history[0].timeMs < frame.time_ms - HISTORY_MS)
    ) {
      history.shift();
    }
  }

  function scheduleDraw() {
    if (drawScheduled) return;
    drawScheduled = true;
    requestAnimationFrame(() => {
      drawScheduled = false;
      if (latest !== null) draw(latest);
    });
  }

  // --- drawing ----------------------------------------------------------------------

  function draw(frame) {
    const clock = new Date(frame.time_ms).toLocaleTimeString();
    const parts = [
      `policy ${frame.policy}`,
      `${frame.num_waiting} waiting`,
      `${frame.workers.length} worker${frame.workers.length === 1 ? "" : "s"}`,
      `updated ${clock}`,
    ];
    if (frame.operator) parts.push("operator view: every tenant by name");
    summary.textContent = parts.join(" · ");
    drawWorkers(frame.workers);
    drawTenants(frame.tenants);
    drawServiceChart(frame.time_ms);
  }

  function createWorkerCard(workerId) {
    const card = make("article", "worker");
    const title = make("h3", "", workerId);
    const stats = make("p", "stats");
    const kvBar = make("div", "kv-bar");
    const kvUsed = make("span", "kv-used");
    const kvCached = make("span", "kv-cached");
    kvBar.append(kvUsed, kvCached);
    const kvLegend = make("p", "kv-legend");
    const timeline = make("div", "timeline");
    const columns = make("div", "steps");
    const steps = [];
    for (let i = 0; i < MAX_STEPS; i++) {
      const step = make("div", "step empty");
      const bar = make("div", "bar");
      const prefill = make("span", "prefill");
      const decode = make("span", "decode");
      bar.append(prefill, decode);
      const num = make("span", "num");
      step.append(bar, num);
      columns.append(step);
      steps.push({ step, bar, prefill, decode, num });
    }
    const svg = document.createElementNS(SVG_NS, "svg");
    svg.setAttribute("class", "step-ms");
    svg.setAttribute("viewBox", `0 0 ${MAX_STEPS} 100`);
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("aria-hidden", "true");
    const line = document.createElementNS(SVG_NS, "path");
    svg.append(line);
    timeline.append(columns, svg);
    const caption = make("p", "caption");
    card.append(title, stats, kvBar, kvLegend, timeline, caption);
    workersElement.append(card);
    return { card, stats, kvUsed, kvCached, kvLegend, steps, line, caption };
  }

  function drawWorkers(workers) {
    const present = new Set();
    for (const worker of workers) {
      present.add(worker.worker_id);
      let card = workerCards.get(worker.worker_id);
      if (card === undefined) {
        card = createWorkerCard(worker.worker_id);
        workerCards.set(worker.worker_id, card);
      }
      drawWorker(card, worker);
    }
    for (const [workerId, card] of workerCards) {
      if (!present.has(workerId)) {
        card.card.remove();
        workerCards.delete(workerId);
      }
    }
  }

  function drawWorker(card, worker) {
    card.stats.textContent = `${worker.num_running} running`;
    const total = Math.max(worker.blocks_total, 1);
    const free = Math.max(worker.blocks_total - worker.blocks_used - worker.blocks_cached, 0);
    card.kvUsed.style.width = `${(100 * worker.blocks_used) / total}%`;
    card.kvCached.style.width = `${(100 * worker.blocks_cached) / total}%`;
    card.kvLegend.textContent =
      `K/V blocks: ${worker.blocks_used} used · ${worker.blocks_cached} cached · ` +
      `${free} free of ${worker.blocks_total}`;

    const steps = worker.steps.slice(-MAX_STEPS);
    const offset = MAX_STEPS - steps.length;
    let maxTokens = 1;
    let maxMs = 0;
    for (const step of steps) {
      maxTokens = Math.max(maxTokens, step.num_prefill_tokens + step.num_decode_tokens);
      if (typeof step.step_ms === "number") maxMs = Math.max(maxMs, step.step_ms);
    }
    let path = "";
    let penDown = false;
    for (let i = 0; i < MAX_STEPS; i++) {
      const column = card.steps[i];
      const step = i >= offset ? steps[i - offset] : null;
      column.step.classList.toggle("empty", step === null);
      if (step === null) {
        column.bar.style.height = "0";
        column.num.textContent = "";
        column.step.title = "";
        penDown = false;
        continue;
      }
      const numTokens = step.num_prefill_tokens + step.num_decode_tokens;
      // Columns reach 85% at most: the request count sits above the tallest.
      const heightPct = (85 * numTokens) / maxTokens;
      column.bar.style.height = `${heightPct}%`;
      column.prefill.style.flexGrow = String(step.num_prefill_tokens);
      column.decode.style.flexGrow = String(step.num_decode_tokens);
      column.num.style.bottom = `${heightPct}%`;
      column.num.textContent = String(step.num_requests);
      column.step.title = describeStep(step);
      if (typeof step.step_ms === "number" && maxMs > 0) {
        const y = 100 - (90 * step.step_ms) / maxMs;
        path += `${penDown ? "L" : "M"}${i + 0.5} ${y.toFixed(1)}`;
        penDown = true;
      } else {
        penDown = false;
      }
    }
    card.line.setAttribute("d", path);
    card.card.dataset.numSteps = String(steps.length);
    if (steps.length === 0) {
      card.caption.textContent = "no iteration yet";
      delete card.card.dataset.lastStep;
      return;
    }
    const last = steps[steps.length - 1];
    card.card.dataset.lastStep = String(last.step_index);
    const scale = `scale: ${maxTokens} tokens` + (maxMs > 0 ? `, ${maxMs.toFixed(1)} ms` : "");
    // The newest step whose result is in: its time and the path it took.
    const done = steps.findLast((step) => typeof step.step_ms === "number") || last;
    card.caption.textContent = `last ${describeStep(done)} · ${scale}`;
  }

  function describeStep(step) {
    const ms =
      typeof step.step_ms === "number"
        ? `${step.step_ms.toFixed(1)} ms${step.path ? ` on ${step.path}` : ""}`
        : "running";
    return (
      `step #${step.step_index}: ${step.num_requests} request` +
      `${step.num_requests === 1 ? "" : "s"}, ${step.num_prefill_tokens} prefill + ` +
      `${step.num_decode_tokens} decode tokens, ${ms} ` +
      `(+${step.num_joined} joined, −${step.num_left} left)`
    );
  }

  // A colour of its own for each tenant, in the order they appear, the same on
  // every draw (the map is bounded: past MAX_COLOURS names it starts afresh).
  const PALETTE = ["#d1495b", "#2e86de", "#2a9d5c", "#8e44ad", "#e67e22", "#16a2a8", "#7f8c3a"];
  const MAX_COLOURS = 256;
  const colours = new Map();
  function colourOf(name) {
    let colour = colours.get(name);
    if (colour === undefined) {
      if (colours.size >= MAX_COLOURS) colours.clear();
      const index = colours.size;
      colour =
        index < PALETTE.length ? PALETTE[index] : `hsl(${(index * 137.5) % 360} 60% 48%)`;
      colours.set(name, colour);
    }
    return colour;
  }

  function formatService(service) {
    return Math.round(service).toLocaleString("en-US");
  }

  function drawTenants(tenants) {
    const present = new Set();
    for (const tenant of tenants) {
      present.add(tenant.tenant);
      let row = tenantRows.get(tenant.tenant);
      if (row === undefined) {
        const tr = make("tr");
        const nameCell = make("td", "tenant-name");
        const swatch = make("span", "swatch");
        const name = make("span", "", tenant.tenant);
        const you = make("span", "you", "you");
        nameCell.append(swatch, name, you);
        const service = make("td", "number");
        const waiting = make("td", "number");
        const running = make("td", "number");
        tr.append(nameCell, service, waiting, running);
        row = { tr, swatch, you, service, waiting, running };
        tenantRows.set(tenant.tenant, row);
      }
      row.swatch.style.backgroundColor = colourOf(tenant.tenant);
      row.you.hidden = !tenant.you;
      row.tr.classList.toggle("yours", Boolean(tenant.you));
      row.service.textContent = formatService(tenant.service);
      row.waiting.textContent = String(tenant.num_waiting);
      row.running.textContent = String(tenant.num_running);
      tenantsBody.append(row.tr); // in the snapshot's order (most service first)
    }
    for (const [name, row] of tenantRows) {
      if (!present.has(name)) {
        row.tr.remove();
        tenantRows.delete(name);
      }
    }
    noTenants.hidden = tenants.length > 0;
  }

  function drawServiceChart(nowMs) {
    const dpr = window.devicePixelRatio || 1;
    const width = Math.round(chart.clientWidth * dpr);
    const height = Math.round(chart.clientHeight * dpr);
    if (width === 0 || height === 0) return;
    if (chart.width !== width || chart.height !== height) {
      chart.width = width;
      chart.height = height;
    }
    const context = chart.getContext("2d");
    const style = getComputedStyle(document.body);
    const ink = style.getPropertyValue("--muted").trim() || "#666";
    const grid = style.getPropertyValue("--line").trim() || "#ddd";
    context.clearRect(0, 0, width, height);
    const pad = { left: 8 * dpr, right: 8 * dpr, top: 16 * dpr, bottom: 16 * dpr };
    const plotWidth = width - pad.left - pad.right;
    const plotHeight = height - pad.top - pad.bottom;

    const names = [];
    const chosen = new Set();
    for (const name of latest.tenants.map((tenant) => tenant.tenant)) {
      if (names.length < MAX_CHART_TENANTS && !chosen.has(name)) {
        names.push(name);
        chosen.add(name);
      }
    }
    let maxService = 0;
    for (const point of history) {
      for (const name of names) {
        const service = point.service.get(name);
        if (service !== undefined) maxService = Math.max(maxService, service);
      }
    }
    maxService = maxService > 0 ? maxService * 1.1 : 1;
    // The last 2 minutes, or less while the page has seen less (at least 10 s).
    const oldestMs = history.length ? history[0].timeMs : nowMs;
    const spanMs = Math.min(Math.max(nowMs - oldestMs, MIN_SPAN_MS), HISTORY_MS);
    const x = (timeMs) => pad.left + plotWidth * (1 - (nowMs - timeMs) / spanMs);
    const y = (service) => pad.top + plotHeight * (1 - service / maxService);

    context.strokeStyle = grid;
    context.lineWidth = dpr;
    for (let i = 0; i <= 4; i++) {
      const gridY = Math.round(pad.top + (plotHeight * i) / 4) + 0.5;
      context.beginPath();
      context.moveTo(pad.left, gridY);
      context.lineTo(width - pad.right, gridY);
      context.stroke();
    }
    context.fillStyle = ink;
    context.font = `${11 * dpr}px system-ui, sans-serif`;
    context.textBaseline = "alphabetic";
    context.textAlign = "left";
    context.fillText(formatService(maxService), pad.left, pad.top - 4 * dpr);
    const spanText = spanMs >= HISTORY_MS ? "2 min" : `${Math.round(spanMs / 1000)} s`;
    context.fillText(`−${spanText}`, pad.left, height - 3 * dpr);
    context.textAlign = "right";
    context.fillText("now", width - pad.right, height - 3 * dpr);

    context.lineWidth = 2 * dpr;
    context.lineJoin = "round";
    for (const name of names) {
      context.strokeStyle = colourOf(name);
      context.beginPath();
      let penDown = false;
      for (const point of history) {
        const service = point.service.get(name);
        if (service === undefined) {
          penDown = false;
          continue;
        }
        if (penDown) context.lineTo(x(point.timeMs), y(service));
        else context.moveTo(x(point.timeMs), y(service));
        penDown = true;
      }
      context.stroke();
    }
  }

  // --- wiring -----------------------------------------------------------------------

  bindKeyInput(byId("api-key"), (key) => connection.setKey(key));
  window.addEventListener("resize", scheduleDraw);
  connection.start();
})();
