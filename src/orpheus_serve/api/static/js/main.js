// The playground page: wires the form, the player, the live demo and the server panel together.

import { apiKey, getJSON, setApiKey, speechBlob } from "./api.js";
import { Playback } from "./playback.js";
import { SentenceCutter } from "./sentences.js";
import { ServerPanel } from "./server-panel.js";
import { saveBlob, wavBlob } from "./wav.js";
import { Waveform } from "./waveform.js";

// Tags the released Orpheus model honours.
const TAGS = ["laugh", "chuckle", "sigh", "cough", "sniffle", "groan", "yawn", "gasp"];
const LIVE_IDLE_MS = 1200;

const $ = (id) => document.getElementById(id);
const ui = {
  text: $("text"), tags: $("tags"), voice: $("voice"), speed: $("speed"), speedOut: $("speed-out"),
  temperature: $("temperature"), topP: $("top-p"), seed: $("seed"), speak: $("speak"), stop: $("stop"),
  playerKind: $("player-kind"), status: $("play-status"), ack: $("cancel-ack"),
  ttfb: $("m-ttfb"), sound: $("m-sound"), buffered: $("m-buffered"), serverTtfb: $("m-server-ttfb"), rtf: $("m-rtf"), total: $("m-total"), audio: $("m-audio"),
  underruns: $("m-underruns"), dlWav: $("dl-wav"), dlFormat: $("dl-format"), dlRest: $("dl-rest"),
  liveText: $("live-text"), liveList: $("live-list"), liveClear: $("live-clear"),
  keyForm: $("key-form"), key: $("api-key"), keyClear: $("key-clear"), keyStatus: $("key-status"),
  modelLine: $("model-line"), tinyBanner: $("tiny-banner"), tinyText: $("tiny-text"),
  errorBanner: $("error-banner"), errorText: $("error-text"), errorClose: $("error-close"),
};

const params = new URLSearchParams(location.search);
// ?player=scheduled plays through AudioBufferSourceNodes, as the page does where AudioWorklet is missing.
const playback = new Playback({ preferWorklet: params.get("player") !== "scheduled" });
const waveform = new Waveform($("wave"), $("level"), $("wave-caption"));
const panel = new ServerPanel({
  readiness: $("readiness"), state: $("s-state"), active: $("s-active"), queued: $("s-queued"), kv: $("s-kv"),
  kvMeter: $("s-kv-meter"), tokens: $("s-tokens"), audio: $("s-audio"), ttfb50: $("s-ttfb50"),
  ttfb95: $("s-ttfb95"), ttfbScope: $("s-ttfb-scope"), completed: $("s-completed"), cancelled: $("s-cancelled"),
  connections: $("s-connections"), spark: $("spark"), sparkCaption: $("spark-caption"),
});
const cutter = new SentenceCutter();

// ------------------------------------------------------------------ messages

function showError(error, context = "") {
  let message = error.message ?? String(error);
  if (error.unauthorized) {
    message = apiKey()
      ? `The server rejected the API key: ${message}.`
      : `This server needs an API key; enter it under "API key". (${message})`;
    ui.keyStatus.textContent = apiKey() ? "The server rejected this key." : "The server needs a key.";
    ui.key.setAttribute("aria-invalid", "true");
  } else if (error.code) {
    message = `${message} (${error.code})`;
  }
  ui.errorText.textContent = context ? `${context}: ${message}` : message;
  ui.errorBanner.hidden = false;
}

function clearError() {
  ui.errorBanner.hidden = true;
  ui.errorText.textContent = "";
}

function setStatus(text) {
  ui.status.textContent = text;
}

const ms = (value) => (value === null || value === undefined ? "—" : `${Math.round(value)} ms`);

// ------------------------------------------------------------------ server information

async function loadServerInfo() {
  try {
    const [voices, models] = await Promise.all([getJSON("v1/audio/voices"), getJSON("v1/models")]);
    const previous = ui.voice.value || "tara";
    ui.voice.replaceChildren(...voices.voices.map((voice) => {
      const aliases = voice.aliases.length ? ` · ${voice.aliases.join(", ")}` : "";
      return new Option(`${voice.name}${aliases}`, voice.id, false, voice.id === previous);
    }));
    ui.voice.removeAttribute("aria-busy");
    const card = models.data[0];
    ui.modelLine.textContent = `Model ${card.id} · ${card.backend} backend`;
    ui.tinyBanner.hidden = !card.tiny;
    // The server's own words name the missing checkpoints.
    if (card.tiny && card.warning) ui.tinyText.textContent = card.warning;
    if (apiKey()) ui.keyStatus.textContent = "Key accepted.";
    ui.key.removeAttribute("aria-invalid");
    clearError();
  } catch (error) {
    ui.modelLine.textContent = "Model information unavailable.";
    showError(error, "Loading voices");
  }
}

// ------------------------------------------------------------------ speak

function speechParams() {
  const out = { speed: Number(ui.speed.value) };
  if (ui.voice.value) out.voice = ui.voice.value;
  const number = (input) => (input.value.trim() === "" ? null : Number(input.value));
  const temperature = number(ui.temperature);
  const topP = number(ui.topP);
  const seed = number(ui.seed);
  if (temperature !== null) out.temperature = temperature;
  if (topP !== null) out.top_p = topP;
  if (seed !== null) out.seed = Math.trunc(seed);
  return out;
}

function insertTag(tag) {
  const { text } = ui;
  const insert = `<${tag}>`;
  const start = text.selectionStart ?? text.value.length;
  const end = text.selectionEnd ?? start;
  const before = text.value.slice(0, start);
  const after = text.value.slice(end);
  const spaceBefore = before && !/\s$/.test(before) ? " " : "";
  const spaceAfter = after && !/^\s/.test(after) ? " " : "";
  text.value = `${before}${spaceBefore}${insert}${spaceAfter}${after}`;
  const caret = before.length + spaceBefore.length + insert.length + spaceAfter.length;
  text.focus();
  text.setSelectionRange(caret, caret);
}

async function speak() {
  const text = ui.text.value.trim();
  if (!text) {
    setStatus("Type something to speak first.");
    ui.text.focus();
    return;
  }
  clearError();
  ui.ack.hidden = true;
  try {
    // Created inside the click, so that the browser lets the audio start.
    const ready = playback.ensurePlayer();
    await playback.stop();
    await ready;
  } catch (error) {
    showError(error, "Audio output");
    return;
  }
  playback.enqueue(text, speechParams(), "speak");
}

async function stop() {
  const ack = await playback.stop();
  if (ack === null) {
    setStatus("Stopped.");
    return;
  }
  ui.ack.hidden = false;
  ui.ack.dataset.cancelled = String(Boolean(ack.cancelled));
  ui.ack.textContent = ack.cancelled
    ? `Server acknowledged: request ${ack.request_id} cancelled (${Math.round(ack.roundTripMs)} ms round trip).`
    : `Server answered: ${ack.message ?? "nothing was running"}; playback stopped here.`;
  setStatus("Stopped.");
}

function refreshButtons() {
  ui.stop.disabled = !playback.busy;
  const utterance = playback.lastUtterance ?? playback.utterance;
  ui.dlWav.disabled = !(utterance && utterance.bytes > 0);
}

function showJob(job) {
  if (job.state === "queued") return;
  const m = job.metrics ?? {};
  ui.ttfb.textContent = ms(job.ttfbMs);
  ui.ttfb.dataset.ms = job.ttfbMs === null ? "" : job.ttfbMs.toFixed(1);
  ui.total.textContent = job.totalMs === null ? "streaming…" : ms(job.totalMs);
  ui.total.dataset.ms = job.totalMs === null ? "" : job.totalMs.toFixed(1);
  ui.serverTtfb.textContent = m.gateway_ttfb_ms === undefined ? "—" : ms(m.gateway_ttfb_ms);
  if (typeof m.rtf === "number") {
    ui.rtf.textContent = `${m.rtf.toFixed(2)} (${(1 / m.rtf).toFixed(1)}× real time)`;
  } else if (job.state !== "done") {
    ui.rtf.textContent = "—";
  }
  const stateText = {
    sent: "Sent; waiting for the first audio…",
    streaming: `Streaming: first audio after ${ms(job.ttfbMs)}.`,
    stopping: "Stopping…",
    done: `Done: ${m.audio_seconds?.toFixed(2) ?? "?"} s of audio in ${ms(job.totalMs)}; playing out the buffer.`,
    cancelled: "Cancelled.",
    failed: `Failed: ${job.error?.message ?? "unknown error"}`,
  }[job.state];
  if (stateText) setStatus(stateText);
  if (job.state === "failed" && job.error) showError(job.error, job.origin === "live" ? "Live text" : "Speak");
}

function showPlayer(stats) {
  const rate = stats.sampleRate;
  ui.audio.textContent = `${(stats.played / rate).toFixed(2)} s of ${(stats.received / rate).toFixed(2)} s`;
  ui.buffered.textContent = `${(stats.buffered / rate).toFixed(2)} s`;
  const firstSound = playback.utterance?.firstSoundMs ?? null;
  if (firstSound !== null) ui.sound.textContent = ms(firstSound);
  const silent = stats.silentSamples / rate;
  ui.underruns.textContent = stats.underruns ? `${stats.underruns} (${(silent * 1000).toFixed(0)} ms silent)` : "none";
  waveform.update(stats);
}

// ------------------------------------------------------------------ type and it speaks
//
// One context on the socket holds everything typed: each finished sentence goes into it with a flush,
// so the server speaks it at once, its audio follows the previous sentence's in one stream, and the
// server answers {"flushed": true, "flush_id": N} once the N-th sentence's audio is all out. A context
// that gets no text for stream_input.idle_timeout_s ends by itself; the next sentence opens a new one.

let liveTimer = null;
let liveJob = null; // the context the next sentence goes into

function liveContext() {
  if (liveJob === null || liveJob.finished || liveJob.state === "stopping") {
    liveJob = playback.openContext(speechParams(), "live");
  }
  return liveJob;
}

function setLiveItem(item, state, label) {
  item.dataset.state = state;
  item.querySelector(".state").textContent = label;
}

function liveSend(sentences) {
  for (const sentence of sentences) {
    const job = liveContext();
    if (!playback.contextText(job, `${sentence} `, { flush: true })) continue;
    const item = document.createElement("li");
    item.dataset.context = job.contextId;
    // Sentences typed before the context opened go out with its first message, as one flush.
    item.dataset.flush = String(job.state === "queued" ? 1 : job.flushes);
    const text = document.createElement("span");
    text.textContent = sentence;
    const state = document.createElement("span");
    state.className = "state";
    item.append(text, " ", state);
    setLiveItem(item, "sent", "sent");
    ui.liveList.append(item);
  }
}

function liveInput() {
  clearTimeout(liveTimer);
  playback.ensurePlayer()
    .then(() => liveSend(cutter.take(ui.liveText.value)))
    .catch((error) => showError(error, "Audio output"));
  // A pause after a finished sentence at the very end of the text sends it too.
  liveTimer = setTimeout(() => {
    if (cutter.pendingEndsSentence(ui.liveText.value)) liveSend(cutter.take(ui.liveText.value, { final: true }));
  }, LIVE_IDLE_MS);
}

function liveItems(job) {
  return [...ui.liveList.children].filter((item) => item.dataset.context === job.contextId);
}

function showLiveFlushed({ job, flushId }) {
  for (const item of liveItems(job)) {
    if (item.dataset.state !== "spoken" && Number(item.dataset.flush) <= flushId) {
      const first = job.ttfbMs === null ? "" : ` · first audio ${ms(job.ttfbMs)}`;
      setLiveItem(item, "spoken", item === liveItems(job)[0] ? `spoken${first}` : "spoken");
    }
  }
}

function showLiveJob(job) {
  if (job.contextId === null) return;
  for (const item of liveItems(job)) {
    if (item.dataset.state === "spoken") continue;
    if (job.state === "streaming" && item.dataset.state === "sent") setLiveItem(item, "streaming", "speaking");
    else if (job.state === "cancelled") setLiveItem(item, "cancelled", "stopped");
    else if (job.state === "failed") setLiveItem(item, "failed", `failed: ${job.error?.message}`);
  }
}

async function liveClear() {
  clearTimeout(liveTimer);
  await playback.stop();
  liveJob = null;
  ui.liveText.value = "";
  cutter.reset();
  ui.liveList.replaceChildren();
  ui.liveText.focus();
}

// ------------------------------------------------------------------ downloads

function stamp() {
  return new Date().toISOString().replace(/[:.]/g, "-").slice(0, 19);
}

function downloadWav() {
  const utterance = playback.lastUtterance ?? playback.utterance;
  if (!utterance || !utterance.bytes) return;
  const voice = utterance.jobs[0]?.params.voice ?? "voice";
  saveBlob(wavBlob(utterance.chunks, utterance.sampleRate), `orpheus-${voice}-${stamp()}.wav`);
  setStatus(`Saved ${utterance.seconds.toFixed(2)} s as WAV.`);
}

async function downloadRest() {
  const text = ui.text.value.trim();
  if (!text) {
    setStatus("Type something first.");
    return;
  }
  const format = ui.dlFormat.value;
  ui.dlRest.disabled = true;
  ui.dlRest.textContent = "Synthesising…";
  try {
    const blob = await speechBlob({ model: "orpheus", input: text, response_format: format, ...speechParams() });
    saveBlob(blob, `orpheus-${ui.voice.value || "voice"}-${stamp()}.${format}`);
    setStatus(`Saved ${(blob.size / 1024).toFixed(0)} KiB of ${format} from POST /v1/audio/speech.`);
  } catch (error) {
    showError(error, "REST download");
  } finally {
    ui.dlRest.disabled = false;
    ui.dlRest.textContent = "Download via REST";
  }
}

// ------------------------------------------------------------------ API key

function saveKey(event) {
  event.preventDefault();
  setApiKey(ui.key.value);
  ui.key.value = "";
  playback.socket.reset();
  ui.keyStatus.textContent = apiKey() ? "Key saved for this tab; checking it…" : "No key set.";
  loadServerInfo();
  panel.poll();
}

function forgetKey() {
  setApiKey("");
  ui.key.value = "";
  playback.socket.reset();
  ui.keyStatus.textContent = "Key forgotten.";
  ui.key.removeAttribute("aria-invalid");
  loadServerInfo();
}

// ------------------------------------------------------------------ endpoints

/** The Endpoints panel's addresses, as a client of this page's server would write them. */
function fillEndpoints() {
  const base = new URL(".", document.baseURI);
  const origin = base.href.replace(/\/$/, "");
  const wsOrigin = origin.replace(/^http/, "ws");
  for (const element of document.querySelectorAll("#endpoints [data-url]")) {
    const path = element.dataset.path;
    element.textContent = `${element.dataset.url === "ws" ? wsOrigin : origin}${path}`;
  }
}

// ------------------------------------------------------------------ wiring

for (const tag of TAGS) {
  const chip = document.createElement("button");
  chip.type = "button";
  chip.className = "chip";
  chip.textContent = `<${tag}>`;
  chip.setAttribute("aria-label", `Insert <${tag}>`);
  chip.addEventListener("click", () => insertTag(tag));
  ui.tags.append(chip);
}

ui.speed.addEventListener("input", () => {
  ui.speedOut.textContent = `${Number(ui.speed.value).toFixed(2)}×`;
});
ui.speak.addEventListener("click", speak);
ui.stop.addEventListener("click", stop);
ui.text.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    speak();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && playback.busy) {
    event.preventDefault();
    stop();
  }
});
ui.dlWav.addEventListener("click", downloadWav);
ui.dlRest.addEventListener("click", downloadRest);
ui.liveText.addEventListener("input", liveInput);
ui.liveClear.addEventListener("click", liveClear);
ui.keyForm.addEventListener("submit", saveKey);
ui.keyClear.addEventListener("click", forgetKey);
ui.errorClose.addEventListener("click", clearError);

playback.addEventListener("job", (event) => {
  showJob(event.detail);
  showLiveJob(event.detail);
  refreshButtons();
});
playback.addEventListener("flushed", (event) => showLiveFlushed(event.detail));
playback.addEventListener("player", (event) => showPlayer(event.detail));
playback.addEventListener("stream-start", (event) => {
  waveform.show(event.detail);
  ui.sound.textContent = "—";
  waveform.setLevelSource(() => playback.player.level());
  waveform.setActive(true);
  ui.playerKind.textContent = playback.player.kind === "worklet" ? "AudioWorklet" : "scheduled buffers";
  refreshButtons();
});
playback.addEventListener("audio", () => waveform.wake());
playback.addEventListener("stream-end", () => {
  waveform.setActive(false);
  const stats = playback.player.stats;
  const underruns = stats.underruns ? `${stats.underruns} underrun(s)` : "no underruns";
  if (!ui.status.textContent.startsWith("Failed")) {
    setStatus(`Played ${(stats.played / stats.sampleRate).toFixed(2)} s, ${underruns}.`);
  }
  refreshButtons();
});
playback.addEventListener("notice", (event) => showError(event.detail));

// For people poking at the page from the console, and for the browser tests.
window.orpheusPlayground = {
  playback,
  panel,
  snapshot: () => ({ ...playback.snapshot(), server: panel.last }),
};

if (!apiKey()) ui.keyStatus.textContent = "No key set. Kept in this tab only (sessionStorage) when you set one.";
fillEndpoints();
loadServerInfo();
panel.start();
