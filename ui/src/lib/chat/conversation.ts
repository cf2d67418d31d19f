// Pure rules about a conversation: what is sent to the model, and what edit and regenerate keep.

import type { ApiMessage, ChatRequest, ContentPart } from '../transport/types';
import type { ChatMessage, Thread } from './model';

/** The OpenAI messages for a thread's history (everything in `messages`, in order). */
export function toApiMessages(systemPrompt: string, messages: ChatMessage[]): ApiMessage[] {
  const api: ApiMessage[] = [];
  if (systemPrompt.trim()) api.push({ role: 'system', content: systemPrompt });
  for (const message of messages) {
    if (message.role === 'user') {
      if (message.images.length === 0) {
        api.push({ role: 'user', content: message.text });
        continue;
      }
      // Images first, then the question: the order Qwen-VL style templates are trained on.
      const parts: ContentPart[] = message.images.map((image) => ({
        type: 'image_url',
        image_url: { url: image.dataUrl },
      }));
      if (message.text) parts.push({ type: 'text', text: message.text });
      api.push({ role: 'user', content: parts });
    } else {
      // A failed answer with no text never reached the model's context; leave it out.
      if (message.status === 'error' && !message.text) continue;
      api.push({ role: 'assistant', content: message.text });
    }
  }
  return api;
}

export function buildRequest(thread: Thread, history: ChatMessage[]): ChatRequest {
  const request: ChatRequest = { model: thread.model, messages: toApiMessages(thread.systemPrompt, history) };
  const { temperature, top_p, max_tokens } = thread.sampling;
  if (temperature !== undefined) request.temperature = temperature;
  if (top_p !== undefined) request.top_p = top_p;
  if (max_tokens !== undefined) request.max_tokens = max_tokens;
  return request;
}

/**
 * Regenerating an answer drops it and everything after it; the history before it is asked again.
 * Returns null when the message is not an assistant answer that follows a user question.
 */
export function historyForRegenerate(messages: ChatMessage[], assistantId: string): ChatMessage[] | null {
  const index = messages.findIndex((m) => m.id === assistantId);
  if (index < 1 || messages[index].role !== 'assistant') return null;
  return messages.slice(0, index);
}

/** Editing a question replaces its text and drops everything after it (the answers to the old text). */
export function historyForEdit(messages: ChatMessage[], userId: string, text: string): ChatMessage[] | null {
  const index = messages.findIndex((m) => m.id === userId);
  if (index < 0) return null;
  const original = messages[index];
  if (original.role !== 'user') return null;
  return [...messages.slice(0, index), { ...original, text }];
}

/** A thread title from the first question: its first line, shortened on a word boundary. */
export function titleFrom(text: string, imageCount: number): string {
  const line = text.trim().split('\n')[0].trim();
  if (!line) return imageCount > 0 ? 'Image' : 'New chat';
  if (line.length <= 48) return line;
  const cut = line.slice(0, 48);
  const space = cut.lastIndexOf(' ');
  return `${space > 24 ? cut.slice(0, space) : cut}…`;
}
