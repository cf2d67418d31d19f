import { afterEach, describe, expect, it, vi } from 'vitest';
import { HttpTransport, POLL_MS } from './http';
import { TransportError, isUnsupported, type ChatEvent, type DownloadJob } from './types';

const encoder = new TextEncoder();

function chunk(delta: object, extra: object = {}): string {
  return `data: ${JSON.stringify({ id: 'chatcmpl-abc', object: 'chat.completion.chunk', choices: [{ index: 0, delta, finish_reason: null }], ...extra })}\n\n`;
}

const finished =
  chunk({ role: 'assistant', content: '' }) +
  chunk({ content: 'Hel' }) +
  chunk({ content: 'lo' }) +
  `data: ${JSON.stringify({ id: 'chatcmpl-abc', choices: [{ index: 0, delta: {}, finish_reason: 'stop' }], timings: { ttft_ms: 3 } })}\n\n` +
  `data: ${JSON.stringify({ id: 'chatcmpl-abc', choices: [], usage: { prompt_tokens: 9, completion_tokens: 2, total_tokens: 11 } })}\n\n` +
  'data: [DONE]\n\n';

/** A streaming response whose body arrives in pieces of `size` bytes. */
function sseResponse(text: string, size = 7, status = 200): Response {
  const bytes = encoder.encode(text);
  const body = new ReadableStream<Uint8Array>({
    start(controller) {
      for (let i = 0; i < bytes.length; i += size) controller.enqueue(bytes.slice(i, i + size));
      controller.close();
    },
  });
  return new Response(body, { status, headers: { 'content-type': 'text/event-stream' } });
}

function transportWith(response: Response | (() => Promise<Response>), options = {}) {
  const fetch = vi.fn<(url: string, init?: RequestInit) => Promise<Response>>(typeof response === 'function' ? response : async () => response);
  return { transport: new HttpTransport({ fetch: fetch as unknown as typeof globalThis.fetch, ...options }), fetch };
}

const request = { model: 'qwen3-tiny', messages: [{ role: 'user' as const, content: 'Hi' }], temperature: 0 };

describe('HttpTransport.chat', () => {
  it('streams deltas and finishes with the id, usage and finish reason', async () => {
    const { transport, fetch } = transportWith(sseResponse(finished), { baseUrl: 'http://127.0.0.1:8080/', apiKey: 'k' });
    const events: ChatEvent[] = [];
    const outcome = await transport.chat(request, { onEvent: (e) => events.push(e) });

    expect(outcome).toEqual({
      status: 'done',
      id: 'chatcmpl-abc',
      usage: { prompt_tokens: 9, completion_tokens: 2, total_tokens: 11 },
      finishReason: 'stop',
    });
    expect(events.filter((e) => e.kind === 'delta').map((e) => (e as { text: string }).text).join('')).toBe('Hello');
    expect(events.at(-1)).toMatchObject({ kind: 'done', id: 'chatcmpl-abc', finish_reason: 'stop' });

    const [url, init] = fetch.mock.calls[0] as [string, RequestInit];
    expect(url).toBe('http://127.0.0.1:8080/v1/chat/completions');
    expect(init.method).toBe('POST');
    expect((init.headers as Record<string, string>).authorization).toBe('Bearer k');
    expect(JSON.parse(init.body as string)).toEqual({ ...request, stream: true, stream_options: { include_usage: true } });
  });

  it('reports reasoning apart from the answer', async () => {
    const text = chunk({ reasoning_content: 'plan' }) + chunk({ content: 'ok' }) + 'data: [DONE]\n\n';
    const { transport } = transportWith(sseResponse(text, 5));
    const events: ChatEvent[] = [];
    await transport.chat(request, { onEvent: (e) => events.push(e) });
    expect(events.slice(0, 2)).toEqual([
      { kind: 'reasoning', text: 'plan' },
      { kind: 'delta', text: 'ok' },
    ]);
  });

  it('turns a mid-stream error chunk into a TransportError and an error event', async () => {
    const text = chunk({ content: 'par' }) + `data: ${JSON.stringify({ error: { message: 'engine failed', type: 'server_error', code: null } })}\n\n`;
    const { transport } = transportWith(sseResponse(text, 3));
    const events: ChatEvent[] = [];
    const failure = await transport.chat(request, { onEvent: (e) => events.push(e) }).catch((e: unknown) => e);
    expect(failure).toBeInstanceOf(TransportError);
    expect(failure).toMatchObject({ message: 'engine failed', code: 'server_error' });
    expect(events.at(-1)).toEqual({ kind: 'error', message: 'engine failed', code: 'server_error' });
  });

  it('turns a named `event: error` into a TransportError', async () => {
    const text = `event: error\ndata: ${JSON.stringify({ type: 'error', error: { type: 'api_error', message: 'boom' } })}\n\n`;
    const { transport } = transportWith(sseResponse(text));
    await expect(transport.chat(request, { onEvent: () => {} })).rejects.toMatchObject({ message: 'boom', code: 'api_error' });
  });

  it('maps a non-200 JSON error to its code and status', async () => {
    const body = { error: { message: 'prompt is 5000 tokens', type: 'invalid_request_error', param: null, code: 'context_length_exceeded' } };
    const { transport } = transportWith(new Response(JSON.stringify(body), { status: 400, headers: { 'content-type': 'application/json' } }));
    const failure = (await transport.chat(request, { onEvent: () => {} }).catch((e: unknown) => e)) as TransportError;
    expect(failure).toBeInstanceOf(TransportError);
    expect([failure.status, failure.code, failure.message]).toEqual([400, 'context_length_exceeded', 'prompt is 5000 tokens']);
  });

  it('falls back to the status line when the error body is not JSON', async () => {
    const { transport } = transportWith(new Response('upstream down', { status: 502, statusText: 'Bad Gateway' }));
    await expect(transport.chat(request, { onEvent: () => {} })).rejects.toMatchObject({ status: 502, code: 'http_502', message: 'HTTP 502: upstream down' });
  });

  it('reports a stream that ends before [DONE]', async () => {
    const { transport } = transportWith(sseResponse(chunk({ content: 'cut' })));
    await expect(transport.chat(request, { onEvent: () => {} })).rejects.toMatchObject({ code: 'incomplete_stream' });
  });

  it('reports malformed chunks', async () => {
    const { transport } = transportWith(sseResponse('data: {not json\n\n'));
    await expect(transport.chat(request, { onEvent: () => {} })).rejects.toMatchObject({ code: 'bad_response' });
  });

  it('reports an unreachable server as a network error', async () => {
    const { transport } = transportWith(() => Promise.reject(new TypeError('Failed to fetch')));
    await expect(transport.chat(request, { onEvent: () => {} })).rejects.toMatchObject({ code: 'network' });
  });

  it('cancels through the AbortSignal and keeps the id seen so far', async () => {
    const controller = new AbortController();
    // A body that sends one chunk and then waits until the request is aborted.
    const fetch = vi.fn(async (_url: string, init: RequestInit) => {
      const body = new ReadableStream<Uint8Array>({
        start(stream) {
          stream.enqueue(encoder.encode(chunk({ content: 'Hi' })));
          init.signal?.addEventListener('abort', () => stream.error(new DOMException('aborted', 'AbortError')));
        },
      });
      return new Response(body, { status: 200 });
    });
    const transport = new HttpTransport({ fetch: fetch as unknown as typeof globalThis.fetch });
    const events: ChatEvent[] = [];
    const running = transport.chat(request, {
      signal: controller.signal,
      onEvent: (e) => {
        events.push(e);
        if (e.kind === 'delta') controller.abort();
      },
    });
    await expect(running).resolves.toEqual({ status: 'cancelled', id: 'chatcmpl-abc' });
    expect(events).toEqual([{ kind: 'delta', text: 'Hi' }]);
    expect((fetch.mock.calls[0][1] as RequestInit).signal).toBe(controller.signal);
  });
});

describe('HttpTransport models and metrics', () => {
  it('lists models from GET /v1/models', async () => {
    const list = { object: 'list', data: [{ id: 'qwen3-tiny', vision: false, loaded: true }] };
    const { transport, fetch } = transportWith(new Response(JSON.stringify(list)));
    expect(await transport.listModels()).toEqual({ models: list.data, memory: null });
    expect(fetch.mock.calls[0][0]).toBe('/v1/models');
  });

  it('reads the model manager fields and memory of GET /v1/models', async () => {
    const entry = {
      id: 'mlx-community/Qwen3-0.6B-4bit', object: 'model', loaded: false, vision: false, context_length: 40960,
      size_bytes: 351_000_000, model_type: 'qwen3', quantization: { bits: 4, group_size: 64, mode: 'affine' },
      source: 'models_dir', deletable: true, fits: 'yes',
    };
    const list = { object: 'list', data: [entry], memory: { total_bytes: 34_359_738_368, available_bytes: 20_000_000_000 } };
    const { transport } = transportWith(new Response(JSON.stringify(list)));
    expect(await transport.listModels()).toEqual({ models: [entry], memory: list.memory });
  });

  it('reads GET /metrics/cache', async () => {
    const snapshot = { recent: [{ id: 'chatcmpl-1', model: 'm', ttft_ms: 1, tokens_in: 2, tokens_out: 3, ended: 0, itl_ms: [1] }], in_flight: 0, queue_depth: 0 };
    const { transport, fetch } = transportWith(new Response(JSON.stringify(snapshot)));
    expect(await transport.metrics()).toEqual(snapshot);
    expect(fetch.mock.calls[0][0]).toBe('/metrics/cache');
  });

  it('maps 401 to invalid_api_key', async () => {
    const body = { error: { message: 'missing or wrong API key', type: 'invalid_request_error', code: 'invalid_api_key' } };
    const { transport } = transportWith(new Response(JSON.stringify(body), { status: 401 }));
    await expect(transport.listModels()).rejects.toMatchObject({ status: 401, code: 'invalid_api_key' });
  });
});

/** A fetch mock that answers by "METHOD path" and records every call. */
function routes(table: Record<string, (body: unknown) => { status?: number; json?: unknown }>) {
  const calls: { method: string; url: string; body: unknown; headers: Record<string, string> }[] = [];
  const fetch = vi.fn(async (url: string, init: RequestInit = {}) => {
    const method = init.method ?? 'GET';
    const body = typeof init.body === 'string' ? JSON.parse(init.body) : undefined;
    calls.push({ method, url, body, headers: (init.headers ?? {}) as Record<string, string> });
    const handler = table[`${method} ${url.replace('http://srv', '')}`];
    if (!handler) {
      return new Response(JSON.stringify({ error: { message: `no route for ${url}`, type: 'invalid_request_error', code: 'not_found' } }), { status: 404 });
    }
    const answer = handler(body);
    return new Response(answer.json === undefined ? '' : JSON.stringify(answer.json), { status: answer.status ?? 200 });
  });
  const transport = new HttpTransport({ fetch: fetch as unknown as typeof globalThis.fetch, baseUrl: 'http://srv', apiKey: 'secret' });
  return { transport, calls };
}

const job = (state: DownloadJob['state'], done = 0): DownloadJob => ({
  id: 'dl-1', repo: 'org/name', revision: 'main', state, bytes_done: done, bytes_total: 1000,
  files: [{ name: 'model.safetensors', size: 1000, bytes_done: done, state: state === 'done' ? 'done' : 'running' }],
  error: null, model_id: state === 'done' ? 'org/name' : null,
});

describe('HttpTransport model manager routes', () => {
  it('loads, unloads and deletes a model by its encoded id, with the API key', async () => {
    const { transport, calls } = routes({
      'POST /v1/models/org%2Fname/load': () => ({ json: { id: 'org/name', loaded: true } }),
      'POST /v1/models/org%2Fname/unload': () => ({ json: { id: 'org/name', loaded: false } }),
      'DELETE /v1/models/org%2Fname': () => ({ json: { id: 'org/name', deleted: true } }),
    });
    await transport.loadModel('org/name');
    await transport.unloadModel('org/name');
    await transport.deleteModel('org/name');
    expect(calls.map((c) => `${c.method} ${c.url}`)).toEqual([
      'POST http://srv/v1/models/org%2Fname/load',
      'POST http://srv/v1/models/org%2Fname/unload',
      'DELETE http://srv/v1/models/org%2Fname',
    ]);
    expect(calls.every((c) => c.headers.authorization === 'Bearer secret')).toBe(true);
  });

  it('reports a model that cannot be deleted with the server\'s message', async () => {
    const { transport } = routes({
      'DELETE /v1/models/qwen3-tiny': () => ({ status: 400, json: { error: { message: '`--model` folders are not deletable', type: 'invalid_request_error', code: 'not_deletable' } } }),
    });
    await expect(transport.deleteModel('qwen3-tiny')).rejects.toMatchObject({ status: 400, code: 'not_deletable', message: '`--model` folders are not deletable' });
  });

  it('starts, lists, pauses, resumes and cancels downloads on /admin/downloads', async () => {
    const { transport, calls } = routes({
      'POST /admin/downloads': () => ({ status: 202, json: job('queued') }),
      'GET /admin/downloads': () => ({ json: { data: [job('running', 250)] } }),
      'POST /admin/downloads/dl-1/pause': () => ({ json: job('paused', 250) }),
      'POST /admin/downloads/dl-1/resume': () => ({ json: job('running', 250) }),
      'DELETE /admin/downloads/dl-1': () => ({ json: job('cancelled', 250) }),
    });
    expect(await transport.startDownload('org/name', 'main')).toEqual(job('queued'));
    expect(await transport.startDownload('org/name')).toEqual(job('queued'));
    expect(await transport.listDownloads()).toEqual([job('running', 250)]);
    expect((await transport.pauseDownload('dl-1')).state).toBe('paused');
    expect((await transport.resumeDownload('dl-1')).state).toBe('running');
    expect((await transport.cancelDownload('dl-1')).state).toBe('cancelled');
    expect(calls.map((c) => [c.method, c.url.replace('http://srv', ''), c.body])).toEqual([
      ['POST', '/admin/downloads', { repo: 'org/name', revision: 'main' }],
      ['POST', '/admin/downloads', { repo: 'org/name' }],
      ['GET', '/admin/downloads', undefined],
      ['POST', '/admin/downloads/dl-1/pause', undefined],
      ['POST', '/admin/downloads/dl-1/resume', undefined],
      ['DELETE', '/admin/downloads/dl-1', undefined],
    ]);
    expect(calls[0].headers['content-type']).toBe('application/json');
  });

  it('marks a server without the admin routes as unsupported', async () => {
    const { transport } = routes({});
    const failure = await transport.listDownloads().catch((e: unknown) => e);
    expect(failure).toBeInstanceOf(TransportError);
    expect(isUnsupported(failure)).toBe(true);
    expect(isUnsupported(new TransportError('download dl-9 not found', 'not_found', 400))).toBe(false);
  });
});

describe('HttpTransport subscriptions', () => {
  afterEach(() => vi.useRealTimers());

  it('polls downloads every 500 ms while a job is active, then slowly, and at once after an action', async () => {
    vi.useFakeTimers();
    let state: DownloadJob['state'] = 'running';
    const { transport, calls } = routes({
      'GET /admin/downloads': () => ({ json: { data: [job(state, 500)] } }),
      'POST /admin/downloads/dl-1/pause': () => {
        state = 'paused';
        return { json: job('paused', 500) };
      },
    });
    const seen: DownloadJob['state'][] = [];
    const stop = transport.onDownloads((jobs) => seen.push(jobs[0].state));
    const gets = () => calls.filter((c) => c.method === 'GET').length;
    await vi.advanceTimersByTimeAsync(0);
    expect(gets()).toBe(1);
    await vi.advanceTimersByTimeAsync(POLL_MS.downloadsActive);
    expect(gets()).toBe(2);
    await transport.pauseDownload('dl-1');
    await vi.advanceTimersByTimeAsync(0);
    expect(gets()).toBe(3);
    expect(seen.at(-1)).toBe('paused');
    // Nothing active: the next poll waits the idle interval.
    await vi.advanceTimersByTimeAsync(POLL_MS.downloadsActive * 2);
    expect(gets()).toBe(3);
    await vi.advanceTimersByTimeAsync(POLL_MS.downloadsIdle);
    expect(gets()).toBe(4);
    stop();
    await vi.advanceTimersByTimeAsync(POLL_MS.downloadsIdle * 2);
    expect(gets()).toBe(4);
  });

  it('stops polling downloads when the server has no such route, and says so once', async () => {
    vi.useFakeTimers();
    const { transport, calls } = routes({});
    const errors: TransportError[] = [];
    const stop = transport.onDownloads(() => {}, (e) => errors.push(e));
    await vi.advanceTimersByTimeAsync(POLL_MS.downloadsIdle * 3);
    expect(calls).toHaveLength(1);
    expect(errors).toHaveLength(1);
    expect(isUnsupported(errors[0])).toBe(true);
    stop();
  });

  it('polls /metrics/cache every 500 ms', async () => {
    vi.useFakeTimers();
    let n = 0;
    const { transport } = routes({ 'GET /metrics/cache': () => ({ json: { recent: [], in_flight: n++, queue_depth: 0 } }) });
    const seen: number[] = [];
    const stop = transport.onMetrics((snapshot) => seen.push(snapshot.in_flight));
    await vi.advanceTimersByTimeAsync(0);
    await vi.advanceTimersByTimeAsync(POLL_MS.metrics * 3);
    expect(seen).toEqual([0, 1, 2, 3]);
    stop();
    await vi.advanceTimersByTimeAsync(POLL_MS.metrics * 3);
    expect(seen).toHaveLength(4);
  });
});
