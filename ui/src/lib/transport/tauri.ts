// Tauri v2 IPC transport: commands for requests, a Channel for the streamed events. The Rust
// shell implements these commands (documented in ui/README.md) on the same engine API as the
// server, so requests and metrics have the server's shapes.

import { Channel, invoke } from '@tauri-apps/api/core';
import {
  TransportError,
  type ChatEvent,
  type ChatOptions,
  type ChatOutcome,
  type ChatRequest,
  type MetricsSnapshot,
  type ModelInfo,
  type Transport,
} from './types';

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

  async listModels(): Promise<ModelInfo[]> {
    // Accept the server's `{data: [...]}` list as well as a bare array.
    const list = await call<ModelInfo[] | { data?: ModelInfo[] }>('list_models');
    if (Array.isArray(list)) return list;
    return Array.isArray(list?.data) ? list.data : [];
  }

  metrics(): Promise<MetricsSnapshot> {
    return call<MetricsSnapshot>('metrics_snapshot');
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
