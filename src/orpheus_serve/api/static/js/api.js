// The server's HTTP API as the page uses it: URLs relative to the page, the API key, readable errors.

const KEY_STORAGE = "orpheus-serve.api-key";
// Offered with the key so that the server can select a subprotocol without echoing the key back.
const STREAM_SUBPROTOCOL = "orpheus.v1";
const KEY_SUBPROTOCOL_PREFIX = "orpheus.bearer.";

/** The API key for this tab (sessionStorage: gone when the tab closes, never shared with other tabs). */
export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) ?? "";
}

export function setApiKey(key) {
  const trimmed = key.trim();
  if (trimmed) sessionStorage.setItem(KEY_STORAGE, trimmed);
  else sessionStorage.removeItem(KEY_STORAGE);
}

/** An API URL relative to the page, so the page works at /, at /playground and under a proxy's prefix. */
export function apiUrl(path) {
  return new URL(path, document.baseURI);
}

export function streamUrl() {
  const url = apiUrl("v1/audio/stream");
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return url.href;
}

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

/**
 * WebSocket subprotocols carrying the API key: browsers cannot set an Authorization header on a
 * WebSocket, so the server also reads the key from `orpheus.bearer.<base64url key>`.
 */
export function streamProtocols() {
  const key = apiKey();
  return key ? [STREAM_SUBPROTOCOL, KEY_SUBPROTOCOL_PREFIX + base64url(key)] : [];
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** A failed API call, with the server's OpenAI-shaped error when it sent one. */
export class ApiError extends Error {
  constructor(message, { status = 0, code = null, param = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
    this.param = param;
  }

  get unauthorized() {
    return this.status === 401 || this.code === "invalid_api_key";
  }

  /** An `{"error": {...}}` body (HTTP response or WebSocket message) as an ApiError. */
  static fromBody(body, status = 0) {
    const error = body?.error ?? {};
    const message = typeof error.message === "string" && error.message ? error.message : `HTTP ${status}`;
    return new ApiError(message, { status, code: error.code ?? null, param: error.param ?? null });
  }
}

async function errorFrom(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // Not JSON (a proxy's HTML page, say): the status line is all there is.
  }
  return body?.error
    ? ApiError.fromBody(body, response.status)
    : new ApiError(`HTTP ${response.status} ${response.statusText}`.trim(), { status: response.status });
}

async function request(path, init = {}) {
  let response;
  try {
    response = await fetch(apiUrl(path), { ...init, headers: { ...authHeaders(), ...(init.headers ?? {}) } });
  } catch (exc) {
    throw new ApiError(`cannot reach the server (${exc.message})`);
  }
  if (!response.ok) throw await errorFrom(response);
  return response;
}

export async function getJSON(path, { signal } = {}) {
  return (await request(path, { signal })).json();
}

/** Prometheus text from /metrics (open without a key, like /health). */
export async function getMetricsText({ signal } = {}) {
  return (await request("metrics", { signal })).text();
}

/** POST /v1/audio/speech; the whole response as a Blob (the REST endpoint streams, the page just collects). */
export async function speechBlob(body, { signal } = {}) {
  const response = await request("v1/audio/speech", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  return response.blob();
}
