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

/** How an estimate of a model's memory need compares with the memory available. */
export type Fits = 'yes' | 'tight' | 'no';

export interface Quantization {
  bits: number;
  group_size?: number | null;
  mode?: string | null;
}

/** One entry of `GET /v1/models`; the model manager fields (docs/MODELS-API.md) are missing on older servers. */
export interface ModelInfo {
  id: string;
  object?: string;
  created?: number;
  owned_by?: string;
  context_length?: number;
  loaded?: boolean;
  vision?: boolean;
  /** Ships a multi-token-prediction draft head (Qwen3.5 / 3.6 `mtp.*` or a sidecar). */
  draft_head?: boolean;
  /** The folder of the draft model paired with every model served (`--draft-model`), or null. */
  draft_model?: string | null;
  size_bytes?: number;
  model_type?: string;
  quantization?: Quantization | null;
  /** `model` (a `--model` folder), `models_dir`, `hf_cache`. */
  source?: string;
  deletable?: boolean;
  fits?: Fits | null;
  /** The longest context that fits the memory available now, as the server holds the model. */
  max_context_fits?: number | null;
  parameters?: number;
  /** The release structure the server recognised, e.g. "gemma4, MoE 128 experts top-8, k_eq_v". */
  structure?: string;
  /** Seconds its last load took (reading the weights), or null before it loaded. */
  load_seconds?: number | null;
  /** Seconds its last warm-up took (kernels built right after loading), or null before one ran. */
  warm_up_seconds?: number | null;
}

/** `GET /v1/models` top-level `memory`. */
export interface MemoryInfo {
  total_bytes: number;
  available_bytes: number;
}

/** The model list with the machine's memory (null when the server does not say). */
export interface ModelCatalog {
  models: ModelInfo[];
  memory: MemoryInfo | null;
}

export type DownloadState = 'queued' | 'listing' | 'running' | 'paused' | 'verifying' | 'done' | 'failed' | 'cancelled';
export type DownloadFileState = 'pending' | 'running' | 'done' | 'failed';

export interface DownloadFile {
  name: string;
  size: number | null;
  bytes_done: number;
  state: DownloadFileState;
}

/** A Hugging Face download job (`/admin/downloads`, or the `downloads` event in the app). */
export interface DownloadJob {
  id: string;
  repo: string;
  revision: string | null;
  state: DownloadState;
  bytes_done: number;
  bytes_total: number | null;
  files: DownloadFile[];
  error: string | null;
  /** Set once the job is `done`: the id the model list knows it by. */
  model_id: string | null;
}

/** One finished request in `/metrics/cache` `recent`. `id` and `itl_ms` identify and detail it. */
export interface RecentRequest {
  id?: string;
  model: string;
  ttft_ms: number;
  itl_p50_ms?: number;
  itl_ms?: number[];
  tokens_in: number;
  /** Prompt tokens served from the prefix cache (KV entries or recurrent snapshots). */
  cached_tokens?: number;
  tokens_out: number;
  /** Tokens speculative decoding drafted for it (`rmlx serve --speculative`), and how many the model kept. */
  draft_tokens?: number;
  accepted_tokens?: number;
  ended: number;
}

/** One model's counters in `/metrics/cache` `models`. */
export interface ModelMetrics {
  model_id: string;
  prefix_cache_hits?: number;
  /** Requests whose prefix was read back from the disk cache. */
  disk_cache_hits?: number;
  prefix_cache_misses?: number;
  /** Tokens speculative decoding drafted for this model's finished requests, and how many were kept (cumulative). */
  draft_tokens?: number;
  accepted_tokens?: number;
  [key: string]: unknown;
}

/** `/metrics/cache` `disk_cache`: the prefix cache on disk (null when it is off). */
export interface DiskCacheMetrics {
  path: string;
  budget_bytes: number;
  bytes: number;
  files: number;
  read_bytes: number;
  read_ms: number;
  written_bytes: number;
  evicted_files: number;
  evicted_bytes: number;
  writing_stopped: boolean;
}

/** `GET /metrics/cache`; only the fields the UI reads are typed, the rest pass through. */
export interface MetricsSnapshot {
  recent: RecentRequest[];
  in_flight: number;
  queue_depth: number;
  models?: ModelMetrics[];
  kv_cache_bytes?: number;
  prefix_cache_bytes?: number;
  /** Recurrent-model (Qwen3.5) snapshots kept, one per message boundary, and their bytes. */
  prefix_snapshots?: number;
  prefix_snapshot_bytes?: number;
  /** MLX's allocator (docs/SERVER.md's names; `mlx_active_bytes` / `mlx_peak_bytes` are read too). */
  active_memory_bytes?: number;
  peak_memory_bytes?: number;
  disk_cache?: DiskCacheMetrics | null;
  /** `rmlx serve --distributed`: every machine of the pipeline (absent on one machine). */
  ranks?: RankStatus[];
  /** Why the pipeline across machines failed (the server is exiting). */
  pipeline_error?: string;
  [key: string]: unknown;
}

/** One machine (rank) of a pipeline in `/metrics/cache` `ranks`. */
export interface RankStatus {
  rank: number;
  /** Its address and port in the hostfile. */
  endpoint: string;
  /** The decoder layers it holds, `[start, end)`. */
  layers: [number, number];
  /** Milliseconds since its last heartbeat; null for the machine serving (it does not beat for itself). */
  last_heartbeat_ms: number | null;
}

/** Stops a subscription. */
export type Unsubscribe = () => void;

/** Hears a subscription's failures (a 404 from a server without the route, say). */
export type ErrorListener = (error: TransportError) => void;

// ---- the desktop app's own settings (Tauri only) ------------------------------------------

/** `settings_get` / `settings_set`: the app's settings.json (snake_case, as Rust serialises it). */
export interface AppConfig {
  models_dir: string | null;
  hub_url: string | null;
  server_enabled: boolean;
  server_host: string;
  server_port: number;
  api_key: string | null;
  cors_origins: string[];
  default_max_context: number | null;
  /** 8 or 4: the KV cache quantized (taken when the app starts); null or absent: dense. */
  kv_cache_bits?: number | null;
  /** GB the disk prefix cache may hold: 0 off, null the default (min(16, 10 % of the free disk)). */
  prefix_disk_gb?: number | null;
  /** Its folder; null: ~/.rmlx/cache. */
  prefix_disk_dir?: string | null;
  /** Speculative decoding: 'auto', 'off', 'lookup', 'mtp' or 'draft' (taken when the app starts); null or absent: the engine's default. */
  speculative?: 'auto' | 'off' | 'lookup' | 'mtp' | 'draft' | null;
  /** A small model of the same tokenizer that drafts for every model (its folder); null or absent: none. */
  draft_model?: string | null;
  launch_at_login: boolean;
  update_channel: 'stable' | 'beta';
  /** Fields this UI does not know are kept and sent back. */
  [key: string]: unknown;
}

/** `server_status`, `server_set` and the `server-status` event. */
export type ServerStatus =
  | { state: 'off' }
  | { state: 'on'; url: string }
  /** Switched on but could not listen: `message` says why (a busy port). */
  | { state: 'failed'; message: string; port: number };

/** `update_check`: null (nothing newer) or the update on offer. */
export interface UpdateInfo {
  version: string;
  current_version?: string | null;
  date?: string | null;
  notes?: string | null;
}

/** The `update-progress` event: bytes of the update downloaded so far. */
export interface UpdateProgress {
  downloaded: number;
  total: number | null;
}

/** What only the desktop app has: its settings, its local server, its updater. */
export interface AppControl {
  getSettings(): Promise<AppConfig>;
  /** Saves the whole document; resolves with what was saved. */
  setSettings(settings: AppConfig): Promise<AppConfig>;
  serverStatus(): Promise<ServerStatus>;
  /** `port` 0 picks a free port; null keeps the saved one. */
  setServer(enabled: boolean, port: number | null): Promise<ServerStatus>;
  setLaunchAtLogin(enabled: boolean): Promise<boolean>;
  checkUpdate(): Promise<UpdateInfo | null>;
  /** Downloads, verifies the signature and installs the update the last check found. */
  installUpdate(): Promise<void>;
  /** Restarts the app into the installed update. */
  restart(): Promise<void>;
  onServerStatus(listener: (status: ServerStatus) => void): Unsubscribe;
  onUpdateProgress(listener: (progress: UpdateProgress) => void): Unsubscribe;
}

export interface Transport {
  readonly kind: 'http' | 'tauri';
  /** Streams one chat completion. Resolves when it is done or cancelled; rejects with TransportError. */
  chat(request: ChatRequest, options: ChatOptions): Promise<ChatOutcome>;
  /** The models and, when the server reports it, the machine's memory. */
  listModels(): Promise<ModelCatalog>;
  loadModel(id: string): Promise<void>;
  unloadModel(id: string): Promise<void>;
  /** Unloads and removes the model's folder (only `deletable` ones). */
  deleteModel(id: string): Promise<void>;
  metrics(): Promise<MetricsSnapshot>;
  /** Deletes every file of the disk prefix cache; resolves to the bytes freed. */
  clearDiskCache(): Promise<number>;
  startDownload(repo: string, revision?: string | null): Promise<DownloadJob>;
  listDownloads(): Promise<DownloadJob[]>;
  pauseDownload(id: string): Promise<DownloadJob>;
  resumeDownload(id: string): Promise<DownloadJob>;
  /** Cancels and removes the partial files. */
  cancelDownload(id: string): Promise<DownloadJob>;
  /** The job list now and on every change (app: `downloads` events; browser: polling, fast while a job is active). */
  onDownloads(listener: (jobs: DownloadJob[]) => void, onError?: ErrorListener): Unsubscribe;
  /** Metrics snapshots (app: `metrics` events; browser: polling every 500 ms while the page is visible). */
  onMetrics(listener: (snapshot: MetricsSnapshot) => void, onError?: ErrorListener): Unsubscribe;
  /** The desktop app's settings, local server and updater; null in a browser. */
  readonly app: AppControl | null;
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

/** True for a failure that means "this server (or app) has no such route or command": an older build. */
export function isUnsupported(error: unknown): boolean {
  if (!(error instanceof TransportError)) return false;
  if (error.status === 405 || error.status === 501) return true;
  if (error.status === 404) return error.code === 'not_found' || error.code === 'http_404' || /no route/i.test(error.message);
  // Tauri: a command the shell does not register.
  return /command \S+ not found|unknown command/i.test(error.message);
}

/** A failure as one line for the page. */
export function describeError(error: unknown): string {
  if (error instanceof TransportError) return error.code && !error.message.includes(error.code) ? `${error.message} (${error.code})` : error.message;
  return error instanceof Error ? error.message : String(error);
}
