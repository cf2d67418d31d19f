// HTTP + SSE transport to `rmlx serve`: the OpenAI chat route, streamed, plus the model list and
// the engine's metrics. Same origin by default (the server hosts the UI with `--ui-dir`).

import { poll, type Poller } from './poll';
import { SseParser } from './sse';
import {
  TransportError,
  isUnsupported,
  type ChatOptions,
  type ChatOutcome,
  type ChatRequest,
  type DownloadJob,
  type ErrorListener,
  type MemoryInfo,
  type MetricsSnapshot,
  type ModelCatalog,
  type ModelInfo,
  type Transport,
  type Unsubscribe,
  type Usage,
} from './types';

/** How often the browser polls: metrics while the page is visible, downloads while a job is active (else slowly). */
export const POLL_MS = { metrics: 500, downloadsActive: 500, downloadsIdle: 5000 };

const activeStates = new Set(['queued', 'listing', 'running', 'verifying']);

export interface HttpTransportOptions {
  /** e.g. `http://127.0.0.1:8080`; empty means the page's own origin. */
  baseUrl?: string;
  /** Sent as `Authorization: Bearer` when the server runs with `--api-key`. */
  apiKey?: string;
  /** Injected in tests. */
  fetch?: typeof fetch;
}

interface OpenAiErrorBody {
  error?: { message?: string; type?: string; code?: string | null };
}

interface ChatChunk extends OpenAiErrorBody {
  id?: string;
  choices?: {
    delta?: { content?: string | null; reasoning_content?: string | null };
    finish_reason?: string | null;
  }[];
  usage?: Usage | null;
}

function errorFromBody(body: OpenAiErrorBody, status: number | null): TransportError | null {
  if (!body.error || typeof body.error !== 'object') return null;
  const { message, type, code } = body.error;
  return new TransportError(message || 'the server reported an error', code ?? type ?? null, status);
}

function isAbort(error: unknown): boolean {
  return error instanceof DOMException
    ? error.name === 'AbortError'
    : (error as { name?: string } | null)?.name === 'AbortError';
}

async function drain(reader: ReadableStreamDefaultReader<Uint8Array>): Promise<void> {
  try {
    while (!(await reader.read()).done) {
      // nothing follows [DONE] that matters
    }
  } catch {
    // the connection went away: nothing left to read
  }
}

export class HttpTransport implements Transport {
  readonly kind = 'http' as const;
  private readonly baseUrl: string;
  private readonly apiKey: string;
  private readonly fetchImpl: typeof fetch;
  readonly app = null;
  /** Download pollers, kicked after an action so the list follows at once. */
  private readonly downloadPollers = new Set<Poller>();

  constructor(options: HttpTransportOptions = {}) {
    this.baseUrl = (options.baseUrl ?? '').replace(/\/+$/, '');
    this.apiKey = options.apiKey ?? '';
    // Bound: calling a detached `window.fetch` throws "Illegal invocation".
    this.fetchImpl = options.fetch ?? ((input, init) => globalThis.fetch(input, init));
  }

  private headers(json: boolean): Record<string, string> {
    const headers: Record<string, string> = {};
    if (json) headers['content-type'] = 'application/json';
    if (this.apiKey) headers.authorization = `Bearer ${this.apiKey}`;
    return headers;
  }

  private async request(path: string, init: RequestInit): Promise<Response> {
    let response: Response;
    try {
      response = await this.fetchImpl(`${this.baseUrl}${path}`, init);
    } catch (error) {
      if (isAbort(error)) throw error;
      throw new TransportError(`cannot reach the server (${String(error)})`, 'network');
    }
    if (!response.ok) throw await this.httpError(response);
    return response;
  }

  /** A non-2xx answer: the server's JSON error when there is one, else the status line. */
  private async httpError(response: Response): Promise<TransportError> {
    const text = await response.text().catch(() => '');
    try {
      const fromBody = errorFromBody(JSON.parse(text) as OpenAiErrorBody, response.status);
      if (fromBody) return fromBody;
    } catch {
      // not JSON: fall through to the status line
    }
    const detail = text.trim().slice(0, 200) || response.statusText || 'request failed';
    return new TransportError(`HTTP ${response.status}: ${detail}`, `http_${response.status}`, response.status);
  }

  private async getJson<T>(path: string): Promise<T> {
    const response = await this.request(path, { headers: this.headers(false) });
    try {
      return (await response.json()) as T;
    } catch {
      throw new TransportError(`${path} did not answer JSON`, 'bad_response', response.status);
    }
  }

  private async sendJson<T>(method: string, path: string, body?: unknown): Promise<T> {
    const response = await this.request(path, {
      method,
      headers: this.headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text().catch(() => '');
    if (!text.trim()) return null as T;
    try {
      return JSON.parse(text) as T;
    } catch {
      throw new TransportError(`${method} ${path} did not answer JSON`, 'bad_response', response.status);
    }
  }

  async listModels(): Promise<ModelCatalog> {
    const list = await this.getJson<{ data?: ModelInfo[]; memory?: MemoryInfo | null }>('/v1/models');
    return { models: Array.isArray(list.data) ? list.data : [], memory: list.memory ?? null };
  }

  async loadModel(id: string): Promise<void> {
    await this.sendJson('POST', `/v1/models/${encodeURIComponent(id)}/load`);
  }

  async unloadModel(id: string): Promise<void> {
    await this.sendJson('POST', `/v1/models/${encodeURIComponent(id)}/unload`);
  }

  async deleteModel(id: string): Promise<void> {
    await this.sendJson('DELETE', `/v1/models/${encodeURIComponent(id)}`);
  }

  async metrics(): Promise<MetricsSnapshot> {
    return this.getJson<MetricsSnapshot>('/metrics/cache');
  }

  async clearDiskCache(): Promise<number> {
    const cleared = await this.sendJson<{ freed_bytes: number }>('DELETE', '/admin/cache/disk');
    return cleared.freed_bytes;
  }

  private async downloadAction(method: string, path: string, body?: unknown): Promise<DownloadJob> {
    try {
      return await this.sendJson<DownloadJob>(method, path, body);
    } finally {
      for (const poller of this.downloadPollers) poller.kick();
    }
  }

  startDownload(repo: string, revision?: string | null): Promise<DownloadJob> {
    return this.downloadAction('POST', '/admin/downloads', revision ? { repo, revision } : { repo });
  }

  async listDownloads(): Promise<DownloadJob[]> {
    const list = await this.getJson<{ data?: DownloadJob[] } | DownloadJob[]>('/admin/downloads');
    if (Array.isArray(list)) return list;
    return Array.isArray(list?.data) ? list.data : [];
  }

  pauseDownload(id: string): Promise<DownloadJob> {
    return this.downloadAction('POST', `/admin/downloads/${encodeURIComponent(id)}/pause`);
  }

  resumeDownload(id: string): Promise<DownloadJob> {
    return this.downloadAction('POST', `/admin/downloads/${encodeURIComponent(id)}/resume`);
  }

  cancelDownload(id: string): Promise<DownloadJob> {
    return this.downloadAction('DELETE', `/admin/downloads/${encodeURIComponent(id)}`);
  }

  /** Polls `/admin/downloads`: every 500 ms while a job is active, every 5 s otherwise; stops on a 404 (no such route). */
  onDownloads(listener: (jobs: DownloadJob[]) => void, onError?: ErrorListener): Unsubscribe {
    const poller = poll<DownloadJob[]>({
      fetch: () => this.listDownloads(),
      onValue: listener,
      onError,
      delay: (last) => {
        if ('error' in last) return isUnsupported(last.error) ? null : POLL_MS.downloadsIdle;
        return last.value.some((job) => activeStates.has(job.state)) ? POLL_MS.downloadsActive : POLL_MS.downloadsIdle;
      },
    });
    this.downloadPollers.add(poller);
    return () => {
      poller.stop();
      this.downloadPollers.delete(poller);
    };
  }

  /** Polls `/metrics/cache` every 500 ms while the page is visible (errors slow it to 2 s). */
  onMetrics(listener: (snapshot: MetricsSnapshot) => void, onError?: ErrorListener): Unsubscribe {
    const poller = poll<MetricsSnapshot>({
      fetch: () => this.metrics(),
      onValue: listener,
      onError,
      delay: (last) => ('error' in last ? 4 * POLL_MS.metrics : POLL_MS.metrics),
      whileVisible: true,
    });
    return poller.stop;
  }

  async chat(request: ChatRequest, options: ChatOptions): Promise<ChatOutcome> {
    const { onEvent, signal } = options;
    const body = { ...request, stream: true, stream_options: { include_usage: true } };
    // An object, not `let`s: TypeScript does not see assignments made inside `apply`.
    const seen = { id: null as string | null, usage: null as Usage | null, finishReason: null as string | null };
    let finished = false;

    /** Applies one SSE event; true once `[DONE]` arrived. */
    const apply = (data: string): boolean => {
      if (data === '[DONE]') return true;
      let chunk: ChatChunk;
      try {
        chunk = JSON.parse(data) as ChatChunk;
      } catch {
        throw new TransportError(`malformed stream chunk: ${data.slice(0, 120)}`, 'bad_response');
      }
      const failure = errorFromBody(chunk, null);
      if (failure) throw failure;
      if (chunk.id) seen.id = chunk.id;
      if (chunk.usage) seen.usage = chunk.usage;
      for (const choice of chunk.choices ?? []) {
        const delta = choice.delta ?? {};
        if (delta.reasoning_content) onEvent({ kind: 'reasoning', text: delta.reasoning_content });
        if (delta.content) onEvent({ kind: 'delta', text: delta.content });
        if (choice.finish_reason) seen.finishReason = choice.finish_reason;
      }
      return false;
    };

    try {
      const response = await this.request('/v1/chat/completions', {
        method: 'POST',
        headers: { ...this.headers(true), accept: 'text/event-stream' },
        body: JSON.stringify(body),
        signal,
      });
      if (!response.body) throw new TransportError('the response has no body', 'bad_response', response.status);
      const reader = response.body.getReader();
      const parser = new SseParser();
      read: for (;;) {
        const { done, value } = await reader.read();
        const events = done ? parser.end() : parser.push(value);
        for (const event of events) {
          if (event.event === 'error') {
            // Not what the OpenAI route sends, but a named error event must never pass as text.
            let parsed: OpenAiErrorBody = {};
            try {
              parsed = JSON.parse(event.data) as OpenAiErrorBody;
            } catch {
              parsed = { error: { message: event.data } };
            }
            throw errorFromBody(parsed, null) ?? new TransportError(event.data, 'stream_error');
          }
          if (apply(event.data)) {
            finished = true;
            break read;
          }
        }
        if (done) break;
      }
      // The server closes right after [DONE]; read that close in the background rather than
      // cancelling, which would abort the request (and lose its body in the browser's dev tools).
      if (finished) void drain(reader);
    } catch (error) {
      if (isAbort(error) || signal?.aborted) return { status: 'cancelled', id: seen.id };
      const failure =
        error instanceof TransportError
          ? error
          : new TransportError(`the stream broke: ${String(error)}`, 'network');
      onEvent({ kind: 'error', message: failure.message, code: failure.code });
      throw failure;
    }
    const { id, usage, finishReason } = seen;
    if (!finished || id === null) {
      const failure = finished
        ? new TransportError('the stream carried no completion id', 'bad_response')
        : new TransportError('the stream ended before [DONE]', 'incomplete_stream');
      onEvent({ kind: 'error', message: failure.message, code: failure.code });
      throw failure;
    }
    onEvent({ kind: 'done', id, usage, finish_reason: finishReason });
    return { status: 'done', id, usage, finishReason };
  }
}
