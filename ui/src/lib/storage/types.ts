import type { ThreadsDocument } from '../chat/model';

/** Where conversations live between sessions. */
export interface ThreadStorage {
  /** The saved document, or null on first run. */
  load(): Promise<ThreadsDocument | null>;
  save(document: ThreadsDocument): Promise<void>;
  /** Set when the last save kept less than asked (e.g. pictures dropped to fit); for the UI. */
  readonly notice?: string | null;
}

/** A saved document from an unknown source: null unless it has the shape we write. */
export function validDocument(value: unknown): ThreadsDocument | null {
  if (!value || typeof value !== 'object') return null;
  const document = value as Partial<ThreadsDocument>;
  if (document.version !== 1 || !Array.isArray(document.threads)) return null;
  return { version: 1, threads: document.threads, activeId: document.activeId ?? null };
}
