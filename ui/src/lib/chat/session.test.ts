import { describe, expect, it } from 'vitest';
import { MemoryThreadStorage } from '../storage/local';
import { StubTransport } from '../transport/stub';
import { TransportError, type ChatOptions, type ChatOutcome, type ChatRequest, type MetricsSnapshot } from '../transport/types';
import type { AssistantMessage } from './model';
import { ChatSession } from './session.svelte';
import { ThreadStore } from './threads.svelte';

/** Answers every request with "answer N" in two deltas; records what it was asked. */
class FakeTransport extends StubTransport {
  requests: ChatRequest[] = [];
  recent: MetricsSnapshot['recent'] = [];
  /** When set, the next chat waits for abort after its first delta. */
  hang = false;
  fail: TransportError | null = null;

  override async chat(request: ChatRequest, { onEvent, signal }: ChatOptions): Promise<ChatOutcome> {
    this.requests.push(request);
    const id = `chatcmpl-${this.requests.length}`;
    if (this.fail) throw this.fail;
    onEvent({ kind: 'delta', text: 'answer ' });
    if (this.hang) {
      await new Promise((resolve) => signal?.addEventListener('abort', resolve));
      return { status: 'cancelled', id };
    }
    onEvent({ kind: 'delta', text: String(this.requests.length) });
    this.recent.push({ id, model: request.model, ttft_ms: 5, itl_ms: [2, 2], tokens_in: 10, tokens_out: 2, ended: 0 });
    return { status: 'done', id, usage: { prompt_tokens: 10, completion_tokens: 2, total_tokens: 12 }, finishReason: 'stop' };
  }

  override async metrics(): Promise<MetricsSnapshot> {
    return { recent: this.recent, in_flight: 0, queue_depth: 0 };
  }
}

function setup() {
  const store = new ThreadStore(new MemoryThreadStorage(), 0);
  const transport = new FakeTransport();
  const session = new ChatSession(store, transport, { statsRetryDelaysMs: [0], sleep: async () => {} });
  const thread = store.create({ model: 'qwen3-tiny', systemPrompt: 'Be brief.', sampling: { temperature: 0 } });
  return { store, transport, session, thread };
}

const texts = (store: ThreadStore) => store.active!.messages.map((m) => `${m.role}:${m.text}`);

describe('ChatSession', () => {
  it('streams an answer, then attaches the server stats of that request', async () => {
    const { store, transport, session, thread } = setup();
    await session.send(thread.id, 'hi', []);
    expect(texts(store)).toEqual(['user:hi', 'assistant:answer 1']);
    expect(transport.requests[0]).toEqual({
      model: 'qwen3-tiny',
      messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'hi' }],
      temperature: 0,
      top_p: 0.95,
      max_tokens: 1024,
    });
    const answer = store.active!.messages[1] as AssistantMessage;
    expect(answer).toMatchObject({ status: 'done', completionId: 'chatcmpl-1', finishReason: 'stop' });
    expect(answer.stats).toEqual({ ttftMs: 5, tokensIn: 10, tokensOut: 2, itlMs: [2, 2], draftTokens: 0, acceptedTokens: 0 });
    expect(session.liveText).toBe('answer 1');
    expect(session.busy).toBe(false);
  });

  it('regenerate drops the answer and asks the same history again', async () => {
    const { store, transport, session, thread } = setup();
    await session.send(thread.id, 'one', []);
    await session.send(thread.id, 'two', []);
    const lastAnswer = store.active!.messages[3];
    await session.regenerate(thread.id, lastAnswer.id);
    expect(texts(store)).toEqual(['user:one', 'assistant:answer 1', 'user:two', 'assistant:answer 3']);
    expect(transport.requests[2].messages).toEqual(transport.requests[1].messages);
  });

  it('edit-and-resend replaces the question and forgets what followed', async () => {
    const { store, transport, session, thread } = setup();
    await session.send(thread.id, 'one', []);
    await session.send(thread.id, 'two', []);
    const firstQuestion = store.active!.messages[0];
    await session.editAndResend(thread.id, firstQuestion.id, 'uno');
    expect(texts(store)).toEqual(['user:uno', 'assistant:answer 3']);
    expect(transport.requests[2].messages.at(-1)).toEqual({ role: 'user', content: 'uno' });
    expect(transport.requests[2].messages).toHaveLength(2); // system + the edited question
  });

  it('stop keeps the partial answer, marked stopped', async () => {
    const { store, transport, session, thread } = setup();
    transport.hang = true;
    const running = session.send(thread.id, 'long please', []);
    await Promise.resolve();
    expect(session.busy).toBe(true);
    session.stop();
    await running;
    expect(store.active!.messages[1]).toMatchObject({ status: 'stopped', text: 'answer ' });
    expect(session.busy).toBe(false);
  });

  it('an error becomes part of the answer, with its code', async () => {
    const { store, transport, session, thread } = setup();
    transport.fail = new TransportError('model `qwen3-tiny` has no vision', 'invalid_request_error', 400);
    await session.send(thread.id, 'see this', []);
    expect(store.active!.messages[1]).toMatchObject({
      status: 'error',
      error: { message: 'model `qwen3-tiny` has no vision', code: 'invalid_request_error' },
    });
  });

  it('records null stats when the server has no entry for the request', async () => {
    const { store, transport, session, thread } = setup();
    transport.metrics = async () => ({ recent: [], in_flight: 0, queue_depth: 0 });
    await session.send(thread.id, 'hi', []);
    expect((store.active!.messages[1] as AssistantMessage).stats).toBeNull();
  });
});
