// Conversations as reactive state, saved through a ThreadStorage (debounced: a streaming answer
// changes many times a second, the disk needs it once in a while and at the end).

import type { ThreadStorage } from '../storage/types';
import { titleFrom } from './conversation';
import { newId, type AssistantMessage, type ChatMessage, type Sampling, type Thread, type ThreadsDocument } from './model';

export type ThreadSettings = Pick<Thread, 'model' | 'systemPrompt' | 'sampling'>;

export const DEFAULT_SAMPLING: Sampling = { temperature: 0.7, top_p: 0.95, max_tokens: 1024 };

export class ThreadStore {
  threads = $state<Thread[]>([]);
  activeId = $state<string | null>(null);
  /** Loading or the last save failed: the message, for the UI. */
  storageError = $state<string | null>(null);

  readonly active: Thread | null = $derived(this.threads.find((t) => t.id === this.activeId) ?? null);
  /** Most recently used first. */
  readonly ordered: Thread[] = $derived([...this.threads].sort((a, b) => b.updatedAt - a.updatedAt));

  private saveTimer: ReturnType<typeof setTimeout> | null = null;
  private saving: Promise<void> = Promise.resolve();

  constructor(
    private readonly storage: ThreadStorage,
    private readonly saveDelayMs = 400,
  ) {}

  async load(): Promise<void> {
    let document: ThreadsDocument | null;
    try {
      document = await this.storage.load();
    } catch (error) {
      // Start empty rather than not at all; nothing is saved over the old file until a change.
      this.storageError = `Could not load conversations: ${String(error)}`;
      return;
    }
    if (!document) return;
    for (const thread of document.threads) {
      for (const message of thread.messages) {
        // The app closed mid-answer: what arrived is kept, marked as cut short.
        if (message.role === 'assistant' && message.status === 'streaming') message.status = 'stopped';
      }
    }
    this.threads = document.threads;
    this.activeId = document.threads.some((t) => t.id === document.activeId) ? document.activeId : null;
  }

  get(id: string): Thread | undefined {
    return this.threads.find((t) => t.id === id);
  }

  create(settings: Partial<ThreadSettings> = {}): Thread {
    const now = Date.now();
    const thread: Thread = {
      id: newId('thread'),
      title: 'New chat',
      titleEdited: false,
      createdAt: now,
      updatedAt: now,
      model: settings.model ?? '',
      systemPrompt: settings.systemPrompt ?? '',
      sampling: { ...DEFAULT_SAMPLING, ...settings.sampling },
      messages: [],
    };
    this.threads.push(thread);
    this.activeId = thread.id;
    this.persist();
    // The proxied object, so later edits through it are seen.
    return this.get(thread.id)!;
  }

  select(id: string | null): void {
    this.activeId = id;
    this.persist();
  }

  rename(id: string, title: string): void {
    const thread = this.get(id);
    const trimmed = title.trim();
    if (!thread || !trimmed) return;
    thread.title = trimmed;
    thread.titleEdited = true;
    this.persist();
  }

  remove(id: string): void {
    const index = this.threads.findIndex((t) => t.id === id);
    if (index < 0) return;
    this.threads.splice(index, 1);
    if (this.activeId === id) this.activeId = this.ordered[0]?.id ?? null;
    this.persist();
  }

  updateSettings(id: string, settings: Partial<ThreadSettings>): void {
    const thread = this.get(id);
    if (!thread) return;
    if (settings.model !== undefined) thread.model = settings.model;
    if (settings.systemPrompt !== undefined) thread.systemPrompt = settings.systemPrompt;
    if (settings.sampling !== undefined) thread.sampling = { ...settings.sampling };
    this.persist();
  }

  /** Replaces the conversation (after edit or regenerate truncation) and names the thread. */
  setMessages(id: string, messages: ChatMessage[]): void {
    const thread = this.get(id);
    if (!thread) return;
    thread.messages = messages;
    thread.updatedAt = Date.now();
    const first = messages.find((m) => m.role === 'user');
    if (!thread.titleEdited && first?.role === 'user') thread.title = titleFrom(first.text, first.images.length);
    this.persist();
  }

  /** Edits one answer in place (streaming text, status, stats). */
  patchAnswer(threadId: string, messageId: string, change: (message: AssistantMessage) => void): void {
    const message = this.get(threadId)?.messages.find((m) => m.id === messageId);
    if (!message || message.role !== 'assistant') return;
    change(message);
    this.persist();
  }

  /** Saves soon; many calls in a burst make one write. */
  persist(): void {
    if (this.saveTimer !== null) clearTimeout(this.saveTimer);
    this.saveTimer = setTimeout(() => void this.flush(), this.saveDelayMs);
  }

  /** Saves now (and waits for it). */
  async flush(): Promise<void> {
    if (this.saveTimer !== null) clearTimeout(this.saveTimer);
    this.saveTimer = null;
    const document: ThreadsDocument = {
      version: 1,
      threads: $state.snapshot(this.threads) as Thread[],
      activeId: this.activeId,
    };
    // Writes in order, so an older document never lands after a newer one.
    this.saving = this.saving.then(async () => {
      try {
        await this.storage.save(document);
        this.storageError = this.storage.notice ?? null;
      } catch (error) {
        this.storageError = `Could not save conversations: ${String(error)}`;
      }
    });
    return this.saving;
  }
}
