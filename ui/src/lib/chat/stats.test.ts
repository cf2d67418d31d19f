import { describe, expect, it } from 'vitest';
import { findRequestStats, formatMs, formatRate, tokensPerSecond } from './stats';

const snapshot = {
  in_flight: 0,
  queue_depth: 0,
  recent: [
    { id: 'chatcmpl-a', model: 'm', ttft_ms: 4.1, itl_p50_ms: 1.2, itl_ms: [10, 20, 30], tokens_in: 16, tokens_out: 4, ended: 1 },
    { id: 'chatcmpl-b', model: 'm', ttft_ms: 2, tokens_in: 3, tokens_out: 1, ended: 2 },
  ],
};

describe('request stats', () => {
  it('finds the entry of exactly that completion id', () => {
    expect(findRequestStats(snapshot, 'chatcmpl-a')).toEqual({ ttftMs: 4.1, tokensIn: 16, tokensOut: 4, itlMs: [10, 20, 30] });
    expect(findRequestStats(snapshot, 'chatcmpl-b')).toEqual({ ttftMs: 2, tokensIn: 3, tokensOut: 1, itlMs: [] });
    expect(findRequestStats(snapshot, 'chatcmpl-zzz')).toBeNull();
  });

  it('computes tok/s as tokens out over the summed inter-token latencies', () => {
    // 4 tokens over 60 ms.
    expect(tokensPerSecond({ ttftMs: 1, tokensIn: 1, tokensOut: 4, itlMs: [10, 20, 30] })).toBeCloseTo(66.667, 3);
    expect(tokensPerSecond({ ttftMs: 1, tokensIn: 1, tokensOut: 1, itlMs: [] })).toBeNull();
    expect(formatRate(null)).toBe('—');
    expect(formatRate(66.6667)).toBe('66.7');
    expect(formatRate(1234.4)).toBe('1234');
    expect(formatMs(4.123)).toBe('4.12');
    expect(formatMs(41.23)).toBe('41.2');
    expect(formatMs(412.3)).toBe('412');
  });
});
