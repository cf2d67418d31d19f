// Tauri v2 IPC transport: commands for requests, a Channel for the streamed events. The Rust
// shell implements these commands (documented in ui/README.md) on the same engine API as the
// server, so requests and metrics have the server's shapes.

import { Channel, invoke } from '@tauri-apps/api/core';
import { listen, type UnlistenFn } from '@tauri-apps/api/event';
import {
  TransportError,
  isUnsupported,
  type AppConfig,
  type AppControl,
  type ChatEvent,
  type ChatOptions,
  type ChatOutcome,
  type ChatRequest,
  type DownloadJob,
  type ErrorListener,
  type MemoryInfo,
  type MetricsSnapshot,
  type ModelCatalog,
  type ModelInfo,
  type ServerStatus,
  type Transport,
  type Unsubscribe,
  type UpdateInfo,
  type UpdateProgress,
} from './types';

/** Event names the shell emits (docs/MODELS-API.md). */
export const EVENTS = {
  downloads: 'downloads',
  metrics: 'metrics',
  serverStatus: 'server-status',
  updateProgress: 'update-progress',
} as const;

type ModelsAnswer = ModelInfo[] | { data?: ModelInfo[]; memory?: MemoryInfo | null } | null;

function toCatalog(answer: ModelsAnswer): ModelCatalog {
  if (Array.isArray(answer)) return { models: answer, memory: null };
  return { models: Array.isArray(answer?.data) ? answer.data : [], memory: answer?.memory ?? null };
}

function toJobs(answer: DownloadJob[] | { data?: DownloadJob[] } | null): DownloadJob[] {
  if (Array.isArray(answer)) return answer;
  return Array.isArray(answer?.data) ? answer.data : [];
}

/**
 * Listens to a shell event; the returned function stops listening, also when called before
 * `listen` has answered. `initial` (a command's answer) is delivered unless an event came first.
 */
function subscribe<T>(event: string, listener: (payload: T) => void, initial?: () => Promise<T>, onError?: ErrorListener): Unsubscribe {
  let stopped = false;
  let heard = false;
  let unlisten: UnlistenFn | null = null;
  listen<T>(event, (message) => {
    if (stopped) return;
    heard = true;
    listener(message.payload);
  }).then(
    (stop) => {
      if (stopped) void stop();
      else unlisten = stop;
    },
    (error: unknown) => onError?.(toTransportError(error)),
  );
  initial?.().then(
    (value) => {
      if (!stopped && !heard) listener(value);
    },
    (error: unknown) => {
      if (!stopped) onError?.(toTransportError(error));
    },
  );
  return () => {
    stopped = true;
    if (unlisten) void unlisten();
    unlisten = null;
  };
}

/** The shell's settings, local server and updater. */
class TauriAppControl implements AppControl {
  getSettings(): Promise<AppConfig> {
    return call<AppConfig>('settings_get');
  }

  async setSettings(settings: AppConfig): Promise<AppConfig> {
    const saved = await call<AppConfig | null>('settings_set', { settings });
    return saved ?? settings;
  }

  serverStatus(): Promise<ServerStatus> {
    return call<ServerStatus>('server_status');
  }

  setServer(enabled: boolean, port: number | null): Promise<ServerStatus> {
    return call<ServerStatus>('server_set', { enabled, port });
  }

  setLaunchAtLogin(enabled: boolean): Promise<boolean> {
    return call<boolean>('launch_at_login_set', { enabled });
  }

  async checkUpdate(): Promise<UpdateInfo | null> {
    const answer = await call<(Partial<UpdateInfo> & { available?: boolean }) | null>('update_check');
    if (!answer || answer.available === false || !answer.version) return null;
    return {
      version: answer.version,
      current_version: answer.current_version ?? null,
      date: answer.date ?? null,
      notes: answer.notes ?? null,
    };
  }

  async installUpdate(): Promise<void> {
    await call('update_install');
  }

  async restart(): Promise<void> {
    await call('app_restart');
  }

  onServerStatus(listener: (status: ServerStatus) => void): Unsubscribe {
    return subscribe(EVENTS.serverStatus, listener);
  }

  onUpdateProgress(listener: (progress: UpdateProgress) => void): Unsubscribe {
    return subscribe(EVENTS.updateProgress, listener);
  }
}

/** Commands reject with whatever the Rust error serialises to: a string or `{message, code}`. */
export function toTransportError(error: unknown): TransportError {
  if (error instanceof TransportError) return error;
  if (typeof error === 'string') return new TransportError(error, 'ipc');
  if (error && typeof error === 'object') {
    const { message, code } = error as { message?: unknown; code?: unknown };
    if (typeof message === 'string') {
      return new TransportError(message, typeof code === 'string' ? code : 'ipc');
    }
  }
  return new TransportError(String(error), 'ipc');
}

async function call<T>(command: string, args?: Record<string, unknown>): Promise<T> {
  try {
    return await invoke<T>(command, args);
  } catch (error) {
    throw toTransportError(error);
  }
}

export class TauriTransport implements Transport {
  readonly kind = 'tauri' as const;

  readonly app: AppControl = new TauriAppControl();

  /** `models_overview` (`{data, memory}`); a shell without it answers through `list_models` (no memory). */
  async listModels(): Promise<ModelCatalog> {
    try {
      return toCatalog(await call<ModelsAnswer>('models_overview'));
    } catch (error) {
      if (!isUnsupported(error)) throw error;
      return toCatalog(await call<ModelsAnswer>('list_models'));
    }
  }

  async loadModel(id: string): Promise<void> {
    await call('model_load', { id });
  }

  async unloadModel(id: string): Promise<void> {
    await call('model_unload', { id });
  }

  async deleteModel(id: string): Promise<void> {
    await call('model_delete', { id });
  }

  metrics(): Promise<MetricsSnapshot> {
    return call<MetricsSnapshot>('metrics_snapshot');
  }

  async clearDiskCache(): Promise<number> {
    const cleared = await call<{ freed_bytes: number }>('disk_cache_clear');
    return cleared.freed_bytes;
  }

  startDownload(repo: string, revision?: string | null): Promise<DownloadJob> {
    return call<DownloadJob>('download_start', { repo, revision: revision || null });
  }

  async listDownloads(): Promise<DownloadJob[]> {
    return toJobs(await call<DownloadJob[] | { data?: DownloadJob[] }>('downloads_list'));
  }

  pauseDownload(id: string): Promise<DownloadJob> {
    return call<DownloadJob>('download_pause', { id });
  }

  resumeDownload(id: string): Promise<DownloadJob> {
    return call<DownloadJob>('download_resume', { id });
  }

  cancelDownload(id: string): Promise<DownloadJob> {
    return call<DownloadJob>('download_cancel', { id });
  }

  /** `downloads_list` now, then every `downloads` event (the job list, on every change). */
  onDownloads(listener: (jobs: DownloadJob[]) => void, onError?: ErrorListener): Unsubscribe {
    return subscribe<DownloadJob[] | { data?: DownloadJob[] }>(EVENTS.downloads, (jobs) => listener(toJobs(jobs)), () => this.listDownloads(), onError);
  }

  /** `metrics_snapshot` now, then every `metrics` event (the shell sends one every 500 ms while the window is visible). */
  onMetrics(listener: (snapshot: MetricsSnapshot) => void, onError?: ErrorListener): Unsubscribe {
    return subscribe<MetricsSnapshot>(EVENTS.metrics, listener, () => this.metrics(), onError);
  }

  chat(request: ChatRequest, { onEvent, signal }: ChatOptions): Promise<ChatOutcome> {
    return new Promise<ChatOutcome>((resolve, reject) => {
      let requestId: string | null = null;
      let settled = false;
      let cancelling = false;

      const settle = (finish: () => void) => {
        if (settled) return;
        settled = true;
        signal?.removeEventListener('abort', cancel);
        finish();
      };
      const sendCancel = (id: string) => {
        // Best effort: the generation may have finished in the meantime.
        invoke('chat_cancel', { id }).catch(() => undefined);
      };
      // Resolve at once, like an aborted fetch; events the engine still sends are ignored.
      function cancel() {
        cancelling = true;
        if (requestId !== null) sendCancel(requestId);
        settle(() => resolve({ status: 'cancelled', id: requestId }));
      }

      const channel = new Channel<ChatEvent>();
      channel.onmessage = (event) => {
        if (settled) return;
        onEvent(event);
        if (event.kind === 'done') {
          settle(() =>
            resolve({ status: 'done', id: event.id, usage: event.usage ?? null, finishReason: event.finish_reason ?? null }),
          );
        } else if (event.kind === 'error') {
          settle(() => reject(new TransportError(event.message, event.code ?? null)));
        }
      };

      if (signal?.aborted) {
        settle(() => resolve({ status: 'cancelled', id: null }));
        return;
      }
      signal?.addEventListener('abort', cancel);

      invoke<string>('chat_stream', { request, onEvent: channel }).then(
        (id) => {
          requestId = id;
          // Stop was pressed before the command answered: the engine still needs to hear it.
          if (cancelling) sendCancel(id);
        },
        (error: unknown) => {
          const failure = toTransportError(error);
          if (!settled) onEvent({ kind: 'error', message: failure.message, code: failure.code });
          settle(() => reject(failure));
        },
      );
    });
  }
}
