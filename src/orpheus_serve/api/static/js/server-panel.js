// The server panel: GET /v1/stats, /metrics and /ready once a second.
//
// /v1/stats gives counters and gauges; rates are the change between two snapshots over the server's
// own clock (uptime_s), so they are live rather than averages since start. TTFB percentiles come
// from the Prometheus histogram orpheus:time_to_first_byte_seconds (every protocol), over the last
// minute when it saw requests, else since start, interpolated within buckets as Prometheus'
// histogram_quantile() does.

import { getJSON, getMetricsText } from "./api.js";

const POLL_MS = 1000;
const SPARK_POINTS = 60;
const TTFB_WINDOW_S = 60;
const TTFB_HISTOGRAM = "orpheus:time_to_first_byte_seconds";
// One Orpheus frame is 7 tokens and decodes to 2048 samples at 24 kHz.
const TOKENS_PER_AUDIO_SECOND = (7 * 24000) / 2048;

/** Cumulative buckets [[upper bound, count], ...] of one histogram, summed over its label sets. */
export function histogramBuckets(text, name) {
  const prefix = `${name}_bucket{`;
  const counts = new Map();
  for (const line of text.split("\n")) {
    if (!line.startsWith(prefix)) continue;
    const close = line.lastIndexOf("}");
    const le = /(?:^|,)le="([^"]*)"/.exec(line.slice(prefix.length, close))?.[1];
    const value = Number(line.slice(close + 1).trim().split(/\s+/)[0]);
    if (le === undefined || !Number.isFinite(value)) continue;
    const bound = le === "+Inf" ? Infinity : Number(le);
    counts.set(bound, (counts.get(bound) ?? 0) + value);
  }
  return [...counts.entries()].sort((a, b) => a[0] - b[0]);
}

/** The q-quantile of cumulative buckets, linear within a bucket; null when there is no observation. */
export function histogramQuantile(q, buckets) {
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (!(total > 0)) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const [bound, count] of buckets) {
    if (count >= rank) {
      // Past the last finite bound all that is known is "more than" it.
      if (bound === Infinity) return lower;
      return lower + (bound - lower) * ((rank - below) / Math.max(count - below, Number.EPSILON));
    }
    lower = bound;
    below = count;
  }
  return lower;
}

function bucketsMinus(now, before) {
  const earlier = new Map(before);
  return now.map(([bound, count]) => [bound, count - (earlier.get(bound) ?? 0)]);
}

function formatRate(value, digits = 1) {
  return value === null ? "—" : value.toFixed(digits);
}

function formatMs(seconds) {
  if (seconds === null) return "—";
  return seconds < 1 ? `${(seconds * 1000).toFixed(0)} ms` : `${seconds.toFixed(2)} s`;
}

export class ServerPanel extends EventTarget {
  constructor(elements) {
    super();
    this.el = elements;
    this.previous = null; // last /v1/stats snapshot
    this.ttfbHistory = []; // [{uptime, buckets}]
    this.active = [];
    this.timer = null;
    this.last = null; // what the panel shows, as numbers
  }

  start() {
    const tick = async () => {
      if (!document.hidden) await this.poll();
      this.timer = setTimeout(tick, POLL_MS);
    };
    tick();
  }

  async poll() {
    const [stats, metrics, ready] = await Promise.allSettled([
      getJSON("v1/stats"), getMetricsText(), fetch(new URL("ready", document.baseURI)).then((r) => r.json()),
    ]);
    this.showReadiness(ready.status === "fulfilled" ? ready.value.status : null);
    if (stats.status === "rejected") {
      this.el.state.textContent = stats.reason.unauthorized
        ? "The server needs an API key for its statistics."
        : `Statistics unavailable: ${stats.reason.message}`;
      return;
    }
    this.show(stats.value, metrics.status === "fulfilled" ? metrics.value : "");
  }

  showReadiness(status) {
    const pill = this.el.readiness;
    const label = { ready: "ready", warming_up: "warming up", shutting_down: "shutting down", saturated: "saturated" };
    pill.textContent = status === null ? "unreachable" : `server ${label[status] ?? status}`;
    pill.dataset.state = status ?? "unreachable";
  }

  show(stats, metricsText) {
    const sched = stats.scheduler;
    const kv = stats.kv_cache;
    const uptime = stats.throughput?.uptime_s ?? null;
    let tokensPerS = null;
    if (this.previous !== null && uptime !== null) {
      const dt = uptime - this.previous.throughput.uptime_s;
      if (dt > 0) tokensPerS = Math.max(0, stats.total_tokens - this.previous.total_tokens) / dt;
    }
    this.previous = stats;
    const ttfb = this.ttfb(metricsText, uptime);
    const slots = kv.used_slots + kv.free_slots;
    const requests = stats.requests ?? {};
    this.last = {
      active: sched.active_sessions, queued: sched.pending_sessions, usedSlots: kv.used_slots, slots,
      tokensPerS, audioSecondsPerS: tokensPerS === null ? null : tokensPerS / TOKENS_PER_AUDIO_SECOND,
      ttfbP50: ttfb.p50, ttfbP95: ttfb.p95, ttfbScope: ttfb.scope, ttfbCount: ttfb.count,
      completed: requests.requests_completed ?? 0, cancelled: requests.requests_cancelled ?? 0,
      failed: requests.requests_failed ?? 0, openConnections: stats.gateway?.open_connections ?? null,
    };
    const el = this.el;
    el.active.textContent = String(sched.active_sessions);
    el.queued.textContent = String(sched.pending_sessions);
    el.kv.textContent = `${kv.used_slots} / ${slots}`;
    el.kvMeter.value = slots ? kv.used_slots / slots : 0;
    el.tokens.textContent = formatRate(tokensPerS, 0);
    el.audio.textContent = formatRate(this.last.audioSecondsPerS, 2);
    el.ttfb50.textContent = formatMs(ttfb.p50);
    el.ttfb95.textContent = formatMs(ttfb.p95);
    el.ttfbScope.textContent = ttfb.count
      ? `${ttfb.count} request${ttfb.count === 1 ? "" : "s"}, ${ttfb.scope}` : "no requests yet";
    el.completed.textContent = String(this.last.completed);
    el.cancelled.textContent = String(this.last.cancelled);
    el.connections.textContent = this.last.openConnections === null ? "—" : String(this.last.openConnections);
    el.state.textContent = `${stats.engine?.backend ?? "?"} on ${stats.engine?.device ?? "?"}`
      + ` · ${sched.policy ?? ""} scheduling · up ${Math.round(uptime ?? 0)} s`;
    this.pushSpark(sched.active_sessions, sched.max_concurrent);
    this.dispatchEvent(new CustomEvent("update", { detail: this.last }));
  }

  ttfb(metricsText, uptime) {
    const buckets = histogramBuckets(metricsText, TTFB_HISTOGRAM);
    if (!buckets.length || uptime === null) return { p50: null, p95: null, scope: "", count: 0 };
    this.ttfbHistory.push({ uptime, buckets });
    while (this.ttfbHistory.length > 1 && uptime - this.ttfbHistory[1].uptime >= TTFB_WINDOW_S) {
      this.ttfbHistory.shift();
    }
    const oldest = this.ttfbHistory[0];
    let window = bucketsMinus(buckets, oldest.buckets);
    let scope = `last ${Math.max(1, Math.round(uptime - oldest.uptime))} s`;
    if (!(window[window.length - 1][1] > 0)) {
      window = buckets;
      scope = "since start";
    }
    return { p50: histogramQuantile(0.5, window), p95: histogramQuantile(0.95, window), scope,
      count: window[window.length - 1][1] };
  }

  pushSpark(active, maxConcurrent) {
    this.active.push(active);
    if (this.active.length > SPARK_POINTS) this.active.shift();
    const svg = this.el.spark;
    const width = 240;
    const height = 48;
    const peak = Math.max(...this.active);
    const top = Math.max(1, peak);
    const step = width / (SPARK_POINTS - 1);
    const offset = SPARK_POINTS - this.active.length;
    const points = this.active.map((value, i) => {
      const x = (offset + i) * step;
      const y = height - 3 - (value / top) * (height - 6);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    const line = svg.querySelector("polyline");
    line.setAttribute("points", points.join(" "));
    const area = svg.querySelector("polygon");
    const first = (offset * step).toFixed(1);
    area.setAttribute("points", `${first},${height} ${points.join(" ")} ${width},${height}`);
    this.el.sparkCaption.textContent = `Active sessions, last ${this.active.length} s (peak ${peak}`
      + `${maxConcurrent ? ` of ${maxConcurrent} slots` : ""})`;
  }
}
