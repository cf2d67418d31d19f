// Browser storage: one JSON document in localStorage.

import type { ThreadsDocument } from '../chat/model';
import { validDocument, type ThreadStorage } from './types';

export const STORAGE_KEY = 'rmlx.threads';

function isQuotaError(error: unknown): boolean {
  return error instanceof DOMException && (error.name === 'QuotaExceededError' || error.code === 22);
}

/** The document without image bytes: what still fits when pictures overflow the quota. */
export function withoutImageData(document: ThreadsDocument): ThreadsDocument {
  return {
    ...document,
    threads: document.threads.map((thread) => ({
      ...thread,
      messages: thread.messages.map((message) =>
        message.role === 'user' && message.images.length > 0
          ? { ...message, images: message.images.map((image) => ({ ...image, dataUrl: '' })) }
          : message,
      ),
    })),
  };
}

export class LocalThreadStorage implements ThreadStorage {
  /** Set when the last save had to drop image bytes to fit; the UI says so. */
  droppedImages = false;

  get notice(): string | null {
    return this.droppedImages ? 'Browser storage is full: pictures were not saved with the conversations (their text was).' : null;
  }

  constructor(private readonly storage: Storage = globalThis.localStorage) {}

  async load(): Promise<ThreadsDocument | null> {
    const text = this.storage.getItem(STORAGE_KEY);
    if (!text) return null;
    try {
      return validDocument(JSON.parse(text));
    } catch {
      return null;
    }
  }

  async save(document: ThreadsDocument): Promise<void> {
    try {
      this.storage.setItem(STORAGE_KEY, JSON.stringify(document));
      this.droppedImages = false;
    } catch (error) {
      // localStorage holds about 5 MB; pictures are what overflows it. Keep the words.
      if (!isQuotaError(error)) throw error;
      this.storage.setItem(STORAGE_KEY, JSON.stringify(withoutImageData(document)));
      this.droppedImages = true;
    }
  }
}

/** For tests and for a browser without storage. */
export class MemoryThreadStorage implements ThreadStorage {
  saved: ThreadsDocument | null = null;
  saves = 0;

  async load(): Promise<ThreadsDocument | null> {
    return this.saved ? structuredClone(this.saved) : null;
  }

  async save(document: ThreadsDocument): Promise<void> {
    this.saved = structuredClone(document);
    this.saves++;
  }
}
