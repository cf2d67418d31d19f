// The download jobs as the UI sees them: the transport's subscription feeds `jobs`; actions
// go through the transport and show their answer at once. `onDone` hears each job that
// finishes (the models list refreshes then).

import { describeError, isUnsupported, type DownloadJob, type DownloadState, type Transport, type Unsubscribe } from '../transport/types';
import { newlyDone } from './progress';

export type DownloadAction = 'pause' | 'resume' | 'cancel';

export class DownloadsStore {
  jobs = $state<DownloadJob[]>([]);
  /** The server (or app) has no download routes: an older build. */
  unsupported = $state(false);
  /** The last failure, as a sentence. */
  error = $state<string | null>(null);
  /** Job ids with an action in flight (their buttons wait). */
  busy = $state<Record<string, boolean>>({});
  starting = $state(false);

  private states: Map<string, DownloadState> | null = null;

  constructor(private readonly onDone: (job: DownloadJob) => void = () => {}) {}

  /** Follows the transport's job list until the returned function is called. */
  subscribe(transport: Transport): Unsubscribe {
    this.states = null;
    this.unsupported = false;
    this.error = null;
    return transport.onDownloads(
      (jobs) => this.apply(jobs),
      (error) => {
        if (isUnsupported(error)) this.unsupported = true;
        else this.error = describeError(error);
      },
    );
  }

  /** A whole list: replaces the jobs, and tells `onDone` about those that just finished. */
  apply(jobs: DownloadJob[]): void {
    const finished = newlyDone(this.states, jobs);
    // eslint-disable-next-line svelte/prefer-svelte-reactivity -- bookkeeping, never rendered
    this.states = new Map(jobs.map((job) => [job.id, job.state]));
    this.jobs = jobs;
    this.unsupported = false;
    for (const job of finished) this.onDone(job);
  }

  /** One job, as an action answered it (newer than the last list). */
  upsert(job: DownloadJob): void {
    const index = this.jobs.findIndex((j) => j.id === job.id);
    const finished = job.state === 'done' && this.states?.get(job.id) !== 'done';
    this.jobs = index === -1 ? [job, ...this.jobs] : this.jobs.map((j) => (j.id === job.id ? job : j));
    // eslint-disable-next-line svelte/prefer-svelte-reactivity -- bookkeeping, never rendered
    this.states ??= new Map();
    this.states.set(job.id, job.state);
    if (finished) this.onDone(job);
  }

  async start(transport: Transport, repo: string, revision: string): Promise<boolean> {
    this.starting = true;
    try {
      this.upsert(await transport.startDownload(repo.trim(), revision.trim() || null));
      this.error = null;
      return true;
    } catch (error) {
      if (isUnsupported(error)) this.unsupported = true;
      else this.error = `Cannot start the download of ${repo.trim()}: ${describeError(error)}`;
      return false;
    } finally {
      this.starting = false;
    }
  }

  async act(transport: Transport, id: string, action: DownloadAction): Promise<void> {
    this.busy = { ...this.busy, [id]: true };
    try {
      const run = { pause: transport.pauseDownload, resume: transport.resumeDownload, cancel: transport.cancelDownload }[action];
      this.upsert(await run.call(transport, id));
      this.error = null;
    } catch (error) {
      this.error = `Cannot ${action} the download: ${describeError(error)}`;
    } finally {
      const { [id]: _done, ...rest } = this.busy;
      this.busy = rest;
    }
  }
}
