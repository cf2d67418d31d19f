import { describe, expect, it } from 'vitest';
import type { MetricsSnapshot, RecentRequest } from '../transport/types';
import { DashboardStore } from './dashboard.svelte';
import { DashboardSeries, toRequestPoint } from './series';

const request = (id: string, ended: number, ttft: number, itl: number[] = [10, 20, 30]): RecentRequest => ({
  id, model: 'qwen3-tiny', ttft_ms: ttft, itl_ms: itl, tokens_in: 12, tokens_out: itl.length + 1, ended,
});

const snapshot = (recent: RecentRequest[], extra: Partial<MetricsSnapshot> = {}): MetricsSnapshot => ({
  recent, in_flight: 0, queue_depth: 0, ...extra,
});

describe('DashboardSeries', () => {
  it('adds each request once, however many snapshots list it', () => {
    const series = new DashboardSeries();
    const a = request('chatcmpl-a', 1_000_000, 40.5);
    const b = request('chatcmpl-b', 1_001_000, 17.25);
    expect(series.ingest(snapshot([a]), 1_000_100)).toBe(1);
    expect(series.ingest(snapshot([a]), 1_000_600)).toBe(0);
    expect(series.ingest(snapshot([b, a]), 1_001_100)).toBe(1);
    expect(series.requests.map((r) => r.id)).toEqual(['chatcmpl-a', 'chatcmpl-b']);
    expect(series.samples).toHaveLength(3);
    expect(series.tokens).toHaveLength(6);
  });

  it('ends on the newest request, whose TTFT is exactly its ttft_ms', () => {
    const series = new DashboardSeries();
    series.ingest(snapshot([request('x', 2000, 3.3), request('y', 5000, 41.37), request('z', 3000, 9.9)]), 6000);
    expect(series.lastRequest?.id).toBe('y');
    expect(series.lastRequest?.ttftMs).toBe(41.37);
    const [xs, ttft] = series.requestColumns((r) => r.ttftMs);
    expect(xs).toEqual([2, 3, 5]);
    expect(ttft.at(-1)).toBe(41.37);
  });

  it('dedupes entries without an id by their fields', () => {
    const series = new DashboardSeries();
    const { id: _id, ...old } = request('ignored', 1000, 5);
    series.ingest(snapshot([old]), 1000);
    series.ingest(snapshot([old]), 1500);
    expect(series.requests).toHaveLength(1);
  });

  it('derives p50 ITL, tok/s and per-token times from itl_ms', () => {
    const point = toRequestPoint(request('r', 10_000, 5, [10, 30, 20]));
    expect(point.itlP50Ms).toBe(20);
    expect(point.tokensPerSecond).toBeCloseTo(4 / 0.06);
    const series = new DashboardSeries();
    series.ingest(snapshot([request('r', 10_000, 5, [10, 30, 20])]), 10_000);
    // The last token came at `ended`; each earlier one its gap before.
    expect(series.tokens.map((p) => [p.t, p.itlMs])).toEqual([[9.95, 10], [9.98, 30], [10, 20]]);
    expect(toRequestPoint({ ...request('s', 0, 1, []), itl_p50_ms: 7 }).itlP50Ms).toBe(7);
    expect(toRequestPoint(request('s', 0, 1, [])).tokensPerSecond).toBeNull();
  });

  it('samples memory, queue, in flight and summed prefix cache counters', () => {
    const series = new DashboardSeries();
    series.ingest(snapshot([], {
      in_flight: 1, queue_depth: 2, kv_cache_bytes: 300, active_memory_bytes: 1000, peak_memory_bytes: 2000,
      models: [{ model_id: 'a', prefix_cache_hits: 3, prefix_cache_misses: 1, disk_cache_hits: 2 }, { model_id: 'b', prefix_cache_hits: 1, prefix_cache_misses: 4 }],
      disk_cache: { path: '/c', budget_bytes: 9000, bytes: 4000, files: 3, read_bytes: 100, read_ms: 1, written_bytes: 5000, evicted_files: 0, evicted_bytes: 0, writing_stopped: false },
    }), 500);
    series.ingest(snapshot([], { mlx_active_bytes: 7, mlx_peak_bytes: 9 }), 1000);
    expect(series.samples[0]).toEqual({
      t: 0.5, activeBytes: 1000, peakBytes: 2000, kvBytes: 300, inFlight: 1, queueDepth: 2, prefixHits: 4, diskHits: 2, prefixMisses: 5, snapshots: null, snapshotBytes: null,
      diskBytes: 4000, diskBudget: 9000, diskRead: 100, diskWritten: 5000, diskEvicted: 0,
      draftTokens: 0, acceptedTokens: 0, drafted: null, kept: null,
    });
    expect(series.samples[1]).toMatchObject({ activeBytes: 7, peakBytes: 9, kvBytes: null, prefixHits: 0, diskHits: 0, diskBytes: null });
  });

  it('turns the per-model draft counters into tokens drafted and kept per sample interval', () => {
    const series = new DashboardSeries();
    const models = (...counters: [string, number, number][]) => ({
      models: counters.map(([model_id, draft_tokens, accepted_tokens]) => ({ model_id, draft_tokens, accepted_tokens })),
    });
    // Counted before the dashboard opened: the totals, but no interval yet.
    series.ingest(snapshot([], models(['a', 40, 30])), 1000);
    series.ingest(snapshot([], models(['a', 40, 30])), 1500);
    series.ingest(snapshot([], models(['a', 64, 48], ['b', 10, 2])), 2000);
    // Counters lower than before: a restarted server, all of it new ('b' not listed: nothing).
    series.ingest(snapshot([], models(['a', 5, 4])), 2500);
    series.ingest(snapshot([], models(['a', 8, 8], ['b', 12, 3])), 3000);
    expect(series.samples.map((x) => [x.drafted, x.kept])).toEqual([[null, null], [0, 0], [34, 20], [5, 4], [5, 5]]);
    expect(series.samples.map((x) => [x.draftTokens, x.acceptedTokens])).toEqual([[40, 30], [40, 30], [74, 50], [5, 4], [20, 11]]);
    const [xs, drafted, kept] = series.sampleColumns((x) => x.drafted, (x) => x.kept);
    expect(xs).toEqual([1, 1.5, 2, 2.5, 3]);
    expect(drafted).toEqual([null, 0, 34, 5, 5]);
    expect(kept).toEqual([null, 0, 20, 4, 5]);
    // The window's totals: what the intervals in it add up to.
    expect(series.draftsSince(0)).toEqual({ drafted: 44, kept: 29 });
    expect(series.draftsSince(2.5)).toEqual({ drafted: 10, kept: 9 });
    series.clear();
    series.ingest(snapshot([], models(['a', 8, 8])), 4000);
    expect(series.lastSample).toMatchObject({ drafted: null, kept: null, draftTokens: 8 });
    // An older server without the fields: nothing drafted.
    const older = new DashboardSeries();
    older.ingest(snapshot([], { models: [{ model_id: 'a', prefix_cache_hits: 1 }] }), 1000);
    older.ingest(snapshot([], { models: [{ model_id: 'a', prefix_cache_hits: 2 }] }), 1500);
    expect(older.lastSample).toMatchObject({ draftTokens: 0, acceptedTokens: 0, drafted: 0, kept: 0 });
  });

  it('reports the share of prompt tokens the prefix cache served in the window, and the snapshots', () => {
    const series = new DashboardSeries();
    expect(series.cachedShare(0)).toBeNull();
    series.ingest(snapshot([
      { ...request('t1', 1000, 5), tokens_in: 600, cached_tokens: 0 },
      { ...request('t2', 2000, 5), tokens_in: 700, cached_tokens: 599 },
      { ...request('t3', 3000, 5), tokens_in: 800, cached_tokens: 699 },
    ], { prefix_snapshots: 7, prefix_snapshot_bytes: 4096 }), 3000);
    expect(series.cachedShare(0)).toBeCloseTo(1298 / 2100);
    expect(series.cachedShare(1.5)).toBeCloseTo(1298 / 1500);
    expect(series.lastRequest?.cachedTokens).toBe(699);
    expect(series.lastSample).toMatchObject({ snapshots: 7, snapshotBytes: 4096 });
  });

  it('keeps every history bounded, and never re-adds a request the server still lists', () => {
    const series = new DashboardSeries({ requests: 3, samples: 4, tokens: 5 });
    const all = Array.from({ length: 10 }, (_, i) => request(`r${i}`, 1000 * (i + 1), i));
    for (let i = 0; i < 10; i++) series.ingest(snapshot(all.slice(0, i + 1)), 1000 * (i + 1));
    expect(series.requests.map((r) => r.id)).toEqual(['r7', 'r8', 'r9']);
    expect(series.samples).toHaveLength(4);
    expect(series.tokens).toHaveLength(5);
    expect(series.ingest(snapshot(all), 20_000)).toBe(0);
    expect(series.requests.map((r) => r.id)).toEqual(['r7', 'r8', 'r9']);
    expect(series.lastRequest?.ttftMs).toBe(9);
  });
});

describe('DashboardStore', () => {
  it('bumps its version on every snapshot and follows the newest request', () => {
    let now = 1000;
    const store = new DashboardStore(undefined, () => now);
    store.ingest(snapshot([request('a', 900, 12.5)]));
    now = 1500;
    store.ingest(snapshot([request('a', 900, 12.5), request('b', 1400, 8.75)]));
    expect(store.version).toBe(2);
    expect(store.updatedAt).toBe(1500);
    expect(store.series.lastRequest?.ttftMs).toBe(8.75);
  });
});
