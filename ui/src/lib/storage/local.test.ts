// @vitest-environment jsdom
import { describe, expect, it } from 'vitest';
import type { ThreadsDocument } from '../chat/model';
import { LocalThreadStorage, STORAGE_KEY } from './local';

const document: ThreadsDocument = {
  version: 1,
  activeId: 't',
  threads: [
    {
      id: 't', title: 'Pics', titleEdited: false, createdAt: 1, updatedAt: 2, model: 'vl', systemPrompt: '', sampling: { temperature: 0 },
      messages: [{ id: 'u', role: 'user', text: 'what?', images: [{ id: 'i', name: 'x.png', dataUrl: 'data:image/png;base64,' + 'A'.repeat(1000), mime: 'image/png', width: 1, height: 1 }] }],
    },
  ],
};

/** A Storage that refuses values over `limit` characters, like a full localStorage. */
function limitedStorage(limit: number): Storage {
  const data = new Map<string, string>();
  return {
    get length() { return data.size; },
    clear: () => data.clear(),
    getItem: (key) => data.get(key) ?? null,
    key: (index) => [...data.keys()][index] ?? null,
    removeItem: (key) => void data.delete(key),
    setItem: (key, value) => {
      if (value.length > limit) throw new DOMException('full', 'QuotaExceededError');
      data.set(key, value);
    },
  };
}

describe('LocalThreadStorage', () => {
  it('round-trips the document through localStorage', async () => {
    localStorage.clear();
    const storage = new LocalThreadStorage(localStorage);
    expect(await storage.load()).toBeNull();
    await storage.save(document);
    expect(JSON.parse(localStorage.getItem(STORAGE_KEY)!)).toEqual(document);
    expect(await new LocalThreadStorage(localStorage).load()).toEqual(document);
  });

  it('drops image bytes, not conversations, when the quota is hit', async () => {
    const storage = new LocalThreadStorage(limitedStorage(800));
    await storage.save(document);
    expect(storage.droppedImages).toBe(true);
    expect(storage.notice).toContain('pictures were not saved');
    const loaded = await storage.load();
    expect(loaded?.threads[0].messages[0]).toMatchObject({ text: 'what?', images: [{ name: 'x.png', dataUrl: '' }] });
  });

  it('ignores a corrupt or foreign document', async () => {
    localStorage.setItem(STORAGE_KEY, '{not json');
    expect(await new LocalThreadStorage(localStorage).load()).toBeNull();
    localStorage.setItem(STORAGE_KEY, JSON.stringify({ version: 99, threads: [] }));
    expect(await new LocalThreadStorage(localStorage).load()).toBeNull();
  });
});
