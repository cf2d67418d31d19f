import { describe, expect, it } from 'vitest';
import { StubTransport } from '../transport/stub';
import { TransportError, type DownloadJob, type DownloadState } from '../transport/types';
import { DownloadsStore } from './downloads.svelte';
import { canCancel, canPause, canResume, fileProgress, jobProgress, newlyDone, repoError } from './progress';

const job = (state: DownloadState, done: number, total: number | null = 1000, id = 'dl-1'): DownloadJob => ({
  id, repo: 'org/name', revision: null, state, bytes_done: done, bytes_total: total,
  files: [
    { name: 'config.json', size: 200, bytes_done: Math.min(done, 200), state: done >= 200 ? 'done' : 'running' },
    { name: 'model.safetensors', size: 800, bytes_done: Math.max(0, done - 200), state: 'running' },
  ],
  error: null, model_id: state === 'done' ? 'org/name' : null,
});

describe('download progress', () => {
  it('computes job and file fractions', () => {
    expect(jobProgress(job('running', 250))).toEqual({ done: 250, total: 1000, fraction: 0.25 });
    expect(fileProgress(job('running', 250).files[1])).toEqual({ done: 50, total: 800, fraction: 0.0625 });
    expect(fileProgress(job('running', 250).files[0]).fraction).toBe(1);
  });

  it('sums file sizes when the total is not given, and is indeterminate without sizes', () => {
    expect(jobProgress(job('running', 500, null))).toEqual({ done: 500, total: 1000, fraction: 0.5 });
    const listing = { ...job('listing', 0, null), files: [] };
    expect(jobProgress(listing).fraction).toBeNull();
    expect(fileProgress({ name: 'x', size: null, bytes_done: 10, state: 'running' }).fraction).toBeNull();
  });

  it('clamps over-reported bytes and shows a done job full', () => {
    expect(jobProgress(job('running', 1200)).fraction).toBe(1);
    expect(jobProgress({ ...job('done', 990), bytes_total: 1000 }).fraction).toBe(1);
  });

  it('allows the actions each state has', () => {
    expect(['queued', 'listing', 'running', 'paused', 'verifying', 'done', 'failed', 'cancelled'].map((s) => {
      const state = s as DownloadState;
      return `${s}:${canPause(state) ? 'P' : ''}${canResume(state) ? 'R' : ''}${canCancel(state) ? 'C' : ''}`;
    })).toEqual(['queued:PC', 'listing:PC', 'running:PC', 'paused:RC', 'verifying:C', 'done:', 'failed:', 'cancelled:']);
  });

  it('finds the jobs that just finished, not those already done on the first list', () => {
    expect(newlyDone(null, [job('done', 1000)])).toEqual([]);
    expect(newlyDone(new Map([['dl-1', 'running']]), [job('done', 1000)]).map((j) => j.id)).toEqual(['dl-1']);
    expect(newlyDone(new Map([['dl-1', 'done']]), [job('done', 1000)])).toEqual([]);
    expect(newlyDone(new Map(), [job('done', 1000, 1000, 'dl-2')]).map((j) => j.id)).toEqual(['dl-2']);
  });

  it('checks repository ids', () => {
    expect(repoError('mlx-community/Qwen3-0.6B-4bit')).toBeNull();
    expect(repoError(' org/name ')).toBeNull();
    expect(repoError('')).toMatch(/Enter a repository/);
    for (const bad of ['name', 'a/b/c', '../x', 'org/..', 'org/na me']) expect(repoError(bad), bad).toMatch(/not a repository id/);
  });
});

class Jobs extends StubTransport {
  calls: string[] = [];
  fail = false;
  override async startDownload(repo: string, revision?: string | null) {
    this.calls.push(`start ${repo} ${revision}`);
    if (this.fail) throw new TransportError('no route for /admin/downloads', 'not_found', 404);
    return job('queued', 0);
  }
  override async pauseDownload(id: string) {
    this.calls.push(`pause ${id}`);
    return job('paused', 300);
  }
  override async resumeDownload(id: string) {
    this.calls.push(`resume ${id}`);
    return job('running', 300);
  }
  override async cancelDownload(id: string) {
    this.calls.push(`cancel ${id}`);
    if (this.fail) throw new TransportError('download dl-1 not found', 'not_found', 400);
    return job('cancelled', 300);
  }
}

describe('DownloadsStore', () => {
  it('goes queued -> running -> paused -> running -> done, and reports done once', async () => {
    const done: string[] = [];
    const store = new DownloadsStore((j) => done.push(j.model_id ?? ''));
    const transport = new Jobs();
    store.apply([]);
    expect(await store.start(transport, ' org/name ', '')).toBe(true);
    expect(store.jobs.map((j) => j.state)).toEqual(['queued']);
    store.apply([job('running', 100)]);
    await store.act(transport, 'dl-1', 'pause');
    expect(store.jobs[0].state).toBe('paused');
    await store.act(transport, 'dl-1', 'resume');
    expect(store.jobs[0].state).toBe('running');
    store.apply([job('verifying', 1000)]);
    store.apply([job('done', 1000)]);
    store.apply([job('done', 1000)]);
    expect(done).toEqual(['org/name']);
    expect(transport.calls).toEqual(['start org/name null', 'pause dl-1', 'resume dl-1']);
    expect(store.busy).toEqual({});
  });

  it('says when the server has no download support, and keeps other errors as text', async () => {
    const store = new DownloadsStore();
    const transport = new Jobs();
    transport.fail = true;
    expect(await store.start(transport, 'org/name', 'main')).toBe(false);
    expect(store.unsupported).toBe(true);
    await store.act(transport, 'dl-1', 'cancel');
    expect(store.error).toBe('Cannot cancel the download: download dl-1 not found (not_found)');
  });

  it('shows a failed job with its error', () => {
    const store = new DownloadsStore();
    store.apply([{ ...job('failed', 300), error: 'sha256 mismatch for model.safetensors' }]);
    expect(store.jobs[0]).toMatchObject({ state: 'failed', error: 'sha256 mismatch for model.safetensors' });
  });
});
