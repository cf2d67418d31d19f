import { describe, expect, it } from 'vitest';
import { buildRequest, historyForEdit, historyForRegenerate, titleFrom, toApiMessages } from './conversation';
import type { AssistantMessage, ChatMessage, Thread, UserMessage } from './model';

const user = (id: string, text: string, images: UserMessage['images'] = []): UserMessage => ({ id, role: 'user', text, images });
const answer = (id: string, text: string, status: AssistantMessage['status'] = 'done'): AssistantMessage => ({
  id, role: 'assistant', text, reasoning: '', status, model: 'm',
});
const image = { id: 'i1', name: 'a.png', dataUrl: 'data:image/png;base64,AAAA', mime: 'image/png', width: 2, height: 2 };

const conversation: ChatMessage[] = [user('u1', 'one'), answer('a1', 'first'), user('u2', 'two'), answer('a2', 'second')];

describe('toApiMessages', () => {
  it('puts the system prompt first and images as image_url parts before the text', () => {
    expect(toApiMessages('Be brief.', [user('u', 'What is it?', [image]), answer('a', 'A dot.')])).toEqual([
      { role: 'system', content: 'Be brief.' },
      { role: 'user', content: [{ type: 'image_url', image_url: { url: image.dataUrl } }, { type: 'text', text: 'What is it?' }] },
      { role: 'assistant', content: 'A dot.' },
    ]);
  });

  it('leaves out a blank system prompt and failed empty answers, keeps stopped partial ones', () => {
    const messages = [user('u1', 'a'), answer('x', '', 'error'), user('u2', 'b'), answer('y', 'partial', 'stopped')];
    expect(toApiMessages('  ', messages).map((m) => [m.role, m.content])).toEqual([
      ['user', 'a'],
      ['user', 'b'],
      ['assistant', 'partial'],
    ]);
  });
});

describe('buildRequest', () => {
  it('copies only the sampling fields that are set', () => {
    const thread = { model: 'qwen3-tiny', systemPrompt: '', sampling: { temperature: 0, max_tokens: 16 } } as Thread;
    expect(buildRequest(thread, [user('u', 'hi')])).toEqual({
      model: 'qwen3-tiny',
      messages: [{ role: 'user', content: 'hi' }],
      temperature: 0,
      max_tokens: 16,
    });
  });
});

describe('edit and regenerate truncation', () => {
  it('regenerating an answer keeps only what came before it', () => {
    expect(historyForRegenerate(conversation, 'a2')?.map((m) => m.id)).toEqual(['u1', 'a1', 'u2']);
    expect(historyForRegenerate(conversation, 'a1')?.map((m) => m.id)).toEqual(['u1']);
  });

  it('refuses to regenerate a question or an unknown id', () => {
    expect(historyForRegenerate(conversation, 'u2')).toBeNull();
    expect(historyForRegenerate(conversation, 'nope')).toBeNull();
  });

  it('editing a question replaces its text and drops every later message', () => {
    const edited = historyForEdit(conversation, 'u1', 'uno');
    expect(edited?.map((m) => [m.id, m.text])).toEqual([['u1', 'uno']]);
    expect(historyForEdit(conversation, 'u2', 'dos')?.map((m) => [m.id, m.text])).toEqual([
      ['u1', 'one'],
      ['a1', 'first'],
      ['u2', 'dos'],
    ]);
    // The original list is untouched.
    expect(conversation[2].text).toBe('two');
  });

  it('editing keeps the question images', () => {
    const edited = historyForEdit([user('u', 'old', [image])], 'u', 'new');
    expect(edited?.[0]).toMatchObject({ text: 'new', images: [image] });
  });

  it('refuses to edit an answer', () => {
    expect(historyForEdit(conversation, 'a1', 'x')).toBeNull();
  });
});

describe('titleFrom', () => {
  it('uses the first line, shortened on a word', () => {
    expect(titleFrom('Hello there\nsecond line', 0)).toBe('Hello there');
    const long = titleFrom('word '.repeat(20), 0);
    expect(long).toMatch(/^word( word)+…$/);
    expect(long.length).toBeLessThanOrEqual(49);
    expect(titleFrom('', 1)).toBe('Image');
  });
});
