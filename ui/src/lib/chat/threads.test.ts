import { describe, expect, it } from 'vitest';
import { MemoryThreadStorage } from '../storage/local';
import type { AssistantMessage, ThreadsDocument } from './model';
import { ThreadStore } from './threads.svelte';

describe('ThreadStore', () => {
  it('creates, renames, deletes and saves threads', async () => {
    const storage = new MemoryThreadStorage();
    const store = new ThreadStore(storage, 0);
    const first = store.create({ model: 'qwen3-tiny' });
    const second = store.create({ model: 'qwen3-vl-tiny', systemPrompt: 'Be brief.' });
    expect(store.activeId).toBe(second.id);
    store.rename(first.id, '  Renamed  ');
    store.rename(first.id, '   '); // blank names are ignored
    store.remove(second.id);
    await store.flush();

    expect(storage.saved?.threads.map((t) => [t.title, t.titleEdited, t.model])).toEqual([['Renamed', true, 'qwen3-tiny']]);
    expect(storage.saved?.activeId).toBe(first.id);

    // A fresh store sees the same threads.
    const reloaded = new ThreadStore(storage, 0);
    await reloaded.load();
    expect(reloaded.active?.title).toBe('Renamed');
  });

  it('names a thread from its first question unless it was renamed', () => {
    const store = new ThreadStore(new MemoryThreadStorage(), 0);
    const thread = store.create();
    store.setMessages(thread.id, [{ id: 'u', role: 'user', text: 'Why is the sky blue?', images: [] }]);
    expect(store.active?.title).toBe('Why is the sky blue?');
    store.rename(thread.id, 'Sky');
    store.setMessages(thread.id, [{ id: 'u', role: 'user', text: 'Something else', images: [] }]);
    expect(store.active?.title).toBe('Sky');
  });

  it('keeps per-thread settings', async () => {
    const storage = new MemoryThreadStorage();
    const store = new ThreadStore(storage, 0);
    const thread = store.create({ model: 'a' });
    store.updateSettings(thread.id, { systemPrompt: 'Pirate.', sampling: { temperature: 0, top_p: 1, max_tokens: 8 } });
    await store.flush();
    expect(storage.saved?.threads[0]).toMatchObject({ systemPrompt: 'Pirate.', sampling: { temperature: 0, top_p: 1, max_tokens: 8 } });
  });

  it('marks answers that were streaming when the app closed as stopped', async () => {
    const storage = new MemoryThreadStorage();
    const answer: AssistantMessage = { id: 'a', role: 'assistant', text: 'half', reasoning: '', status: 'streaming', model: 'm' };
    const document: ThreadsDocument = {
      version: 1,
      activeId: 't',
      threads: [{ id: 't', title: 'T', titleEdited: false, createdAt: 0, updatedAt: 0, model: 'm', systemPrompt: '', sampling: {}, messages: [answer] }],
    };
    await storage.save(document);
    const store = new ThreadStore(storage, 0);
    await store.load();
    expect(store.active?.messages[0]).toMatchObject({ status: 'stopped', text: 'half' });
  });

  it('starts empty, with a message, when saved conversations cannot be read', async () => {
    const storage = new MemoryThreadStorage();
    storage.load = async () => {
      throw new Error('disk on fire');
    };
    const store = new ThreadStore(storage, 0);
    await store.load();
    expect(store.threads).toEqual([]);
    expect(store.storageError).toBe('Could not load conversations: Error: disk on fire');
  });

  it('orders threads by last activity', () => {
    const store = new ThreadStore(new MemoryThreadStorage(), 0);
    const a = store.create();
    const b = store.create();
    a.updatedAt = b.updatedAt + 1000;
    expect(store.ordered.map((t) => t.id)).toEqual([a.id, b.id]);
  });

  it('debounces saves', async () => {
    const storage = new MemoryThreadStorage();
    const store = new ThreadStore(storage, 20);
    const thread = store.create();
    for (let i = 0; i < 10; i++) store.rename(thread.id, `name ${i}`);
    await new Promise((resolve) => setTimeout(resolve, 60));
    expect(storage.saves).toBe(1);
    expect(storage.saved?.threads[0].title).toBe('name 9');
  });
});
