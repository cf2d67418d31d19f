import { beforeEach, describe, expect, it, vi } from 'vitest';
import type { ChatEvent } from './types';

// A stand-in for Tauri's IPC: `invoke` is scripted per test, and `Channel` keeps its handler so
// the test can play the Rust side.
const ipc = vi.hoisted(() => ({
  invoke: vi.fn<(command: string, args?: Record<string, unknown>) => Promise<unknown>>(),
  /** `listen` handlers by event name; `emit` plays the shell. */
  listeners: new Map<string, ((message: { event: string; payload: unknown }) => void)[]>(),
  unlistened: [] as string[],
}));

function emit(event: string, payload: unknown) {
  for (const handler of ipc.listeners.get(event) ?? []) handler({ event, payload });
}

vi.mock('@tauri-apps/api/event', () => ({
  listen: async (event: string, handler: (message: { event: string; payload: unknown }) => void) => {
    ipc.listeners.set(event, [...(ipc.listeners.get(event) ?? []), handler]);
    return async () => {
      ipc.listeners.set(event, (ipc.listeners.get(event) ?? []).filter((h) => h !== handler));
      ipc.unlistened.push(event);
    };
  },
}));

vi.mock('@tauri-apps/api/core', () => ({
  invoke: ipc.invoke,
  Channel: class<T> {
    onmessage: (message: T) => void = () => {};
  },
}));

const { TauriTransport } = await import('./tauri');

type FakeChannel = { onmessage: (event: ChatEvent) => void };
const request = { model: 'qwen3-tiny', messages: [{ role: 'user' as const, content: 'Hi' }] };

describe('TauriTransport', () => {
  beforeEach(() => {
    ipc.invoke.mockReset();
    ipc.listeners.clear();
    ipc.unlistened.length = 0;
  });

  it('streams a chat through chat_stream and its Channel', async () => {
    let channel: FakeChannel | undefined;
    ipc.invoke.mockImplementation(async (command, args) => {
      expect(command).toBe('chat_stream');
      expect(args?.request).toEqual(request);
      channel = args?.onEvent as FakeChannel;
      queueMicrotask(() => {
        channel!.onmessage({ kind: 'delta', text: 'Hel' });
        channel!.onmessage({ kind: 'delta', text: 'lo' });
        channel!.onmessage({ kind: 'done', id: 'req-1', usage: { prompt_tokens: 4, completion_tokens: 2, total_tokens: 6 }, finish_reason: 'stop' });
      });
      return 'req-1';
    });
    const events: ChatEvent[] = [];
    const outcome = await new TauriTransport().chat(request, { onEvent: (e) => events.push(e) });
    expect(outcome).toEqual({ status: 'done', id: 'req-1', usage: { prompt_tokens: 4, completion_tokens: 2, total_tokens: 6 }, finishReason: 'stop' });
    expect(events.map((e) => e.kind)).toEqual(['delta', 'delta', 'done']);
  });

  it('rejects on an error event with its code', async () => {
    ipc.invoke.mockImplementation(async (_command, args) => {
      queueMicrotask(() => (args?.onEvent as FakeChannel).onmessage({ kind: 'error', message: 'no vision', code: 'invalid_request' }));
      return 'req-2';
    });
    await expect(new TauriTransport().chat(request, { onEvent: () => {} })).rejects.toMatchObject({ message: 'no vision', code: 'invalid_request' });
  });

  it('rejects when the command itself fails', async () => {
    ipc.invoke.mockRejectedValue({ message: 'unknown model', code: 'model_not_found' });
    await expect(new TauriTransport().chat(request, { onEvent: () => {} })).rejects.toMatchObject({ code: 'model_not_found' });
  });

  it('cancels with chat_cancel, even when Stop comes before the id', async () => {
    let answer: (id: string) => void = () => {};
    ipc.invoke.mockImplementation((command) => {
      if (command === 'chat_stream') return new Promise((resolve) => (answer = resolve));
      return Promise.resolve(null);
    });
    const controller = new AbortController();
    const running = new TauriTransport().chat(request, { onEvent: () => {}, signal: controller.signal });
    controller.abort();
    await expect(running).resolves.toEqual({ status: 'cancelled', id: null });
    answer('req-3');
    await new Promise((resolve) => setTimeout(resolve, 0));
    expect(ipc.invoke).toHaveBeenCalledWith('chat_cancel', { id: 'req-3' });
  });

  it('lists models (with memory) through models_overview and reads metrics', async () => {
    const memory = { total_bytes: 64, available_bytes: 32 };
    ipc.invoke.mockImplementation(async (command) =>
      command === 'models_overview' ? { object: 'list', data: [{ id: 'm', fits: 'tight' }], memory } : { recent: [], in_flight: 0, queue_depth: 0 },
    );
    const transport = new TauriTransport();
    expect(await transport.listModels()).toEqual({ models: [{ id: 'm', fits: 'tight' }], memory });
    expect(await transport.metrics()).toEqual({ recent: [], in_flight: 0, queue_depth: 0 });
    expect(ipc.invoke.mock.calls.map((call) => call[0])).toEqual(['models_overview', 'metrics_snapshot']);
  });

  it('falls back to list_models on a shell without models_overview', async () => {
    ipc.invoke.mockImplementation(async (command) => {
      if (command === 'models_overview') throw 'command models_overview not found';
      return [{ id: 'm' }];
    });
    expect(await new TauriTransport().listModels()).toEqual({ models: [{ id: 'm' }], memory: null });
  });

  it('invokes the model and download commands with the contract arguments', async () => {
    const job = { id: 'dl-1', repo: 'org/name', revision: null, state: 'queued', bytes_done: 0, bytes_total: null, files: [], error: null, model_id: null };
    ipc.invoke.mockImplementation(async (command) => (command.startsWith('download') ? (command === 'downloads_list' ? [job] : job) : null));
    const t = new TauriTransport();
    await t.loadModel('org/name');
    await t.unloadModel('org/name');
    await t.deleteModel('org/name');
    expect(await t.startDownload('org/name')).toEqual(job);
    await t.startDownload('org/name', 'v2');
    expect(await t.listDownloads()).toEqual([job]);
    await t.pauseDownload('dl-1');
    await t.resumeDownload('dl-1');
    await t.cancelDownload('dl-1');
    expect(ipc.invoke.mock.calls).toEqual([
      ['model_load', { id: 'org/name' }],
      ['model_unload', { id: 'org/name' }],
      ['model_delete', { id: 'org/name' }],
      ['download_start', { repo: 'org/name', revision: null }],
      ['download_start', { repo: 'org/name', revision: 'v2' }],
      ['downloads_list', undefined],
      ['download_pause', { id: 'dl-1' }],
      ['download_resume', { id: 'dl-1' }],
      ['download_cancel', { id: 'dl-1' }],
    ]);
  });

  it('subscribes to downloads and metrics events after an initial snapshot, and unlistens', async () => {
    ipc.invoke.mockImplementation(async (command) => (command === 'downloads_list' ? [] : { recent: [], in_flight: 0, queue_depth: 0 }));
    const t = new TauriTransport();
    const jobs: unknown[][] = [];
    const snapshots: number[] = [];
    const stopJobs = t.onDownloads((list) => jobs.push(list));
    const stopMetrics = t.onMetrics((snapshot) => snapshots.push(snapshot.in_flight));
    await new Promise((resolve) => setTimeout(resolve, 0));
    expect(jobs).toEqual([[]]);
    expect(snapshots).toEqual([0]);
    emit('downloads', [{ id: 'dl-1' }]);
    emit('metrics', { recent: [], in_flight: 1, queue_depth: 0 });
    expect(jobs.at(-1)).toEqual([{ id: 'dl-1' }]);
    expect(snapshots).toEqual([0, 1]);
    stopJobs();
    stopMetrics();
    await new Promise((resolve) => setTimeout(resolve, 0));
    expect(ipc.unlistened.sort()).toEqual(['downloads', 'metrics']);
    emit('metrics', { recent: [], in_flight: 2, queue_depth: 0 });
    expect(snapshots).toEqual([0, 1]);
  });

  it('reports a failing initial snapshot to onError', async () => {
    ipc.invoke.mockRejectedValue('command downloads_list not found');
    const errors: string[] = [];
    new TauriTransport().onDownloads(() => {}, (e) => errors.push(e.message));
    await new Promise((resolve) => setTimeout(resolve, 0));
    expect(errors).toEqual(['command downloads_list not found']);
  });

  it('drives settings, the local server and the updater through their commands and events', async () => {
    const settings = {
      models_dir: '/m', hub_url: null, server_enabled: true, server_host: '127.0.0.1', server_port: 8080, api_key: null,
      cors_origins: [], default_max_context: null, launch_at_login: false, update_channel: 'stable',
    };
    ipc.invoke.mockImplementation(async (command, args) => {
      switch (command) {
        case 'settings_get': return settings;
        case 'settings_set': return args?.settings;
        case 'server_status': return { state: 'failed', message: 'port 8080 is in use; choose another port', port: 8080 };
        case 'server_set': return { state: 'on', url: 'http://127.0.0.1:8081' };
        case 'launch_at_login_set': return true;
        case 'update_check': return { version: '0.2.0', current_version: '0.1.0', notes: 'faster' };
        default: return null;
      }
    });
    const app = new TauriTransport().app;
    expect(await app.getSettings()).toEqual(settings);
    expect(await app.setSettings({ ...settings, update_channel: 'beta' })).toMatchObject({ update_channel: 'beta' });
    expect(await app.serverStatus()).toMatchObject({ state: 'failed', port: 8080 });
    expect(await app.setServer(true, 8081)).toEqual({ state: 'on', url: 'http://127.0.0.1:8081' });
    expect(await app.setLaunchAtLogin(true)).toBe(true);
    expect(await app.checkUpdate()).toEqual({ version: '0.2.0', current_version: '0.1.0', date: null, notes: 'faster' });
    await app.installUpdate();
    await app.restart();
    expect(ipc.invoke.mock.calls).toEqual([
      ['settings_get', undefined],
      ['settings_set', { settings: { ...settings, update_channel: 'beta' } }],
      ['server_status', undefined],
      ['server_set', { enabled: true, port: 8081 }],
      ['launch_at_login_set', { enabled: true }],
      ['update_check', undefined],
      ['update_install', undefined],
      ['app_restart', undefined],
    ]);
    ipc.invoke.mockResolvedValue(null);
    expect(await app.checkUpdate()).toBeNull();

    const statuses: unknown[] = [];
    const progress: unknown[] = [];
    app.onServerStatus((s) => statuses.push(s));
    app.onUpdateProgress((p) => progress.push(p));
    await new Promise((resolve) => setTimeout(resolve, 0));
    emit('server-status', { state: 'off' });
    emit('update-progress', { downloaded: 10, total: 100 });
    expect(statuses).toEqual([{ state: 'off' }]);
    expect(progress).toEqual([{ downloaded: 10, total: 100 }]);
  });
});
