// Gap-free playback of the server's PCM stream with the Web Audio API.
//
// WorkletPlayer feeds an AudioWorklet ring buffer (pcm-worklet.js). Browsers only offer
// AudioWorklet in a secure context (https, or http on localhost), and a server on another machine
// is often reached over plain http, so ScheduledPlayer plays the same stream as back-to-back
// AudioBufferSourceNodes there. Both report the same figures: samples received, played and
// buffered, and underruns (the buffer ran dry while the server was still sending).

export const SERVER_SAMPLE_RATE = 24000;
// Playback starts (and resumes after an underrun) once this much audio is buffered, or the stream
// has ended. The server's first chunk is shorter than one frame and the next comes one to two frames
// of generation later: starting on the first chunk alone runs dry before the second arrives whenever
// generation is not far ahead of real time.
const PREBUFFER_SECONDS = 0.15;

function emptyStats(kind, sampleRate) {
  return { kind, sampleRate, state: "idle", received: 0, played: 0, buffered: 0, underruns: 0, silentSamples: 0 };
}

/** 16-bit little-endian PCM bytes -> float samples; an odd trailing byte is kept for the next chunk. */
class PcmDecoder {
  constructor() {
    this.carry = null;
  }

  decode(bytes) {
    let data = new Uint8Array(bytes);
    if (this.carry !== null) {
      const joined = new Uint8Array(data.length + 1);
      joined[0] = this.carry;
      joined.set(data, 1);
      data = joined;
      this.carry = null;
    }
    if (data.length % 2) {
      this.carry = data[data.length - 1];
      data = data.subarray(0, data.length - 1);
    }
    const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
    const samples = new Float32Array(data.length / 2);
    for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
    return samples;
  }
}

class BasePlayer extends EventTarget {
  constructor(context, kind) {
    super();
    this.context = context;
    this.kind = kind;
    this.stats = emptyStats(kind, context.sampleRate);
    this.analyser = context.createAnalyser();
    this.analyser.fftSize = 1024;
    this.analyser.connect(context.destination);
    this.levelData = new Float32Array(this.analyser.fftSize);
    this.decoder = new PcmDecoder();
  }

  get sampleRate() {
    return this.context.sampleRate;
  }

  /** RMS of what is playing now, 0..1 (the level meter). */
  level() {
    this.analyser.getFloatTimeDomainData(this.levelData);
    let sum = 0;
    for (const v of this.levelData) sum += v * v;
    return Math.sqrt(sum / this.levelData.length);
  }

  async begin() {
    // A context created before any user gesture starts suspended; Speak is that gesture.
    if (this.context.state !== "running") await this.context.resume();
    this.decoder = new PcmDecoder();
    this.stats = emptyStats(this.kind, this.sampleRate);
    this.start();
    this.emitStats();
  }

  /** Queue a chunk of 16-bit PCM at the context's rate; returns its float samples (for the waveform). */
  push(bytes) {
    const samples = this.decoder.decode(bytes);
    if (samples.length) this.enqueue(samples.slice());
    return samples;
  }

  emitStats() {
    this.dispatchEvent(new CustomEvent("stats", { detail: { ...this.stats } }));
  }

  emitDrained() {
    this.dispatchEvent(new Event("drained"));
  }
}

class WorkletPlayer extends BasePlayer {
  constructor(context) {
    super(context, "worklet");
    this.node = new AudioWorkletNode(context, "pcm-player", {
      numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1],
      processorOptions: { prebufferSeconds: PREBUFFER_SECONDS },
    });
    this.node.connect(this.analyser);
    this.node.port.onmessage = (event) => {
      const message = event.data;
      if (message.type === "stats") {
        const { type: _type, ...figures } = message;
        this.stats = { ...this.stats, ...figures };
        this.emitStats();
      } else if (message.type === "drained") {
        this.emitDrained();
      }
    };
  }

  start() {
    this.node.port.postMessage({ type: "begin" });
  }

  enqueue(samples) {
    // Transferred, not copied: the worklet owns the chunk from here.
    this.node.port.postMessage({ type: "push", samples }, [samples.buffer]);
  }

  end() {
    this.node.port.postMessage({ type: "end" });
  }

  extend() {
    this.node.port.postMessage({ type: "extend" });
  }

  flush() {
    this.node.port.postMessage({ type: "flush" });
  }
}

// How far ahead of the clock a run of buffers starts: enough for the main thread to hand the first
// buffer to the audio thread in time.
const SCHEDULE_LEAD_S = 0.05;

class ScheduledPlayer extends BasePlayer {
  constructor(context) {
    super(context, "scheduled");
    this.sources = new Set();
    this.pending = []; // samples held until PREBUFFER_SECONDS are there (see pcm-worklet.js)
    this.pendingSamples = 0;
    this.nextTime = 0; // 0: nothing scheduled; the next run starts after a prebuffer
    this.ended = true;
    this.timer = null;
  }

  start() {
    this.stopSources();
    this.nextTime = 0;
    this.ended = false;
    this.stats.state = "buffering";
    this.tick();
    this.timer ??= setInterval(() => this.tick(), 50);
  }

  enqueue(samples) {
    this.stats.received += samples.length;
    const now = this.context.currentTime;
    if (this.nextTime !== 0 && this.nextTime < now) {
      // Everything scheduled has played and this chunk came late: the listener heard silence.
      this.stats.underruns += 1;
      this.stats.silentSamples += Math.round((now - this.nextTime) * this.sampleRate);
      this.stats.state = "stalled";
      this.nextTime = 0;
    }
    this.pending.push(samples);
    this.pendingSamples += samples.length;
    this.schedulePending();
  }

  schedulePending() {
    if (this.nextTime === 0) {
      if (this.pendingSamples < PREBUFFER_SECONDS * this.sampleRate && !this.ended) return;
      this.nextTime = this.context.currentTime + SCHEDULE_LEAD_S;
    }
    for (const samples of this.pending) this.schedule(samples);
    this.pending = [];
    this.pendingSamples = 0;
    this.stats.state = "playing";
  }

  schedule(samples) {
    const buffer = this.context.createBuffer(1, samples.length, this.sampleRate);
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.analyser);
    source.start(this.nextTime);
    this.nextTime += buffer.duration;
    this.sources.add(source);
    source.onended = () => {
      if (!this.sources.delete(source)) return; // flushed
      this.stats.played += samples.length;
      if (this.ended && this.sources.size === 0 && this.pendingSamples === 0) this.finish({ drained: true });
    };
  }

  tick() {
    const ahead = this.sources.size ? Math.max(0, this.nextTime - this.context.currentTime) : 0;
    this.stats.buffered = Math.round(ahead * this.sampleRate) + this.pendingSamples;
    this.emitStats();
  }

  finish({ drained }) {
    this.stats.state = "idle";
    clearInterval(this.timer);
    this.timer = null;
    this.tick();
    if (drained) this.emitDrained();
  }

  end() {
    this.ended = true;
    if (this.pendingSamples) this.schedulePending();
    if (this.sources.size === 0) this.finish({ drained: true });
  }

  extend() {
    this.ended = false;
    // Drained already: the wait for more text was not an underrun; start the next run afresh.
    if (this.sources.size === 0) this.nextTime = 0;
    this.timer ??= setInterval(() => this.tick(), 50);
  }

  stopSources() {
    const sources = [...this.sources];
    this.sources.clear();
    this.pending = [];
    this.pendingSamples = 0;
    for (const source of sources) source.stop();
  }

  flush() {
    this.stopSources();
    this.ended = true;
    this.finish({ drained: false });
  }
}

function createContext() {
  // At the server's rate the browser resamples for the device; a browser that cannot open a 24 kHz
  // context gets its own rate, and the server is asked for audio at that rate instead.
  try {
    return new AudioContext({ sampleRate: SERVER_SAMPLE_RATE, latencyHint: "interactive" });
  } catch {
    return new AudioContext({ latencyHint: "interactive" });
  }
}

/** The best player this page can have: the AudioWorklet one unless the browser withholds AudioWorklet. */
export async function createPlayer({ preferWorklet = true } = {}) {
  const context = createContext();
  if (preferWorklet && context.audioWorklet) {
    await context.audioWorklet.addModule(new URL("./pcm-worklet.js", import.meta.url));
    return new WorkletPlayer(context);
  }
  return new ScheduledPlayer(context);
}
