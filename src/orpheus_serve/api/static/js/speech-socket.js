// The native WebSocket, /v1/audio/stream: JSON requests in, binary PCM and JSON events out.
//
// Events: "audio" (detail: ArrayBuffer), "done" / "cancelled" (detail: the server's message),
// "flushed" / "timestamps" (detail: the server's message; a context's flush is all out, a text chunk's
// bounds), "error" (detail: ApiError with the request's id in `requestId`), "close" (detail: {code, reason}).

import { ApiError, getJSON, streamProtocols, streamUrl } from "./api.js";

/** Why a handshake failed: the browser does not show the HTTP answer, so ask the REST API. */
async function explainRefusal(code) {
  try {
    await getJSON("v1/models");
  } catch (exc) {
    return exc;
  }
  return new ApiError(`the server refused the WebSocket connection (close code ${code})`);
}

export class SpeechSocket extends EventTarget {
  constructor() {
    super();
    this.ws = null;
    this.opening = null;
    this.bytesReceived = 0; // every binary byte that arrived, whatever the page did with it
  }

  get isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  /** Open the socket (once; concurrent callers share the attempt). Rejects with a readable ApiError. */
  connect() {
    if (this.isOpen) return Promise.resolve();
    this.opening ??= new Promise((resolve, reject) => {
      const ws = new WebSocket(streamUrl(), streamProtocols());
      ws.binaryType = "arraybuffer";
      let opened = false;
      ws.onopen = () => {
        opened = true;
        this.ws = ws;
        resolve();
      };
      ws.onmessage = (event) => this.receive(event.data);
      ws.onclose = async (event) => {
        if (this.ws === ws) this.ws = null;
        if (!opened) {
          reject(await explainRefusal(event.code));
          return;
        }
        this.dispatchEvent(new CustomEvent("close", { detail: { code: event.code, reason: event.reason } }));
      };
    }).finally(() => {
      this.opening = null;
    });
    return this.opening;
  }

  /** Close now (a new API key needs a new handshake); the next request opens a fresh socket. */
  reset() {
    const ws = this.ws;
    this.ws = null;
    if (ws) {
      ws.onclose = null;
      ws.close(1000, "page reset");
    }
  }

  send(message) {
    if (!this.isOpen) throw new ApiError("the WebSocket is not open");
    this.ws.send(JSON.stringify(message));
  }

  receive(data) {
    if (data instanceof ArrayBuffer) {
      this.bytesReceived += data.byteLength;
      this.dispatchEvent(new CustomEvent("audio", { detail: data }));
      return;
    }
    let message;
    try {
      message = JSON.parse(data);
    } catch {
      console.warn("ignoring a message that is not JSON", data);
      return;
    }
    if (message.error) {
      const error = ApiError.fromBody(message);
      error.requestId = message.request_id ?? null;
      this.dispatchEvent(new CustomEvent("error", { detail: error }));
    } else if (message.done) {
      this.dispatchEvent(new CustomEvent("done", { detail: message }));
    } else if ("cancelled" in message) {
      this.dispatchEvent(new CustomEvent("cancelled", { detail: message }));
    } else if (message.flushed) {
      this.dispatchEvent(new CustomEvent("flushed", { detail: message }));
    } else if (message.timestamps) {
      this.dispatchEvent(new CustomEvent("timestamps", { detail: message }));
    }
  }
}
