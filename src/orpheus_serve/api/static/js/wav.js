// WAV files from 16-bit PCM, and saving a Blob as a download.

/** A mono 16-bit PCM WAV from chunks of little-endian samples (a trailing odd byte is dropped). */
export function wavBlob(chunks, sampleRate) {
  let bytes = chunks.reduce((sum, chunk) => sum + chunk.byteLength, 0);
  const parts = [...chunks];
  if (bytes % 2) {
    const last = parts.pop();
    parts.push(last.subarray(0, last.byteLength - 1));
    bytes -= 1;
  }
  const header = new DataView(new ArrayBuffer(44));
  const text = (offset, value) => [...value].forEach((c, i) => header.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF");
  header.setUint32(4, 36 + bytes, true);
  text(8, "WAVE");
  text(12, "fmt ");
  header.setUint32(16, 16, true); // fmt chunk size
  header.setUint16(20, 1, true); // PCM
  header.setUint16(22, 1, true); // mono
  header.setUint32(24, sampleRate, true);
  header.setUint32(28, sampleRate * 2, true); // byte rate
  header.setUint16(32, 2, true); // block align
  header.setUint16(34, 16, true); // bits per sample
  text(36, "data");
  header.setUint32(40, bytes, true);
  return new Blob([header.buffer, ...parts], { type: "audio/wav" });
}

export function saveBlob(blob, filename) {
  const url = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  link.hidden = true;
  document.body.append(link);
  link.click();
  link.remove();
  // The download has its own reference by the time this runs.
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}
