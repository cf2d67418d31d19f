// The one seam between the UI and the engine. Two implementations: `http.ts` (a browser talking to
// `rmlx serve`) and `tauri.ts` (the desktop shell's IPC). Shapes follow the OpenAI chat API so the
// Rust side can reuse the server's request and response types unchanged.

/** An OpenAI chat content part. Images are always data: URIs (the server never fetches URLs). */
export type ContentPart =
  | { type: 'text'; text: string }
  | { type: 'image_url'; image_url: { url: string } };

export interface ApiMessage {
  role: 'system' | 'user' | 'assistant';
  content: string | ContentPart[];
}

/** The body of `POST /v1/chat/completions` minus the streaming switches the transport adds. */
export interface ChatRequest {
  model: string;
  messages: ApiMessage[];
  temperature?: number;
  top_p?: number;
  max_tokens?: number;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details?: { cached_tokens?: number };
}

/** What a running chat reports, in order: deltas, then exactly one `done` or `error`. */
export type ChatEvent =
  | { kind: 'delta'; text: string }
  /** Optional: `reasoning_content` of thinking models, shown apart from the answer. */
  | { kind: 'reasoning'; text: string }
  | { kind: 'done'; id: string; usage: Usage | null; finish_reason: string | null }
  | { kind: 'error'; message: string; code: string | null };

export type ChatOutcome =
  | { status: 'done'; id: string; usage: Usage | null; finishReason: string | null }
  /** Stopped by the caller; `id` is known once the first chunk (HTTP) or the command (Tauri) answered. */
  | { status: 'cancelled'; id: string | null };

export interface ChatOptions {
  onEvent: (event: ChatEvent) => void;
  /** Aborting stops the generation on the engine side too (HTTP disconnect, or `chat_cancel`). */
  signal?: AbortSignal;
}

/** One entry of `GET /v1/models`. */
export interface ModelInfo {
  id: string;
  object?: string;
  created?: number;
  owned_by?: string;
  context_length?: number;
  loaded?: boolean;
  vision?: boolean;
}

/** One finished request in `/metrics/cache` `recent`. `id` and `itl_ms` identify and detail it. */
export interface RecentRequest {
  id?: string;
  model: string;
  ttft_ms: number;
  itl_p50_ms?: number;
  itl_ms?: number[];
  tokens_in: number;
  tokens_out: number;
  ended: number;
}

/** `GET /metrics/cache`; only the fields the UI reads are typed, the rest pass through. */
export interface MetricsSnapshot {
  recent: RecentRequest[];
  in_flight: number;
  queue_depth: number;
  [key: string]: unknown;
}

export interface Transport {
  readonly kind: 'http' | 'tauri';
  /** Streams one chat completion. Resolves when it is done or cancelled; rejects with TransportError. */
  chat(request: ChatRequest, options: ChatOptions): Promise<ChatOutcome>;
  listModels(): Promise<ModelInfo[]>;
  metrics(): Promise<MetricsSnapshot>;
}

/**
 * Every failure the transports report. `code` is the server's error code when it gave one
 * (`context_length_exceeded`, `model_not_found`, `invalid_api_key`, ...), otherwise its error
 * type, or one of ours: `network`, `bad_response`, `incomplete_stream`.
 */
export class TransportError extends Error {
  readonly code: string | null;
  readonly status: number | null;

  constructor(message: string, code: string | null = null, status: number | null = null) {
    super(message);
    this.name = 'TransportError';
    this.code = code;
    this.status = status;
  }
}
