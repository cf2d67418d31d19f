// The saved shape of conversations. Plain JSON: it goes to localStorage in a browser and to the
// app data folder through the Tauri shell, so keep it serialisable and versioned.

import type { Usage } from '../transport/types';

export interface ImageAttachment {
  id: string;
  name: string;
  /** The bytes sent to the model: the original file's unless it had to be downscaled or converted. */
  dataUrl: string;
  mime: string;
  width: number;
  height: number;
  /** Set when the picture was shrunk to fit the pixel budget: its original size. */
  downscaledFrom?: { width: number; height: number };
}

/** The engine's figures for one finished request, copied from `/metrics/cache` `recent`. */
export interface RequestStats {
  ttftMs: number;
  tokensIn: number;
  tokensOut: number;
  /** Inter-token latencies in ms; empty when the server did not report them. */
  itlMs: number[];
  /** Tokens speculative decoding drafted, and how many the model kept (absent in answers saved
   * before the server reported them). */
  draftTokens?: number;
  acceptedTokens?: number;
}

export type AnswerStatus = 'streaming' | 'done' | 'stopped' | 'error';

export interface UserMessage {
  id: string;
  role: 'user';
  text: string;
  images: ImageAttachment[];
}

export interface AssistantMessage {
  id: string;
  role: 'assistant';
  text: string;
  reasoning: string;
  status: AnswerStatus;
  model: string;
  error?: { message: string; code: string | null };
  /** The completion id from the stream: the key of this request in `/metrics/cache`. */
  completionId?: string;
  usage?: Usage | null;
  finishReason?: string | null;
  /** `null`: looked up, the server had no entry for this request. */
  stats?: RequestStats | null;
}

export type ChatMessage = UserMessage | AssistantMessage;

export interface Sampling {
  temperature?: number;
  top_p?: number;
  max_tokens?: number;
}

export interface Thread {
  id: string;
  title: string;
  /** False until the user renames it; until then the first question names it. */
  titleEdited: boolean;
  createdAt: number;
  updatedAt: number;
  model: string;
  systemPrompt: string;
  sampling: Sampling;
  messages: ChatMessage[];
}

export interface ThreadsDocument {
  version: 1;
  threads: Thread[];
  activeId: string | null;
}

export function newId(prefix: string): string {
  const random =
    typeof crypto !== 'undefined' && 'randomUUID' in crypto
      ? crypto.randomUUID()
      : `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
  return `${prefix}-${random}`;
}
