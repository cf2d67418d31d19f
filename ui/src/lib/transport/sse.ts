// Incremental Server-Sent Events parser (WHATWG "event stream interpretation"): bytes may be
// split anywhere (inside a line, a CRLF, or a multi-byte UTF-8 character) and one chunk may carry
// many events, so it keeps the unfinished line and event between `push` calls.

export interface SseEvent {
  /** The `event:` field, `message` when absent. */
  event: string;
  /** `data:` lines joined with `\n`. */
  data: string;
  id: string | null;
}

export class SseParser {
  private readonly decoder = new TextDecoder('utf-8');
  private line = '';
  /** A chunk ended in `\r`: a `\n` starting the next chunk belongs to the same line break. */
  private pendingCr = false;
  private eventName = '';
  private dataLines: string[] = [];
  private lastId: string | null = null;

  /** Feeds bytes (or already decoded text) and returns the events they completed. */
  push(chunk: Uint8Array | string): SseEvent[] {
    const text = typeof chunk === 'string' ? chunk : this.decoder.decode(chunk, { stream: true });
    return this.consume(text);
  }

  /**
   * The stream ended. The spec drops an event missing its blank line; we dispatch it instead, so
   * a server that closes right after `data: [DONE]` still ends the stream cleanly.
   */
  end(): SseEvent[] {
    const events = this.consume(this.decoder.decode());
    if (this.line !== '') {
      this.processLine(this.line);
      this.line = '';
    }
    const last = this.dispatch();
    if (last) events.push(last);
    return events;
  }

  private consume(text: string): SseEvent[] {
    const events: SseEvent[] = [];
    let start = 0;
    if (this.pendingCr && text.startsWith('\n')) start = 1;
    this.pendingCr = false;
    for (let i = start; i < text.length; i++) {
      const char = text[i];
      if (char !== '\n' && char !== '\r') continue;
      const line = this.line + text.slice(start, i);
      this.line = '';
      if (char === '\r') {
        if (i + 1 === text.length) this.pendingCr = true;
        else if (text[i + 1] === '\n') i++;
      }
      start = i + 1;
      if (line === '') {
        const event = this.dispatch();
        if (event) events.push(event);
      } else {
        this.processLine(line);
      }
    }
    this.line += text.slice(start);
    return events;
  }

  private processLine(line: string): void {
    if (line.startsWith(':')) return; // comment / keep-alive
    const colon = line.indexOf(':');
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    switch (field) {
      case 'data':
        this.dataLines.push(value);
        break;
      case 'event':
        this.eventName = value;
        break;
      case 'id':
        if (!value.includes('\0')) this.lastId = value;
        break;
      default:
        break; // `retry` and unknown fields do not matter to a fetch-based reader
    }
  }

  private dispatch(): SseEvent | null {
    const hasData = this.dataLines.length > 0;
    const event: SseEvent = {
      event: this.eventName || 'message',
      data: this.dataLines.join('\n'),
      id: this.lastId,
    };
    this.eventName = '';
    this.dataLines = [];
    return hasData ? event : null;
  }
}
