import { beforeEach, describe, expect, it, vi } from 'vitest';
import type { ChatEvent } from './types';

// A stand-in for Tauri's IPC: `invoke` is scripted per test, and `Channel` keeps its handler so
// the test can play the Rust side.
const ipc = vi.hoisted(() => ({
  invoke: vi.fn<(command: string, args?: Record<string, unknown>) => Promise<unknown>>(),
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

  it('lists models and reads metrics through their commands', async () => {
    ipc.invoke.mockImplementation(async (command) =>
      command === 'list_models' ? { object: 'list', data: [{ id: 'm' }] } : { recent: [], in_flight: 0, queue_depth: 0 },
    );
    const transport = new TauriTransport();
    expect(await transport.listModels()).toEqual([{ id: 'm' }]);
    expect(await transport.metrics()).toEqual({ recent: [], in_flight: 0, queue_depth: 0 });
    expect(ipc.invoke.mock.calls.map((call) => call[0])).toEqual(['list_models', 'metrics_snapshot']);
  });
});
