// Download job arithmetic: progress fractions, which actions a state allows, what changed.

import type { DownloadFile, DownloadJob, DownloadState } from '../transport/types';

export const ACTIVE_STATES: readonly DownloadState[] = ['queued', 'listing', 'running', 'verifying'];
export const FINISHED_STATES: readonly DownloadState[] = ['done', 'failed', 'cancelled'];

export const STATE_LABELS: Record<DownloadState, string> = {
  queued: 'Queued',
  listing: 'Listing files',
  running: 'Downloading',
  paused: 'Paused',
  verifying: 'Verifying',
  done: 'Done',
  failed: 'Failed',
  cancelled: 'Cancelled',
};

export interface Progress {
  done: number;
  /** null while the size is not known yet (listing). */
  total: number | null;
  /** 0..1, or null when the total is unknown (an indeterminate bar). */
  fraction: number | null;
}

function progress(done: number, total: number | null | undefined): Progress {
  const safeDone = Number.isFinite(done) ? Math.max(0, done) : 0;
  if (total === null || total === undefined || !Number.isFinite(total) || total <= 0) {
    return { done: safeDone, total: total === 0 ? 0 : null, fraction: total === 0 ? 1 : null };
  }
  return { done: safeDone, total, fraction: Math.min(1, safeDone / total) };
}

/** A job's total: `bytes_total`, else the sum of its files' sizes once they are all known. */
export function jobProgress(job: DownloadJob): Progress {
  if (job.state === 'done') {
    const total = job.bytes_total ?? job.bytes_done;
    return { done: total, total, fraction: 1 };
  }
  let total = job.bytes_total;
  if ((total === null || total === undefined || total <= 0) && job.files.length > 0 && job.files.every((f) => typeof f.size === 'number')) {
    total = job.files.reduce((sum, f) => sum + (f.size ?? 0), 0);
  }
  const done = job.bytes_done ?? job.files.reduce((sum, f) => sum + f.bytes_done, 0);
  return progress(done, total);
}

export function fileProgress(file: DownloadFile): Progress {
  if (file.state === 'done' && typeof file.size === 'number') return { done: file.size, total: file.size, fraction: 1 };
  return progress(file.bytes_done, file.size);
}

export const isActive = (state: DownloadState) => ACTIVE_STATES.includes(state);
export const canPause = (state: DownloadState) => state === 'queued' || state === 'listing' || state === 'running';
export const canResume = (state: DownloadState) => state === 'paused';
export const canCancel = (state: DownloadState) => !FINISHED_STATES.includes(state);

/** Jobs that became `done` between two lists (a job first seen already done does not count on the first list). */
export function newlyDone(previous: Map<string, DownloadState> | null, jobs: DownloadJob[]): DownloadJob[] {
  if (previous === null) return [];
  return jobs.filter((job) => job.state === 'done' && previous.get(job.id) !== 'done');
}

/** `org/name`, each part `[A-Za-z0-9._-]`, not `.` or `..` (docs/MODELS-API.md). */
export function repoError(repo: string): string | null {
  const trimmed = repo.trim();
  if (!trimmed) return 'Enter a repository id like mlx-community/Qwen3-0.6B-4bit.';
  const parts = trimmed.split('/');
  if (parts.length !== 2 || parts.some((p) => !/^[A-Za-z0-9._-]+$/.test(p) || p === '.' || p === '..')) {
    return `“${trimmed}” is not a repository id: use org/name (letters, digits, . _ -).`;
  }
  return null;
}
