// Browser tests against a real `rmlx serve` with the tiny fixture models (see server.ts).
// Skipped, with the reason printed, when RMLX_BIN is not set.

import { mkdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import type { Browser, Page } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { draftAcceptance, formatDrafts, formatMs, formatRate, tokensPerSecond } from '../src/lib/chat/stats';
import type { MetricsSnapshot } from '../src/lib/transport/types';
import {
  api, artifactsDir, ask, attachedCount, dropImage, lastAnswer, launchBrowser, liveAnswer, openApp, pasteImage, pickModel,
  readStream, setSampling, waitForStatus,
} from './browser';
import { fixturesDir, skipReason, startServer, type RunningServer } from './server';

if (skipReason) process.stderr.write(`\ne2e skipped: ${skipReason}\n\n`);

const images = path.join(fixturesDir, 'vision-images');
const gradient = path.join(images, 'gradient_64x48.png');
const mirror = path.join(images, 'gradient_64x48_mirror.png');
const question = 'What is in this picture?';

interface Completion {
  choices: { message: { content: string }; finish_reason: string }[];
  usage: { prompt_tokens: number; completion_tokens: number };
}

describe.skipIf(skipReason !== null)('rMLX UI against rmlx serve', () => {
  let server: RunningServer;
  let browser: Browser;
  const pages: Page[] = [];

  async function open(colorScheme: 'light' | 'dark' = 'light'): Promise<Page> {
    const page = await openApp(browser, server.url, colorScheme);
    pages.push(page);
    return page;
  }

  async function shot(page: Page, name: string): Promise<void> {
    await page.screenshot({ path: path.join(artifactsDir, `${name}.png`) });
  }

  beforeAll(async () => {
    mkdirSync(artifactsDir, { recursive: true });
    server = await startServer();
    browser = await launchBrowser();
  });

  afterAll(async () => {
    for (const page of pages) await page.context().close();
    await browser?.close();
    await server?.stop();
  });

  it('shows the empty state, in light and dark', async () => {
    const light = await open();
    expect(await light.getByRole('heading', { name: 'What can I help with?' }).isVisible()).toBe(true);
    await shot(light, 'empty-light');
    const dark = await open('dark');
    const background = await dark.evaluate(() => getComputedStyle(document.body).backgroundColor);
    expect(background).toBe('rgb(26, 26, 30)');
    await shot(dark, 'empty-dark');
  });

  it('streams a message to completion, with the live region carrying the answer', async () => {
    const page = await open();
    await pickModel(page, 'qwen3-tiny');
    await setSampling(page, { temperature: 0, maxTokens: 24 });
    const response = await ask(page, 'Hello there');
    await waitForStatus(page, 'done');
    await readStream(response);
    // Greedy decoding: the streamed answer equals the server's non-streamed one for the same body.
    const sent = response.request().postDataJSON() as Record<string, unknown>;
    expect(sent).toMatchObject({ stream: true, stream_options: { include_usage: true }, temperature: 0, max_tokens: 24 });
    const { stream: _stream, stream_options: _options, ...body } = sent;
    const direct = await api<Completion>(server.apiUrl, '/v1/chat/completions', body);
    const streamed = await liveAnswer(page);
    expect(streamed.length).toBeGreaterThan(0);
    expect(streamed).toBe(direct.choices[0].message.content);
    expect((await lastAnswer(page).getByTestId('answer').innerText()).length).toBeGreaterThan(0);
    expect(await page.locator('li.message.user .bubble').innerText()).toBe('Hello there');
    // The thread is named after the question.
    expect(await page.locator('.thread.active .thread-title').innerText()).toBe('Hello there');
  });

  it('shows under the answer exactly the numbers /metrics/cache recorded for that request', async () => {
    const page = await open('dark');
    await pickModel(page, 'qwen3-tiny');
    await setSampling(page, { temperature: 0, maxTokens: 32 });
    const response = await ask(page, 'Tell me about the sea');
    await waitForStatus(page, 'done');
    const { id, usage } = await readStream(response);
    const answer = lastAnswer(page);
    expect(await answer.getAttribute('data-completion-id')).toBe(id);
    // The lookup has finished once "measuring…" is gone (numbers, or "no server metrics").
    await page.waitForFunction(() => !document.querySelector('[data-testid=metrics]')?.textContent?.includes('measuring'));
    await shot(page, 'answer-dark');

    const snapshot = await api<MetricsSnapshot>(server.apiUrl, '/metrics/cache');
    const entry = snapshot.recent.find((r) => r.id === id);
    expect(
      entry,
      `/metrics/cache recent[] has no entry with id ${id}: the server must add \`id\` (the completion id) and \`itl_ms\` to each entry`,
    ).toBeDefined();
    if (!entry) return;
    expect(Array.isArray(entry.itl_ms), 'recent[].itl_ms must be an array of inter-token latencies (ms)').toBe(true);

    await answer.locator('[data-metric="ttft"]').waitFor();
    const metric = (name: string) => answer.locator(`[data-metric="${name}"]`);
    expect(Number(await metric('ttft').getAttribute('data-value'))).toBe(entry.ttft_ms);
    expect(await metric('ttft').innerText()).toBe(`TTFT ${formatMs(entry.ttft_ms)} ms`);
    expect(Number(await metric('tokens').getAttribute('data-in'))).toBe(entry.tokens_in);
    expect(Number(await metric('tokens').getAttribute('data-out'))).toBe(entry.tokens_out);
    expect(await metric('tokens').innerText()).toBe(`${entry.tokens_in} in · ${entry.tokens_out} out`);
    const rate = tokensPerSecond({ ttftMs: entry.ttft_ms, tokensIn: entry.tokens_in, tokensOut: entry.tokens_out, itlMs: entry.itl_ms ?? [] });
    expect(await metric('tps').innerText()).toBe(`${formatRate(rate)} tok/s`);
    // The engine and the stream agree on the token counts too.
    expect([entry.tokens_in, entry.tokens_out]).toEqual([usage.prompt_tokens, usage.completion_tokens]);
    if ((entry.itl_ms ?? []).length > 1) {
      expect(Number(await answer.getByTestId('sparkline').getAttribute('data-points'))).toBe(entry.itl_ms!.length);
    }
    // Speculative decoding's drafts (with `--speculative`, RMLX_SPECULATIVE): shown when there were any.
    const drafts = draftAcceptance(entry.draft_tokens, entry.accepted_tokens);
    expect(await metric('drafts').count()).toBe(drafts ? 1 : 0);
    if (drafts) expect(await metric('drafts').innerText()).toBe(formatDrafts(drafts));
  });

  it('plots that request on the dashboard: its last TTFT point is the /metrics/cache entry', async () => {
    const page = await open();
    await pickModel(page, 'qwen3-tiny');
    await setSampling(page, { temperature: 0, maxTokens: 16 });
    const response = await ask(page, 'Count to five');
    await waitForStatus(page, 'done');
    const { id } = await readStream(response);
    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Dashboard' }).click();
    const chart = page.getByTestId('chart-ttft');
    await page.waitForFunction((want) => document.querySelector('[data-testid=chart-ttft]')?.getAttribute('data-last-id') === want, id);
    const snapshot = await api<MetricsSnapshot>(server.apiUrl, '/metrics/cache');
    const entry = snapshot.recent.find((r) => r.id === id);
    expect(entry, `/metrics/cache has no entry for ${id}`).toBeDefined();
    expect(Number(await chart.getAttribute('data-last-ttft'))).toBe(entry!.ttft_ms);
    expect(await page.locator('.chart canvas').count()).toBe(9);
    await shot(page, 'dashboard-real');
  });

  it('shows the models and offers downloads (the server has the admin routes)', async () => {
    const page = await open();
    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Models' }).click();
    await page.locator('tr[data-model-id="qwen3-tiny"]').waitFor();
    expect(await page.locator('tr[data-model-id="qwen3-vl-tiny"]').count()).toBe(1);
    const admin = await fetch(`${server.apiUrl}/admin/downloads`);
    expect(admin.ok).toBe(true);
    expect(await page.getByTestId('downloads-unsupported').count()).toBe(0);
    expect(await page.getByLabel('Repository').isDisabled()).toBe(false);
    await shot(page, 'models-real');
  });

  it('sends dropped and pasted pictures to the vision model; a mirrored picture changes the answer', async () => {
    const page = await open();
    await pickModel(page, 'qwen3-vl-tiny');
    await setSampling(page, { temperature: 0, maxTokens: 16 });

    // Text only: the baseline prompt length.
    const textResponse = await ask(page, question);
    await waitForStatus(page, 'done');
    const textOnly = await readStream(textResponse);

    // Dropped picture, in a new chat (model and sampling carry over).
    await page.getByRole('button', { name: 'New chat' }).click();
    await dropImage(page, gradient);
    await page.locator('ul[aria-label="Attached images"] img').first().waitFor();
    expect(await attachedCount(page)).toBe(1);
    await shot(page, 'image-attached');
    const dropResponse = await ask(page, question);
    await waitForStatus(page, 'done');
    const dropped = { ...(await readStream(dropResponse)), text: await liveAnswer(page) };
    // The original bytes went out untouched (the picture is far below the pixel budget).
    const sent = dropResponse.request().postDataJSON() as { messages: { content: unknown }[]; temperature: number };
    expect(sent.temperature).toBe(0);
    expect(JSON.stringify(sent.messages.at(-1)?.content)).toContain(`data:image/png;base64,${readFileSync(gradient).toString('base64')}`);
    await page.locator('li.message.user img').first().waitFor();
    await page.waitForFunction(() => !document.querySelector('[data-testid=metrics]')?.textContent?.includes('measuring'));
    await shot(page, 'chat-with-image');

    // Pasted mirror image, in another chat.
    await page.getByRole('button', { name: 'New chat' }).click();
    await pasteImage(page, mirror);
    await page.locator('ul[aria-label="Attached images"] img').first().waitFor();
    const pasteResponse = await ask(page, question);
    await waitForStatus(page, 'done');
    const pasted = { ...(await readStream(pasteResponse)), text: await liveAnswer(page) };

    // The server, asked directly, counts the same prompt: the picture's tokens reached the model.
    const direct = await api<Completion>(server.apiUrl, '/v1/chat/completions', {
      model: 'qwen3-vl-tiny', max_tokens: 1, temperature: 0,
      messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: `data:image/png;base64,${readFileSync(gradient).toString('base64')}` } }, { type: 'text', text: question }] }],
    });
    const imageTokens = dropped.usage.prompt_tokens - textOnly.usage.prompt_tokens;
    expect(imageTokens).toBeGreaterThan(0);
    expect(dropped.usage.prompt_tokens).toBe(direct.usage.prompt_tokens);
    expect(pasted.usage.prompt_tokens).toBe(dropped.usage.prompt_tokens);
    // Greedy decoding: only the picture differs, so the answers differing means the model saw it.
    expect(pasted.text).not.toBe(dropped.text);
  });

  it('removes an attached picture before sending', async () => {
    const page = await open();
    await dropImage(page, gradient);
    await pasteImage(page, mirror);
    await page.locator('ul[aria-label="Attached images"] img').nth(1).waitFor();
    await page.getByRole('button', { name: `Remove ${path.basename(gradient)}` }).click();
    expect(await attachedCount(page)).toBe(1);
    expect(await page.locator('ul[aria-label="Attached images"] img').getAttribute('alt')).toBe(path.basename(mirror));
  });

  it('Esc stops a generation; the engine has nothing in flight afterwards', async () => {
    const request = { model: 'qwen3-vl-tiny', temperature: 0, max_tokens: 4000, messages: [{ role: 'user', content: 'Write an essay' }] };
    // Greedy is deterministic: this prompt must run long enough to be stopped half way.
    const full = await api<Completion>(server.apiUrl, '/v1/chat/completions', request);
    expect(full.usage.completion_tokens, 'the fixture answer got short; pick another prompt for the Stop test').toBeGreaterThan(1000);

    const page = await open();
    await pickModel(page, 'qwen3-vl-tiny');
    await setSampling(page, { temperature: 0, maxTokens: 4000 });
    await ask(page, 'Write an essay');
    await page.waitForFunction(() => {
      const answer = document.querySelector('li.message.assistant[data-status="streaming"] [data-testid=answer]');
      return (answer?.textContent ?? '').trim().length > 0;
    });
    await page.keyboard.press('Escape');
    await waitForStatus(page, 'stopped');
    const partial = await lastAnswer(page).getByTestId('answer').innerText();
    expect(partial.length).toBeLessThan(full.choices[0].message.content.length);
    expect(await page.getByRole('button', { name: 'Send message' }).isVisible()).toBe(true);

    let inFlight = -1;
    for (let attempt = 0; attempt < 50; attempt++) {
      inFlight = (await api<MetricsSnapshot>(server.apiUrl, '/metrics/cache')).in_flight;
      if (inFlight === 0) break;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    expect(inFlight).toBe(0);
  });
});
