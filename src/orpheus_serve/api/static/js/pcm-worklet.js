// AudioWorklet processor: a ring buffer of float samples, played gap-free on the audio thread.
//
// The main thread pushes decoded chunks as they arrive from the server; process() drains them 128
// samples at a time. Counting happens here, on the audio thread, so the figures are what really
// reached the audio graph: samples played, and underruns (the buffer ran dry while the stream was
// still going, so silence was played instead of speech).
//
// Messages in:  {type: "begin"}  a stream starts (counters reset)
//               {type: "push", samples: Float32Array}
//               {type: "end"}    nothing more will come: an empty buffer now means done, not underrun
//               {type: "extend"} more will come after all (the next sentence of the same stream)
//               {type: "flush"}  drop everything buffered at once (Stop)
// Messages out: {type: "stats", ...counters}  every ~40 ms while active, and on every state change
//               {type: "drained"}             the stream ended and its last sample was played

const INITIAL_CAPACITY = 1 << 18; // ~11 s at 24 kHz; grows when the server runs far ahead of playback
const REPORT_EVERY_QUANTA = 8; // 8 x 128 samples: ~43 ms at 24 kHz

class PcmPlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.buffer = new Float32Array(INITIAL_CAPACITY);
    this.readAt = 0;
    this.size = 0;
    this.state = "idle"; // idle | buffering (before the first sample) | playing | stalled (after an underrun)
    // Playback starts, and resumes after an underrun, once this many samples are buffered (or the
    // stream has ended); player.js explains the figure. sampleRate is a global of the worklet scope.
    this.prebuffer = Math.round(options.processorOptions.prebufferSeconds * sampleRate);
    this.ended = true;
    this.quanta = 0;
    this.resetCounters();
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  resetCounters() {
    this.received = 0;
    this.played = 0;
    this.underruns = 0;
    this.silentSamples = 0; // samples of silence played while stalled
  }

  onMessage(message) {
    switch (message.type) {
      case "begin":
        this.readAt = 0;
        this.size = 0;
        this.ended = false;
        this.state = "idle";
        this.resetCounters();
        break;
      case "push":
        this.write(message.samples);
        if (this.state === "idle") this.state = "buffering";
        break;
      case "end":
        this.ended = true;
        break;
      case "extend":
        this.ended = false;
        break;
      case "flush":
        this.size = 0;
        this.ended = true;
        this.state = "idle";
        break;
      default:
        return;
    }
    this.report();
  }

  write(samples) {
    if (this.size + samples.length > this.buffer.length) this.grow(this.size + samples.length);
    const capacity = this.buffer.length;
    const writeAt = (this.readAt + this.size) % capacity;
    const first = Math.min(samples.length, capacity - writeAt);
    this.buffer.set(samples.subarray(0, first), writeAt);
    if (first < samples.length) this.buffer.set(samples.subarray(first), 0);
    this.size += samples.length;
    this.received += samples.length;
  }

  grow(needed) {
    let capacity = this.buffer.length * 2;
    while (capacity < needed) capacity *= 2;
    const next = new Float32Array(capacity);
    const first = Math.min(this.size, this.buffer.length - this.readAt);
    next.set(this.buffer.subarray(this.readAt, this.readAt + first), 0);
    next.set(this.buffer.subarray(0, this.size - first), first);
    this.buffer = next;
    this.readAt = 0;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    if ((this.state === "buffering" || this.state === "stalled")
        && (this.size >= this.prebuffer || (this.ended && this.size > 0))) {
      this.state = "playing";
      this.report();
    }
    let copied = 0;
    if (this.state === "playing") {
      const capacity = this.buffer.length;
      copied = Math.min(out.length, this.size);
      const first = Math.min(copied, capacity - this.readAt);
      out.set(this.buffer.subarray(this.readAt, this.readAt + first), 0);
      if (first < copied) out.set(this.buffer.subarray(0, copied - first), first);
      this.readAt = (this.readAt + copied) % capacity;
      this.size -= copied;
      this.played += copied;
      if (copied < out.length) {
        if (this.ended) {
          this.state = "idle";
          this.report();
          this.port.postMessage({ type: "drained" });
        } else {
          this.state = "stalled";
          this.underruns += 1;
          this.silentSamples += out.length - copied;
          this.report();
        }
      }
    } else if (this.state === "stalled") {
      this.silentSamples += out.length;
    }
    out.fill(0, copied);
    if (this.state !== "idle" && ++this.quanta % REPORT_EVERY_QUANTA === 0) this.report();
    return true; // keep the node alive between utterances
  }

  report() {
    this.port.postMessage({
      type: "stats",
      state: this.state,
      received: this.received,
      played: this.played,
      buffered: this.size,
      underruns: this.underruns,
      silentSamples: this.silentSamples,
    });
  }
}

registerProcessor("pcm-player", PcmPlayerProcessor);
