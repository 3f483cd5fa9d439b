// Cuts text into sentences as they are typed, for the "type and it speaks" demo.

// A sentence ends at . ! ? or … (with any closing quotes or brackets) once whitespace follows it:
// "3." may still become "3.5", but "3. " is done. A line break ends one too.
const BOUNDARY = /[.!?…]+["'”’»)\]]*(?=\s)|\n/g;

export class SentenceCutter {
  constructor() {
    this.consumed = 0; // characters of the text already handed out
  }

  reset() {
    this.consumed = 0;
  }

  /**
   * The sentences completed in `text` since the last call. With `final`, what is left after the
   * last boundary counts as a sentence too. Text edited before the cut is not spoken again.
   */
  take(text, { final = false } = {}) {
    this.consumed = Math.min(this.consumed, text.length);
    const rest = text.slice(this.consumed);
    const sentences = [];
    let cut = 0;
    for (const match of rest.matchAll(BOUNDARY)) {
      const end = match.index + match[0].length;
      const sentence = rest.slice(cut, end).trim();
      if (sentence) sentences.push(sentence);
      cut = end;
    }
    if (final && rest.slice(cut).trim()) {
      sentences.push(rest.slice(cut).trim());
      cut = rest.length;
    }
    this.consumed += cut;
    return sentences;
  }

  /** Whether what is left (not yet handed out) ends like a finished sentence. */
  pendingEndsSentence(text) {
    return /[.!?…]["'”’»)\]]*$/.test(text.slice(this.consumed).trim());
  }
}
