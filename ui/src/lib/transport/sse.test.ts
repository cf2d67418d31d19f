import { describe, expect, it } from 'vitest';
import { SseParser, type SseEvent } from './sse';

const encoder = new TextEncoder();

/** Feeds `text` cut at every given offset, as bytes, and collects all events. */
function parseInPieces(text: string, cuts: number[]): SseEvent[] {
  const bytes = encoder.encode(text);
  const parser = new SseParser();
  const events: SseEvent[] = [];
  let start = 0;
  for (const cut of [...cuts, bytes.length]) {
    events.push(...parser.push(bytes.subarray(start, cut)));
    start = cut;
  }
  events.push(...parser.end());
  return events;
}

const stream =
  'data: {"id":"chatcmpl-1","choices":[{"delta":{"content":"Hé"}}]}\n\n' +
  ': keep-alive comment\n\n' +
  'data: {"id":"chatcmpl-1","choices":[{"delta":{"content":"llo 👋"}}]}\r\n\r\n' +
  'event: ping\ndata: {}\n\n' +
  'data: [DONE]\n\n';

describe('SseParser', () => {
  it('parses a whole stream in one chunk (many events per chunk)', () => {
    const events = parseInPieces(stream, []);
    expect(events.map((e) => e.data)).toEqual([
      '{"id":"chatcmpl-1","choices":[{"delta":{"content":"Hé"}}]}',
      '{"id":"chatcmpl-1","choices":[{"delta":{"content":"llo 👋"}}]}',
      '{}',
      '[DONE]',
    ]);
    expect(events.map((e) => e.event)).toEqual(['message', 'message', 'ping', 'message']);
  });

  it('gives the same events however the bytes are split (inside lines, CRLF and UTF-8)', () => {
    const whole = parseInPieces(stream, []);
    const length = encoder.encode(stream).length;
    for (let cut = 1; cut < length; cut++) {
      expect(parseInPieces(stream, [cut])).toEqual(whole);
    }
    // One byte at a time.
    expect(parseInPieces(stream, Array.from({ length: length - 1 }, (_, i) => i + 1))).toEqual(whole);
  });

  it('joins multi-line data and strips one leading space only', () => {
    const events = parseInPieces('data:a\ndata:  b\ndata\n\n', []);
    expect(events).toEqual([{ event: 'message', data: 'a\n b\n', id: null }]);
  });

  it('accepts bare CR line endings', () => {
    expect(parseInPieces('data: x\r\rdata: y\r\r', [8]).map((e) => e.data)).toEqual(['x', 'y']);
  });

  it('keeps named error events and ids', () => {
    const events = parseInPieces('id: 7\nevent: error\ndata: {"type":"error"}\n\n', [3, 15]);
    expect(events).toEqual([{ event: 'error', data: '{"type":"error"}', id: '7' }]);
  });

  it('dispatches a last event that misses its blank line when the stream ends', () => {
    expect(parseInPieces('data: one\n\ndata: [DONE]', []).map((e) => e.data)).toEqual(['one', '[DONE]']);
    expect(parseInPieces('data: [DONE]\n', []).map((e) => e.data)).toEqual(['[DONE]']);
  });

  it('ignores events without data', () => {
    expect(parseInPieces('event: nothing\n\n: comment\n\n', [])).toEqual([]);
  });
});
