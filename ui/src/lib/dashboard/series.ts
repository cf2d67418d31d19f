// The dashboard's data: each metrics snapshot adds one time sample (memory, queue, in flight,
// prefix cache counters, and the tokens speculative decoding drafted and kept since the previous
// snapshot), and each request in `recent` adds one point, once (deduplicated by
// id), at the time it ended: TTFT, median ITL, tokens in/out, tok/s; its inter-token gaps add
// one point per token. Every history is bounded. Times are seconds (uPlot's unit).

import type { MetricsSnapshot, RecentRequest } from '../transport/types';

export interface RequestPoint {
  key: string;
  id: string | null;
  model: string;
  /** When it ended, seconds. */
  t: number;
  ttftMs: number;
  itlP50Ms: number | null;
  tokensIn: number;
  /** Of tokensIn, how many the prefix cache served. */
  cachedTokens: number;
  tokensOut: number;
  /** tokens_out over the summed gaps (as under an answer); null without gaps. */
  tokensPerSecond: number | null;
}

export interface Sample {
  t: number;
  activeBytes: number | null;
  peakBytes: number | null;
  kvBytes: number | null;
  inFlight: number;
  queueDepth: number;
  prefixHits: number;
  /** Requests whose prefix came off the disk cache (summed over models). */
  diskHits: number;
  prefixMisses: number;
  snapshots: number | null;
  snapshotBytes: number | null;
  /** The disk cache's bytes held, budget, and bytes read and written since start (null: off). */
  diskBytes: number | null;
  diskBudget: number | null;
  diskRead: number | null;
  diskWritten: number | null;
  diskEvicted: number | null;
  /** Tokens speculative decoding drafted and the models kept since the server started (summed
   * over models). */
  draftTokens: number;
  acceptedTokens: number;
  /** Of those, the ones since the previous sample; null on the first (no interval yet). */
  drafted: number | null;
  kept: number | null;
}

export interface TokenPoint {
  t: number;
  itlMs: number;
}

export interface SeriesLimits {
  requests: number;
  samples: number;
  tokens: number;
}

export const DEFAULT_LIMITS: SeriesLimits = { requests: 500, samples: 1800, tokens: 20_000 };

function num(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

function median(values: number[]): number | null {
  if (values.length === 0) return null;
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

/** The dedupe key: the request id, or (older servers) the fields that make an entry unique. */
export function requestKey(entry: RecentRequest): string {
  return entry.id ?? `${entry.model}|${entry.ended}|${entry.ttft_ms}|${entry.tokens_in}|${entry.tokens_out}`;
}

export function toRequestPoint(entry: RecentRequest): RequestPoint {
  const gaps = Array.isArray(entry.itl_ms) ? entry.itl_ms.filter((g) => Number.isFinite(g)) : [];
  const sum = gaps.reduce((a, b) => a + b, 0);
  return {
    key: requestKey(entry),
    id: entry.id ?? null,
    model: entry.model,
    t: entry.ended / 1000,
    ttftMs: entry.ttft_ms,
    itlP50Ms: num(entry.itl_p50_ms) ?? median(gaps),
    tokensIn: entry.tokens_in,
    cachedTokens: num(entry.cached_tokens) ?? 0,
    tokensOut: entry.tokens_out,
    tokensPerSecond: sum > 0 ? entry.tokens_out / (sum / 1000) : null,
  };
}

/** Each token's gap at the time the token came: walking back from `ended`. */
function tokenPoints(entry: RecentRequest): TokenPoint[] {
  const gaps = Array.isArray(entry.itl_ms) ? entry.itl_ms : [];
  const points: TokenPoint[] = new Array(gaps.length);
  let at = entry.ended;
  for (let i = gaps.length - 1; i >= 0; i--) {
    points[i] = { t: at / 1000, itlMs: gaps[i] };
    at -= gaps[i];
  }
  return points;
}

/** Inserts keeping `t` ascending (points nearly always arrive in order: a push). */
function insertSorted<T extends { t: number }>(list: T[], item: T): void {
  let i = list.length;
  while (i > 0 && list[i - 1].t > item.t) i--;
  list.splice(i, 0, item);
}

export class DashboardSeries {
  requests: RequestPoint[] = [];
  samples: Sample[] = [];
  tokens: TokenPoint[] = [];
  private seen = new Set<string>();
  /** Each model's drafted and kept counters at the previous sample. */
  private draftCounters = new Map<string, { drafted: number; kept: number }>();

  constructor(readonly limits: SeriesLimits = DEFAULT_LIMITS) {}

  /** Adds one snapshot taken at `nowMs` (local clock); returns how many requests were new. */
  ingest(snapshot: MetricsSnapshot, nowMs: number): number {
    const recent = Array.isArray(snapshot.recent) ? [...snapshot.recent].sort((a, b) => a.ended - b.ended) : [];
    let added = 0;
    for (const entry of recent) {
      const key = requestKey(entry);
      if (this.seen.has(key)) continue;
      this.seen.add(key);
      insertSorted(this.requests, toRequestPoint(entry));
      for (const point of tokenPoints(entry)) insertSorted(this.tokens, point);
      added++;
    }
    const models = Array.isArray(snapshot.models) ? snapshot.models : [];
    const disk = snapshot.disk_cache && typeof snapshot.disk_cache === 'object' ? snapshot.disk_cache : null;
    const drafts = this.draftInterval(models);
    this.samples.push({
      t: nowMs / 1000,
      activeBytes: num(snapshot.active_memory_bytes) ?? num(snapshot.mlx_active_bytes),
      peakBytes: num(snapshot.peak_memory_bytes) ?? num(snapshot.mlx_peak_bytes),
      kvBytes: num(snapshot.kv_cache_bytes),
      inFlight: num(snapshot.in_flight) ?? 0,
      queueDepth: num(snapshot.queue_depth) ?? 0,
      prefixHits: models.reduce((sum, m) => sum + (num(m.prefix_cache_hits) ?? 0), 0),
      diskHits: models.reduce((sum, m) => sum + (num(m.disk_cache_hits) ?? 0), 0),
      prefixMisses: models.reduce((sum, m) => sum + (num(m.prefix_cache_misses) ?? 0), 0),
      snapshots: num(snapshot.prefix_snapshots),
      snapshotBytes: num(snapshot.prefix_snapshot_bytes),
      diskBytes: num(disk?.bytes),
      diskBudget: num(disk?.budget_bytes),
      diskRead: num(disk?.read_bytes),
      diskWritten: num(disk?.written_bytes),
      diskEvicted: num(disk?.evicted_files),
      ...drafts,
    });
    this.trim(recent.map(requestKey));
    return added;
  }

  /** The summed draft counters and what they grew by since the previous sample, model by model: a
   * model seen for the first time after the first sample, or whose counters went down (a
   * restarted server), counts whole. */
  private draftInterval(models: NonNullable<MetricsSnapshot['models']>): Pick<Sample, 'draftTokens' | 'acceptedTokens' | 'drafted' | 'kept'> {
    const first = this.samples.length === 0;
    let draftTokens = 0;
    let acceptedTokens = 0;
    let drafted = 0;
    let kept = 0;
    for (const model of models) {
      const now = { drafted: num(model.draft_tokens) ?? 0, kept: num(model.accepted_tokens) ?? 0 };
      const before = this.draftCounters.get(model.model_id);
      const restarted = !before || now.drafted < before.drafted || now.kept < before.kept;
      drafted += restarted ? now.drafted : now.drafted - before.drafted;
      kept += restarted ? now.kept : now.kept - before.kept;
      draftTokens += now.drafted;
      acceptedTokens += now.kept;
      this.draftCounters.set(model.model_id, now);
    }
    return { draftTokens, acceptedTokens, drafted: first ? null : drafted, kept: first ? null : kept };
  }

  /** Tokens drafted and kept over the samples taken since `since` (seconds). */
  draftsSince(since: number): { drafted: number; kept: number } {
    let drafted = 0;
    let kept = 0;
    for (const sample of this.samples) {
      if (sample.t < since) continue;
      drafted += sample.drafted ?? 0;
      kept += sample.kept ?? 0;
    }
    return { drafted, kept };
  }

  private trim(current: string[]): void {
    const { requests, samples, tokens } = this.limits;
    if (this.requests.length > requests) this.requests.splice(0, this.requests.length - requests);
    if (this.samples.length > samples) this.samples.splice(0, this.samples.length - samples);
    if (this.tokens.length > tokens) this.tokens.splice(0, this.tokens.length - tokens);
    // Forget ids no longer shown, except those the server still lists (they must not come back).
    if (this.seen.size > 2 * requests) this.seen = new Set([...this.requests.map((r) => r.key), ...current]);
  }

  /** Share of prompt tokens the prefix cache served over the requests that ended since
   * `since` (seconds); null before any prompt token. */
  cachedShare(since: number): number | null {
    let input = 0;
    let cached = 0;
    for (const r of this.requests) {
      if (r.t < since) continue;
      input += r.tokensIn;
      cached += r.cachedTokens;
    }
    return input > 0 ? cached / input : null;
  }

  get lastRequest(): RequestPoint | null {
    return this.requests.at(-1) ?? null;
  }

  get lastSample(): Sample | null {
    return this.samples.at(-1) ?? null;
  }

  /** Columns for uPlot: `[xs, ...ys]`. */
  requestColumns(...pick: ((r: RequestPoint) => number | null)[]): (number | null)[][] {
    return [this.requests.map((r) => r.t), ...pick.map((f) => this.requests.map(f))];
  }

  sampleColumns(...pick: ((s: Sample) => number | null)[]): (number | null)[][] {
    return [this.samples.map((s) => s.t), ...pick.map((f) => this.samples.map(f))];
  }

  tokenColumns(): number[][] {
    return [this.tokens.map((p) => p.t), this.tokens.map((p) => p.itlMs)];
  }

  clear(): void {
    this.requests = [];
    this.samples = [];
    this.tokens = [];
    this.seen.clear();
    this.draftCounters.clear();
  }
}
