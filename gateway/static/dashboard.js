// The dashboard: the scheduler's live view, pushed by /dashboard/ws about four
// times a second. Per worker the recent iterations (one column each, with the
// step time's axis in ms and when each was first seen), the K/V blocks and
// what runs; per tenant its VTC service over the last 2 minutes and what waits
// and runs. The feed lists only tenants with a live request, so the page keeps
// each tenant's line after it goes idle until its last point leaves the chart
// (bounded: MAX_IDLE_TENANTS, the longest idle dropped first). Work is bounded:
// the elements are made once and reused, and at most one redraw happens per
// frame. Tenant names and server text are only ever set as text.
"use strict";

(function () {
  const { Connection, bindKeyInput, setBanner } = window.Orcapod;
  const MAX_STEPS = 64; // as many as a snapshot holds per worker
  const HISTORY_MS = 120000;
  const MIN_SPAN_MS = 10000;
  const MAX_POINTS = 600; // per tenant: 2 minutes at 4 snapshots a second, with room
  const MAX_CHART_TENANTS = 64; // taken from one snapshot (the feed sends at most 64)
  const MAX_IDLE_TENANTS = 32; // kept after they left the feed, on top of those
  // A snapshot later than this after the one before follows a gap (a reconnect, a
  // stopped scheduler; the live view's key outlives a write by 5 s): the steps it
  // brings in are of unknown age.
  const MAX_FRAME_GAP_MS = 5000;
  // The step-time line spans the bottom 90% of its plot; the axis's ticks are
  // 0, half and the whole of a nice number at or above the longest step.
  const STEP_MS_SPAN_PCT = 90;
  const TICK_FRACTIONS = [0, 0.5, 1];
  const NICE_MANTISSAS = [1, 2, 3, 4, 5, 6, 8, 10];
  const SVG_NS = "http://www.w3.org/2000/svg";

  const byId = (id) => document.getElementById(id);
  const view = byId("view");
  const summary = byId("summary");
  const workersElement = byId("workers");
  const tenantsBody = byId("tenants");
  const noTenants = byId("no-tenants");
  const chart = byId("service-chart");
  const idleTenants = byId("idle-tenants");
  const idleList = byId("idle-list");
  const banner = byId("banner");
  const settings = byId("settings");

  let latest = null; // the newest snapshot frame
  let drawScheduled = false;
  let previousFrameMs = null; // time_ms of the newest snapshot recorded
  let firstFrameMs = null; // of the first: the chart spans less while the page has seen less
  // tenant -> {points: [{timeMs, service, startsLine}], lastSeenMs, you}, points
  // oldest first and within HISTORY_MS of the newest snapshot; a tenant the
  // newest snapshot does not list (lastSeenMs older) is idle.
  const series = new Map();
  // worker_id -> Map(step_index -> time_ms of the snapshot it first came in, or
  // null when that snapshot followed a gap), for the steps the newest one lists.
  const stepsSeen = new Map();
  const workerCards = new Map(); // worker_id -> its elements
  const tenantRows = new Map(); // tenant -> its elements
  const idleItems = new Map(); // idle tenant -> its legend entry
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
    const nowMs = frame.time_ms;
    if (previousFrameMs !== null && nowMs <= previousFrameMs) return;
    const afterGap = previousFrameMs === null || nowMs - previousFrameMs > MAX_FRAME_GAP_MS;
    recordSteps(frame.workers, afterGap ? null : nowMs);
    recordService(frame.tenants, nowMs);
    if (firstFrameMs === null) firstFrameMs = nowMs;
    previousFrameMs = nowMs;
  }

  function recordSteps(workers, seenMs) {
    const present = new Set();
    for (const worker of workers) {
      present.add(worker.worker_id);
      const before = stepsSeen.get(worker.worker_id) || new Map();
      const seen = new Map();
      for (const step of worker.steps.slice(-MAX_STEPS)) {
        const known = before.get(step.step_index);
        seen.set(step.step_index, known !== undefined ? known : seenMs);
      }
      stepsSeen.set(worker.worker_id, seen);
    }
    for (const workerId of [...stepsSeen.keys()]) {
      if (!present.has(workerId)) stepsSeen.delete(workerId);
    }
  }

  function recordService(tenants, nowMs) {
    const listed = new Set();
    for (const tenant of tenants) {
      if (listed.size >= MAX_CHART_TENANTS) break;
      if (listed.has(tenant.tenant)) continue;
      listed.add(tenant.tenant);
      let kept = series.get(tenant.tenant);
      if (kept === undefined) {
        kept = { points: [], lastSeenMs: null, you: false };
        series.set(tenant.tenant, kept);
      }
      // A tenant back from idle starts a new line rather than bridging the gap.
      const startsLine = kept.lastSeenMs === null || kept.lastSeenMs !== previousFrameMs;
      kept.points.push({ timeMs: nowMs, service: tenant.service, startsLine });
      if (kept.points.length > MAX_POINTS) kept.points.shift();
      kept.lastSeenMs = nowMs;
      kept.you = Boolean(tenant.you);
    }
    const idle = [];
    for (const [name, kept] of series) {
      const points = kept.points;
      while (points.length && points[0].timeMs < nowMs - HISTORY_MS) points.shift();
      if (points.length === 0) series.delete(name);
      else if (kept.lastSeenMs < nowMs) idle.push([kept.lastSeenMs, name]);
    }
    if (idle.length > MAX_IDLE_TENANTS) {
      idle.sort((a, b) => a[0] - b[0]); // the longest idle first
      for (const [, name] of idle.slice(0, idle.length - MAX_IDLE_TENANTS)) series.delete(name);
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
    view.dataset.timeMs = String(frame.time_ms); // the snapshot drawn
    drawWorkers(frame.workers, frame.time_ms);
    drawTenants(frame.tenants);
    // The tenants' lines as of the newest snapshot recorded (a re-sent or late
    // one is drawn but not recorded).
    drawServiceChart(previousFrameMs);
    drawIdleTenants(previousFrameMs);
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
    const plot = make("div", "plot");
    const yAxis = make("div", "y-axis");
    const ticks = [];
    for (const fraction of TICK_FRACTIONS) {
      const position = `${STEP_MS_SPAN_PCT * fraction}%`;
      if (fraction > 0) {
        const gridline = make("div", "gridline");
        gridline.style.bottom = position;
        plot.append(gridline); // before the columns: drawn under them
      }
      const tick = make("span", "tick");
      tick.style.bottom = position;
      yAxis.append(tick);
      ticks.push(tick);
    }
    const xAxis = make("div", "x-axis");
    const oldestLabel = make("span", "oldest");
    const countLabel = make("span", "count");
    const newestLabel = make("span", "newest");
    xAxis.append(oldestLabel, countLabel, newestLabel);
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
    plot.append(columns, svg);
    // A worker group's rows of stages, under the columns, their labels on the right.
    const stages = make("div", "stages");
    const stageLabels = make("div", "stage-labels");
    stages.hidden = true;
    stageLabels.hidden = true;
    timeline.append(plot, yAxis, xAxis, stages, stageLabels);
    const caption = make("p", "caption");
    card.append(title, stats, kvBar, kvLegend, timeline, caption);
    workersElement.append(card);
    const axes = { yAxis, ticks, oldestLabel, countLabel, newestLabel };
    const pipeline = { stages, stageLabels, rows: [] };
    return { card, stats, kvUsed, kvCached, kvLegend, steps, line, axes, pipeline, caption };
  }

  function drawWorkers(workers, nowMs) {
    const present = new Set();
    for (const worker of workers) {
      present.add(worker.worker_id);
      let card = workerCards.get(worker.worker_id);
      if (card === undefined) {
        card = createWorkerCard(worker.worker_id);
        workerCards.set(worker.worker_id, card);
      }
      drawWorker(card, worker, nowMs);
    }
    for (const [workerId, card] of workerCards) {
      if (!present.has(workerId)) {
        card.card.remove();
        workerCards.delete(workerId);
      }
    }
  }

  function drawWorker(card, worker, nowMs) {
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
    const axisMs = maxMs > 0 ? niceCeiling(maxMs) : 0;
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
      if (typeof step.step_ms === "number" && axisMs > 0) {
        const y = 100 - (STEP_MS_SPAN_PCT * step.step_ms) / axisMs;
        path += `${penDown ? "L" : "M"}${i + 0.5} ${y.toFixed(1)}`;
        penDown = true;
      } else {
        penDown = false;
      }
    }
    card.line.setAttribute("d", path);
    drawStepAxes(card.axes, worker.worker_id, steps, axisMs, nowMs);
    drawStages(card.pipeline, worker, steps, offset);
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

  // A worker group's pipeline (Orca's Figure 8): one row per stage under the
  // iterations, each iteration's cell as dark as that stage's compute time for it
  // (the longest shown darkest), and each stage's mean time on its label.
  function drawStages(pipeline, worker, steps, offset) {
    const depth = Number.isInteger(worker.pipeline_depth) ? worker.pipeline_depth : 1;
    pipeline.stages.hidden = depth < 2;
    pipeline.stageLabels.hidden = depth < 2;
    if (depth < 2) return;
    if (pipeline.rows.length !== depth) {
      pipeline.stages.replaceChildren();
      pipeline.stageLabels.replaceChildren();
      pipeline.rows = [];
      for (let s = 0; s < depth; s++) {
        const row = make("div", "stage-row");
        row.dataset.stage = String(s + 1);
        const cells = [];
        for (let i = 0; i < MAX_STEPS; i++) {
          const cell = make("span", "stage-cell");
          row.append(cell);
          cells.push(cell);
        }
        const label = make("span", "stage-label");
        pipeline.stages.append(row);
        pipeline.stageLabels.append(label);
        pipeline.rows.push({ row, cells, label });
      }
    }
    const timesOf = (step) =>
      step !== null &&
      Array.isArray(step.stage_ms) &&
      step.stage_ms.length === depth &&
      step.stage_ms.every((ms) => typeof ms === "number" && Number.isFinite(ms) && ms >= 0)
        ? step.stage_ms
        : null;
    let maxMs = 0;
    for (const step of steps) {
      const times = timesOf(step);
      if (times !== null) maxMs = Math.max(maxMs, ...times);
    }
    pipeline.rows.forEach(({ row, cells, label }, s) => {
      let total = 0;
      let count = 0;
      cells.forEach((cell, i) => {
        const step = i >= offset ? steps[i - offset] : null;
        const times = timesOf(step);
        if (times === null) {
          cell.style.opacity = "0";
          cell.title = "";
          delete cell.dataset.ms;
          return;
        }
        const ms = times[s];
        cell.style.opacity = String(maxMs > 0 ? 0.15 + (0.85 * ms) / maxMs : 0.15);
        cell.dataset.ms = ms.toFixed(1);
        cell.title = `step #${step.step_index}, stage ${s + 1}: ${ms.toFixed(1)} ms`;
        total += ms;
        count += 1;
      });
      row.dataset.numSteps = String(count);
      label.textContent =
        count > 0 ? `stage ${s + 1} · ${(total / count).toFixed(1)} ms` : `stage ${s + 1}`;
    });
  }

  // The step-time axis (ms, to `axisMs`; blank before any step time is in) and,
  // under the columns, the oldest and newest step with how long ago each came in.
  function drawStepAxes(axes, workerId, steps, axisMs, nowMs) {
    axes.yAxis.dataset.maxMs = String(axisMs);
    TICK_FRACTIONS.forEach((fraction, i) => {
      const value = axisMs * fraction;
      const unit = fraction === 1 ? " ms" : "";
      axes.ticks[i].textContent = axisMs > 0 ? `${formatMs(value)}${unit}` : "";
    });
    const seen = stepsSeen.get(workerId) || new Map();
    const describe = (step) => {
      const seenMs = seen.get(step.step_index);
      const age = typeof seenMs === "number" ? ` · ${formatAge(nowMs - seenMs)}` : "";
      return `#${step.step_index}${age}`;
    };
    const n = steps.length;
    axes.oldestLabel.textContent = n ? describe(steps[0]) : "";
    axes.countLabel.textContent = n ? `${n} iteration${n === 1 ? "" : "s"}` : "";
    axes.newestLabel.textContent = n > 1 ? describe(steps[n - 1]) : "";
  }

  /** The smallest of 1, 2, 3, 4, 5, 6, 8 times a power of ten at or above `value` (> 0). */
  function niceCeiling(value) {
    const power = 10 ** Math.floor(Math.log10(value));
    const mantissa = NICE_MANTISSAS.find((m) => m * power >= value * (1 - 1e-9));
    return Number((mantissa * power).toPrecision(6));
  }

  function formatMs(ms) {
    return Number(ms.toPrecision(3)).toLocaleString("en-US", { maximumFractionDigits: 3 });
  }

  function formatAge(ageMs) {
    return ageMs < 1000 ? "now" : `−${formatDuration(ageMs)}`;
  }

  function formatDuration(ms) {
    const seconds = Math.round(ms / 1000);
    return seconds < 120 ? `${seconds} s` : `${Math.round(seconds / 60)} min`;
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

    let maxService = 0;
    for (const kept of series.values()) {
      for (const point of kept.points) maxService = Math.max(maxService, point.service);
    }
    maxService = maxService > 0 ? maxService * 1.1 : 1;
    // The last 2 minutes, or less while the page has seen less (at least 10 s).
    const oldestMs = firstFrameMs !== null ? firstFrameMs : nowMs;
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
    for (const [name, kept] of series) {
      const colour = colourOf(name);
      context.strokeStyle = colour;
      context.beginPath();
      for (const point of kept.points) {
        if (point.startsLine) context.moveTo(x(point.timeMs), y(point.service));
        else context.lineTo(x(point.timeMs), y(point.service));
      }
      context.stroke();
      if (kept.lastSeenMs < nowMs) {
        // An idle tenant's line ends in a dot where it went idle.
        const last = kept.points[kept.points.length - 1];
        context.fillStyle = colour;
        context.beginPath();
        context.arc(x(last.timeMs), y(last.service), 3 * dpr, 0, 2 * Math.PI);
        context.fill();
      }
    }
    chart.dataset.numLines = String(series.size);
  }

  // Under the chart, the tenants whose lines it still holds but the feed no
  // longer lists (the table shows only those with a request waiting or running).
  function drawIdleTenants(nowMs) {
    const idle = new Set();
    for (const [name, kept] of series) {
      if (kept.lastSeenMs >= nowMs) continue;
      idle.add(name);
      let item = idleItems.get(name);
      if (item === undefined) {
        const li = make("li");
        const swatch = make("span", "swatch");
        const label = make("span", "", name);
        const you = make("span", "you", "you");
        const since = make("span", "since");
        li.append(swatch, label, you, since);
        item = { li, swatch, you, since };
        idleItems.set(name, item);
      }
      item.swatch.style.backgroundColor = colourOf(name);
      item.you.hidden = !kept.you;
      item.since.textContent = `idle ${formatDuration(nowMs - kept.lastSeenMs)}`;
      item.li.dataset.tenant = name;
      item.li.dataset.numPoints = String(kept.points.length);
      idleList.append(item.li); // in the order the page first saw them
    }
    for (const [name, item] of idleItems) {
      if (!idle.has(name)) {
        item.li.remove();
        idleItems.delete(name);
      }
    }
    idleTenants.hidden = idle.size === 0;
  }

  // --- wiring -----------------------------------------------------------------------

  bindKeyInput(byId("api-key"), (key) => connection.setKey(key));
  window.addEventListener("resize", scheduleDraw);
  connection.start();
})();
