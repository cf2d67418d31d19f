import { describe, expect, it } from 'vitest';
import { draftAcceptance, findRequestStats, formatDrafts, formatMs, formatRate, tokensPerSecond } from './stats';

const snapshot = {
  in_flight: 0,
  queue_depth: 0,
  recent: [
    { id: 'chatcmpl-a', model: 'm', ttft_ms: 4.1, itl_p50_ms: 1.2, itl_ms: [10, 20, 30], tokens_in: 16, tokens_out: 4, ended: 1 },
    { id: 'chatcmpl-b', model: 'm', ttft_ms: 2, tokens_in: 3, tokens_out: 1, ended: 2 },
    { id: 'chatcmpl-c', model: 'm', ttft_ms: 3, itl_ms: [5, 5], tokens_in: 40, tokens_out: 30, draft_tokens: 24, accepted_tokens: 18, ended: 3 },
  ],
};

describe('request stats', () => {
  it('finds the entry of exactly that completion id', () => {
    expect(findRequestStats(snapshot, 'chatcmpl-a')).toEqual({ ttftMs: 4.1, tokensIn: 16, tokensOut: 4, itlMs: [10, 20, 30], draftTokens: 0, acceptedTokens: 0 });
    expect(findRequestStats(snapshot, 'chatcmpl-b')).toEqual({ ttftMs: 2, tokensIn: 3, tokensOut: 1, itlMs: [], draftTokens: 0, acceptedTokens: 0 });
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

  it('carries the drafted and kept tokens of speculative decoding, and words them only when there were drafts', () => {
    const stats = findRequestStats(snapshot, 'chatcmpl-c')!;
    expect(stats).toMatchObject({ draftTokens: 24, acceptedTokens: 18 });
    const drafts = draftAcceptance(stats.draftTokens, stats.acceptedTokens);
    expect(drafts).toEqual({ drafted: 24, kept: 18, rate: 0.75 });
    expect(formatDrafts(drafts!)).toBe('drafted 24 · kept 18 (75%)');
    expect(formatDrafts(draftAcceptance(3, 0)!)).toBe('drafted 3 · kept 0 (0%)');
    // Nothing drafted (speculation off, or no repeats), or an answer saved before the server counted drafts.
    expect(draftAcceptance(0, 0)).toBeNull();
    expect(draftAcceptance(undefined, undefined)).toBeNull();
    // A kept count above the drafted one (never from the engine) is capped at 100 %.
    expect(draftAcceptance(4, 9)?.rate).toBe(1);
  });
});
