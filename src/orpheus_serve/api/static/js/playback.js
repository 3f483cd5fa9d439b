// One stream of speech: requests on the WebSocket, one at a time, their audio played back to back.
//
// Speak sends one request. The live demo opens one context (text streamed in, see the README's
// "Text streamed in") and sends each sentence into it as it is typed, with a flush: the server
// speaks it at once and answers {"flushed": true, "flush_id"} when its audio is all out. Requests
// queue here (not on the server) so that Stop can drop the queue, cancel the running request or
// context, and get the server's acknowledgement for it alone.
//
// Events: "job" (detail: Job; any change of state), "audio" (detail: {job, samples}),
// "flushed" (detail: {job, flushId}), "chunk" (detail: {job, chunk}: the server's text chunk and its
// place in the audio), "player" (detail: the player's figures), "stream-start" / "stream-end"
// (detail: Utterance), "notice" (detail: ApiError not tied to a request).

import { ApiError } from "./api.js";
import { createPlayer } from "./player.js";
import { SpeechSocket } from "./speech-socket.js";

let jobCounter = 0;
const CANCEL_ACK_TIMEOUT_MS = 5000;

/** One request on the socket and what became of it. Times are performance.now() milliseconds. */
export class Job {
  constructor(text, params, origin) {
    jobCounter += 1;
    this.id = `pg-${Date.now().toString(36)}-${jobCounter}`;
    this.text = text;
    this.params = params;
    this.origin = origin; // "speak" | "live"
    this.state = "queued"; // queued | sent | streaming | stopping | done | cancelled | failed
    // A context (Playback.openContext): its id on the socket, text typed before it could be opened,
    // flushes sent and acknowledged, whether text went in after the last flush, the server's chunks.
    this.contextId = null;
    this.pending = "";
    this.pendingFlush = false;
    this.flushes = 0;
    this.flushed = 0;
    this.textSinceFlush = false;
    this.chunks = [];
    this.sentAt = null;
    this.firstAudioAt = null;
    this.endedAt = null;
    this.bytes = 0;
    this.metrics = null; // the server's final metrics
    this.error = null;
    this.ack = null; // the server's {"cancelled": ...} answer to Stop
  }

  get ttfbMs() {
    return this.firstAudioAt === null ? null : this.firstAudioAt - this.sentAt;
  }

  get totalMs() {
    return this.endedAt === null || this.sentAt === null ? null : this.endedAt - this.sentAt;
  }

  get finished() {
    return ["done", "cancelled", "failed"].includes(this.state);
  }

  summary() {
    return { id: this.id, origin: this.origin, state: this.state, text: this.text, ttfbMs: this.ttfbMs,
      totalMs: this.totalMs, bytes: this.bytes, metrics: this.metrics, error: this.error?.message ?? null,
      ack: this.ack, contextId: this.contextId, flushes: this.flushes, flushed: this.flushed,
      chunks: this.chunks.map((chunk) => chunk.text) };
  }
}

const ENVELOPE_POINTS_PER_SECOND = 100;

/** What one stream played: its 16-bit PCM (for the WAV download) and a peak envelope (the waveform). */
export class Utterance {
  constructor(sampleRate) {
    this.sampleRate = sampleRate;
    this.chunks = [];
    this.bytes = 0;
    this.envelope = [];
    this.block = Math.round(sampleRate / ENVELOPE_POINTS_PER_SECOND);
    this.blockPeak = 0;
    this.blockFill = 0;
    this.jobs = [];
    this.soundAt = null; // when the player started to play it (after its prebuffer)
  }

  /** Milliseconds from sending the first request to the first sample played. */
  get firstSoundMs() {
    const sentAt = this.jobs[0]?.sentAt ?? null;
    return this.soundAt === null || sentAt === null ? null : this.soundAt - sentAt;
  }

  get seconds() {
    return Math.floor(this.bytes / 2) / this.sampleRate;
  }

  add(bytes, samples) {
    this.chunks.push(new Uint8Array(bytes));
    this.bytes += bytes.byteLength;
    for (const sample of samples) {
      this.blockPeak = Math.max(this.blockPeak, Math.abs(sample));
      if (++this.blockFill === this.block) {
        this.envelope.push(this.blockPeak);
        this.blockPeak = 0;
        this.blockFill = 0;
      }
    }
  }
}

export class Playback extends EventTarget {
  constructor({ preferWorklet = true } = {}) {
    super();
    this.preferWorklet = preferWorklet;
    this.socket = new SpeechSocket();
    this.player = null;
    this.playerReady = null;
    this.queue = [];
    this.current = null;
    this.streaming = false; // a player stream is open (begun, not yet drained or flushed)
    this.ending = false; // ...and told that nothing more is coming
    this.playerDrained = false; // ...and it has played its last sample since
    this.utterance = null;
    this.lastUtterance = null;
    this.ackWaiter = null;
    this.cancelling = null;
    this.jobs = [];
    this.socket.addEventListener("audio", (event) => this.onAudio(event.detail));
    this.socket.addEventListener("done", (event) => this.onDone(event.detail));
    this.socket.addEventListener("cancelled", (event) => this.onCancelled(event.detail));
    this.socket.addEventListener("flushed", (event) => this.onFlushed(event.detail));
    this.socket.addEventListener("timestamps", (event) => this.onTimestamps(event.detail));
    this.socket.addEventListener("error", (event) => this.onError(event.detail));
    this.socket.addEventListener("close", (event) => this.onClose(event.detail));
  }

  get busy() {
    return this.current !== null || this.queue.length > 0 || this.streaming;
  }

  /** The player, created on first use: call it from a click so the browser lets audio start. */
  ensurePlayer() {
    this.playerReady ??= createPlayer({ preferWorklet: this.preferWorklet }).then((player) => {
      player.addEventListener("stats", (event) => {
        const utterance = this.utterance;
        if (this.streaming && utterance.soundAt === null && event.detail.state === "playing") {
          utterance.soundAt = performance.now();
        }
        this.emit("player", event.detail);
      });
      player.addEventListener("drained", () => this.onDrained());
      this.player = player;
      return player;
    }).catch((error) => {
      this.playerReady = null; // let the next click try again
      throw error;
    });
    return this.playerReady;
  }

  enqueue(text, params, origin) {
    const job = new Job(text, params, origin);
    this.jobs.push(job);
    if (this.jobs.length > 50) this.jobs.shift();
    this.queue.push(job);
    this.emit("job", job);
    this.pump();
    return job;
  }

  /** A context: a request whose text arrives later, piece by piece (`contextText`). Queued like a request. */
  openContext(params, origin) {
    const job = new Job("", params, origin);
    job.contextId = job.id;
    this.jobs.push(job);
    if (this.jobs.length > 50) this.jobs.shift();
    this.queue.push(job);
    this.emit("job", job);
    this.pump();
    return job;
  }

  /**
   * More text for context `job`, spoken as soon as the server can cut it; with `flush`, whatever has
   * arrived is spoken now. Text for a context not yet open waits here. False once it has ended.
   */
  contextText(job, text, { flush = false } = {}) {
    if (job.finished || job.state === "stopping") return false;
    job.text += text;
    if (job.state === "queued") {
      job.pending += text;
      job.pendingFlush ||= flush;
      return true;
    }
    try {
      this.sendContext(job, { text, flush });
    } catch (error) {
      this.finish(job, "failed", { error });
      return false;
    }
    return true;
  }

  sendContext(job, { text = "", flush = false, open = null }) {
    const message = { ...(open ?? {}), context_id: job.contextId };
    if (text) message.text = text;
    if (flush) message.flush = true;
    if (text) {
      job.textSinceFlush = true;
      // The player was told the stream had ended (everything flushed was out): more is coming after all.
      if (this.streaming && this.ending) {
        this.player.extend();
        this.ending = false;
        this.playerDrained = false;
      }
    }
    if (flush) {
      job.flushes += 1;
      job.textSinceFlush = false;
    }
    this.socket.send(message);
  }

  async pump() {
    if (this.current !== null || this.queue.length === 0) return;
    const job = this.queue.shift();
    this.current = job;
    try {
      const player = await this.ensurePlayer();
      await this.socket.connect();
      if (this.current !== job) return; // stopped while connecting
      if (!this.streaming) {
        await player.begin();
        if (this.current !== job) return; // stopped while the audio output started
        this.streaming = true;
        this.utterance = new Utterance(player.sampleRate);
        this.emit("stream-start", this.utterance);
      } else if (this.ending) {
        player.extend();
        this.playerDrained = false;
      }
      this.ending = false;
      this.utterance.jobs.push(job);
      job.sentAt = performance.now();
      job.state = "sent";
      const options = { ...job.params, response_format: "pcm", sample_rate: player.sampleRate, request_id: job.id };
      if (job.contextId !== null) {
        this.sendContext(job, { text: job.pending, flush: job.pendingFlush, open: { ...options, timestamps: true } });
        job.pending = "";
        job.pendingFlush = false;
      } else {
        this.socket.send({ ...options, text: job.text });
      }
      this.emit("job", job);
    } catch (error) {
      if (this.current === job) this.finish(job, "failed", { error });
    }
  }

  finish(job, state, { error = null, metrics = null } = {}) {
    job.state = state;
    job.endedAt = performance.now();
    job.error = error;
    job.metrics = metrics ?? job.metrics;
    if (this.current === job) this.current = null;
    this.emit("job", job);
    if (this.queue.length) this.pump();
    else this.endStream();
  }

  endStream() {
    if (!this.streaming) return;
    if (!this.ending) {
      this.ending = true;
      this.playerDrained = false;
      this.player.end();
    } else if (this.playerDrained && this.current === null && this.queue.length === 0) {
      // A context whose audio had all played out before it finished: nothing more will drain.
      this.closeStream();
    }
  }

  onAudio(bytes) {
    const job = this.current;
    // Audio of a request being stopped is still in flight until the server's acknowledgement: drop it.
    if (job === null || !this.streaming || !["sent", "streaming"].includes(job.state)) return;
    if (job.firstAudioAt === null) {
      job.firstAudioAt = performance.now();
      job.state = "streaming";
      this.emit("job", job);
    }
    job.bytes += bytes.byteLength;
    const samples = this.player.push(bytes);
    this.utterance.add(bytes, samples);
    this.emit("audio", { job, samples });
  }

  onDone(message) {
    const job = this.current;
    if (job === null || message.request_id !== job.id) return;
    this.finish(job, "done", { metrics: message.metrics });
  }

  onFlushed(message) {
    const job = this.current;
    if (job === null || job.contextId === null || message.context_id !== job.contextId) return;
    job.flushed = message.flush_id;
    this.emit("flushed", { job, flushId: message.flush_id });
    // Everything sent so far is out: the player may run dry now without that being an underrun.
    if (job.flushed === job.flushes && !job.textSinceFlush) this.endStream();
  }

  onTimestamps(message) {
    const job = this.current;
    if (job === null || job.contextId === null || message.context_id !== job.contextId) return;
    job.chunks.push(message.timestamps.chunk);
    this.emit("chunk", { job, chunk: message.timestamps.chunk });
  }

  onCancelled(message) {
    if (this.ackWaiter !== null) this.ackWaiter(message);
    const job = this.current;
    if (job !== null && message.cancelled && message.request_id === job.id) {
      job.ack = message;
      this.finish(job, "cancelled");
    }
  }

  onError(error) {
    const job = this.current;
    if (job !== null && (error.requestId === job.id || error.requestId === null)) {
      this.finish(job, "failed", { error });
    } else {
      this.emit("notice", error);
    }
  }

  onClose({ code, reason }) {
    const job = this.current;
    if (job === null) return;
    this.dropQueue();
    const detail = reason ? `: ${reason}` : "";
    this.finish(job, "failed", { error: new ApiError(`the server closed the connection (code ${code}${detail})`) });
  }

  onDrained() {
    this.playerDrained = true;
    // A request may have been sent, or a context be waiting for its next sentence, while the end of
    // the previous audio was still draining.
    if (this.current !== null || this.queue.length) return;
    this.closeStream();
  }

  closeStream() {
    if (!this.streaming) return;
    this.streaming = false;
    this.ending = false;
    this.lastUtterance = this.utterance;
    this.emit("stream-end", this.utterance);
  }

  dropQueue() {
    for (const job of this.queue.splice(0)) {
      job.state = "cancelled";
      this.emit("job", job);
    }
  }

  /**
   * Stop: silence at once, drop queued sentences, cancel the running request on the server.
   * Resolves to the server's acknowledgement ({"cancelled": true, "request_id"}), or null when
   * nothing was running on the server.
   */
  async stop() {
    this.dropQueue();
    if (this.streaming) {
      this.player.flush();
      this.closeStream();
    }
    const job = this.current;
    if (job === null) return null;
    if (job.state === "queued") {
      // Not sent yet (still connecting): nothing to cancel on the server.
      this.finish(job, "cancelled");
      return null;
    }
    if (job.state === "stopping") return this.cancelling; // Stop pressed again: the same answer
    job.state = "stopping";
    this.emit("job", job);
    this.cancelling = this.cancelOnServer(job);
    return this.cancelling;
  }

  async cancelOnServer(job) {
    const askedAt = performance.now();
    const ack = await new Promise((resolve) => {
      const timer = setTimeout(() => resolve(null), CANCEL_ACK_TIMEOUT_MS);
      this.ackWaiter = (message) => {
        clearTimeout(timer);
        resolve(message);
      };
      try {
        this.socket.send(job.contextId === null ? { cancel: true } : { context_id: job.contextId, cancel: true });
      } catch {
        clearTimeout(timer);
        resolve(null);
      }
    });
    this.ackWaiter = null;
    if (ack !== null) ack.roundTripMs = performance.now() - askedAt;
    if (this.current === job) {
      // Finished before the cancel reached it ({"cancelled": false}), or no answer in time.
      job.ack = ack;
      this.finish(job, "cancelled");
    }
    return ack;
  }

  emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** Figures for the page's own display and for anyone inspecting the page (the browser tests do). */
  snapshot() {
    const utterance = this.utterance ?? this.lastUtterance;
    return {
      player: this.player ? { ...this.player.stats } : null,
      streaming: this.streaming,
      socketBytes: this.socket.bytesReceived,
      utterance: utterance === null ? null : { seconds: utterance.seconds, bytes: utterance.bytes,
        sampleRate: utterance.sampleRate, firstSoundMs: utterance.firstSoundMs,
        jobs: utterance.jobs.map((job) => job.id) },
      jobs: this.jobs.map((job) => job.summary()),
    };
  }
}
