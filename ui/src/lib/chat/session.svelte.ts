// Runs generations: sends a thread's history through the transport, streams the answer into the
// store, handles Stop, and afterwards fetches the engine's numbers for that very request.

import { TransportError, type Transport } from '../transport/types';
import { buildRequest, historyForEdit, historyForRegenerate } from './conversation';
import { newId, type AssistantMessage, type ChatMessage, type ImageAttachment } from './model';
import { findRequestStats } from './stats';
import type { ThreadStore } from './threads.svelte';

interface Running {
  threadId: string;
  messageId: string;
  controller: AbortController;
}

export interface SessionOptions {
  /** The engine records a request as it finishes; a short retry covers the race with the stream. */
  statsRetryDelaysMs?: number[];
  sleep?: (ms: number) => Promise<void>;
}

const defaultSleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

export class ChatSession {
  running = $state<Running | null>(null);
  /** Plain text of the answer being streamed, for the aria-live region. */
  liveText = $state('');
  /** The thread `liveText` belongs to. */
  liveThreadId = $state<string | null>(null);
  /** Set by the UI when the transport changes (connection settings). */
  transport: Transport;

  private readonly retryDelays: number[];
  private readonly sleep: (ms: number) => Promise<void>;

  constructor(
    private readonly store: ThreadStore,
    transport: Transport,
    options: SessionOptions = {},
  ) {
    this.transport = transport;
    this.retryDelays = options.statsRetryDelaysMs ?? [0, 150, 500];
    this.sleep = options.sleep ?? defaultSleep;
  }

  get busy(): boolean {
    return this.running !== null;
  }

  /** Asks a new question in a thread. */
  async send(threadId: string, text: string, images: ImageAttachment[]): Promise<void> {
    const thread = this.store.get(threadId);
    if (!thread || this.busy) return;
    const question: ChatMessage = { id: newId('msg'), role: 'user', text, images };
    await this.generate(threadId, [...thread.messages, question]);
  }

  /** Answers the question before `assistantId` again, dropping that answer and what followed. */
  async regenerate(threadId: string, assistantId: string): Promise<void> {
    const thread = this.store.get(threadId);
    if (!thread || this.busy) return;
    const history = historyForRegenerate(thread.messages, assistantId);
    if (history) await this.generate(threadId, history);
  }

  /** Replaces a question's text, drops everything after it and asks again. */
  async editAndResend(threadId: string, userId: string, text: string): Promise<void> {
    const thread = this.store.get(threadId);
    if (!thread || this.busy) return;
    const history = historyForEdit(thread.messages, userId, text);
    if (history) await this.generate(threadId, history);
  }

  stop(): void {
    this.running?.controller.abort();
  }

  private async generate(threadId: string, history: ChatMessage[]): Promise<void> {
    const thread = this.store.get(threadId);
    if (!thread) return;
    const request = buildRequest(thread, history);
    const answer: AssistantMessage = {
      id: newId('msg'),
      role: 'assistant',
      text: '',
      reasoning: '',
      status: 'streaming',
      model: thread.model,
    };
    this.store.setMessages(threadId, [...history, answer]);
    const controller = new AbortController();
    this.running = { threadId, messageId: answer.id, controller };
    this.liveText = '';
    this.liveThreadId = threadId;
    const patch = (change: (message: AssistantMessage) => void) => this.store.patchAnswer(threadId, answer.id, change);

    let completionId: string | null = null;
    try {
      const outcome = await this.transport.chat(request, {
        signal: controller.signal,
        onEvent: (event) => {
          if (event.kind === 'delta') {
            patch((m) => {
              m.text += event.text;
            });
            this.liveText += event.text;
          } else if (event.kind === 'reasoning') {
            patch((m) => {
              m.reasoning += event.text;
            });
          }
        },
      });
      completionId = outcome.id;
      patch((m) => {
        m.completionId = outcome.id ?? undefined;
        if (outcome.status === 'done') {
          m.status = 'done';
          m.usage = outcome.usage;
          m.finishReason = outcome.finishReason;
        } else {
          m.status = 'stopped';
        }
      });
    } catch (error) {
      const failure = error instanceof TransportError ? error : new TransportError(String(error));
      patch((m) => {
        m.status = 'error';
        m.error = { message: failure.message, code: failure.code };
      });
      this.liveText = `Error: ${failure.message}`;
    } finally {
      this.running = null;
    }
    if (completionId !== null) await this.loadStats(threadId, answer.id, completionId);
  }

  private async loadStats(threadId: string, messageId: string, completionId: string): Promise<void> {
    for (const delay of this.retryDelays) {
      if (delay > 0) await this.sleep(delay);
      try {
        const stats = findRequestStats(await this.transport.metrics(), completionId);
        if (stats) {
          this.store.patchAnswer(threadId, messageId, (m) => {
            m.stats = stats;
          });
          return;
        }
      } catch {
        // metrics are a nicety: an unreachable endpoint must not turn the answer into an error
      }
    }
    this.store.patchAnswer(threadId, messageId, (m) => {
      m.stats = null;
    });
  }
}
