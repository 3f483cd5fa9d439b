// The live waveform: the stream's envelope drawn as chunks arrive, the played part in the accent
// colour with a playhead, and a level meter of what is sounding now.
//
// The canvas is redrawn on animation frames only while audio is arriving or playing, so an idle
// page costs nothing.

const MIN_SECONDS_SHOWN = 6;

function cssColor(element, name, fallback) {
  return getComputedStyle(element).getPropertyValue(name).trim() || fallback;
}

export class Waveform {
  constructor(canvas, meter, caption) {
    this.canvas = canvas;
    this.meter = meter;
    this.caption = caption;
    this.utterance = null;
    this.playedSamples = 0;
    this.bufferedSamples = 0;
    this.levelSource = null;
    this.frame = null;
    this.active = false;
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  show(utterance) {
    this.utterance = utterance;
    this.playedSamples = 0;
    this.bufferedSamples = 0;
    this.wake();
  }

  update({ played, buffered }) {
    this.playedSamples = played;
    this.bufferedSamples = buffered;
    this.wake();
  }

  setLevelSource(source) {
    this.levelSource = source;
  }

  /** Keep redrawing while `active`; one more frame after it turns false settles the picture. */
  setActive(active) {
    this.active = active;
    this.wake();
  }

  wake() {
    this.frame ??= requestAnimationFrame(() => {
      this.frame = null;
      this.draw();
      if (this.active) this.wake();
    });
  }

  draw() {
    const { canvas } = this;
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * ratio));
    const height = Math.max(1, Math.round(canvas.clientHeight * ratio));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, width, height);
    const mid = height / 2;
    ctx.fillStyle = cssColor(canvas, "--wave-axis", "#ccc");
    ctx.fillRect(0, Math.floor(mid), width, Math.max(1, Math.round(ratio)));

    const utterance = this.utterance;
    const envelope = utterance?.envelope ?? [];
    const perSecond = utterance ? utterance.sampleRate / utterance.block : 100;
    const seconds = Math.max(MIN_SECONDS_SHOWN, (envelope.length / perSecond) * 1.1);
    const pointsPerPixel = (seconds * perSecond) / width;
    const playedPoints = utterance ? this.playedSamples / utterance.block : 0;
    const received = cssColor(canvas, "--wave-received", "#9aa");
    const played = cssColor(canvas, "--wave-played", "#36c");
    for (let x = 0; x < width; x++) {
      const from = Math.floor(x * pointsPerPixel);
      const to = Math.max(from + 1, Math.floor((x + 1) * pointsPerPixel));
      if (from >= envelope.length) break;
      let peak = 0;
      for (let i = from; i < Math.min(to, envelope.length); i++) peak = Math.max(peak, envelope[i]);
      const half = Math.max(ratio, peak * (mid - 2 * ratio));
      ctx.fillStyle = from < playedPoints ? played : received;
      ctx.fillRect(x, mid - half, 1, 2 * half);
    }
    if (utterance && this.playedSamples > 0) {
      ctx.fillStyle = cssColor(canvas, "--wave-playhead", "#c33");
      ctx.fillRect(Math.min(width - 2 * ratio, playedPoints / pointsPerPixel), 0, 2 * ratio, height);
    }

    const level = this.levelSource ? this.levelSource() : 0;
    // RMS in dBFS, shown from -60 dB (silence) to 0 dB (full scale).
    const db = level > 0 ? 20 * Math.log10(level) : -Infinity;
    this.meter.value = Math.max(0, Math.min(1, (db + 60) / 60));
    this.meter.textContent = Number.isFinite(db) ? `${db.toFixed(0)} dBFS` : "silent";
    if (utterance) {
      const rate = utterance.sampleRate;
      this.caption.textContent = `received ${utterance.seconds.toFixed(2)} s · played `
        + `${(this.playedSamples / rate).toFixed(2)} s · buffered ${(this.bufferedSamples / rate).toFixed(2)} s`;
    }
  }
}
