// The numbers under an answer come from the engine's own record of that request
// (`/metrics/cache` `recent`, matched by completion id), never from client-side timing.

import { formatPercent } from '../format';
import type { MetricsSnapshot } from '../transport/types';
import type { RequestStats } from './model';

export function findRequestStats(snapshot: MetricsSnapshot, completionId: string): RequestStats | null {
  const entry = snapshot.recent?.find((request) => request.id === completionId);
  if (!entry) return null;
  return {
    ttftMs: entry.ttft_ms,
    tokensIn: entry.tokens_in,
    tokensOut: entry.tokens_out,
    itlMs: Array.isArray(entry.itl_ms) ? entry.itl_ms : [],
    draftTokens: entry.draft_tokens ?? 0,
    acceptedTokens: entry.accepted_tokens ?? 0,
  };
}

export interface DraftAcceptance {
  drafted: number;
  kept: number;
  /** kept / drafted. */
  rate: number;
}

/** What speculative decoding drafted and the model kept; null when it drafted nothing. */
export function draftAcceptance(drafted: number | null | undefined, kept: number | null | undefined): DraftAcceptance | null {
  if (!drafted || drafted <= 0 || !Number.isFinite(drafted)) return null;
  const accepted = Math.min(drafted, Math.max(0, kept ?? 0));
  return { drafted, kept: accepted, rate: accepted / drafted };
}

/** "drafted 8 · kept 6 (75%)". */
export function formatDrafts(drafts: DraftAcceptance): string {
  return `drafted ${drafts.drafted} · kept ${drafts.kept} (${formatPercent(drafts.rate)})`;
}

/** Decode speed: tokens out over the summed inter-token gaps; null without latencies. */
export function tokensPerSecond(stats: RequestStats): number | null {
  const decodeMs = stats.itlMs.reduce((sum, ms) => sum + ms, 0);
  if (stats.itlMs.length === 0 || decodeMs <= 0) return null;
  return stats.tokensOut / (decodeMs / 1000);
}

export function formatMs(ms: number): string {
  return ms >= 100 ? ms.toFixed(0) : ms >= 10 ? ms.toFixed(1) : ms.toFixed(2);
}

export function formatRate(rate: number | null): string {
  return rate === null ? '—' : rate >= 100 ? rate.toFixed(0) : rate.toFixed(1);
}
