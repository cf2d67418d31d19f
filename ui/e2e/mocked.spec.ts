// The UI against a scripted server (page.route), so rendering can be checked without a build of
// rmlx: markdown and code in an answer, the metrics line and sparkline from a `/metrics/cache`
// entry that has the `id` and `itl_ms` fields of the contract, an error answer, light and dark.

import path from 'node:path';
import type { Browser, Page } from 'playwright-core';
import { describe, expect, it } from 'vitest';
import { artifactsDir, ask, dropImage, lastAnswer, waitForStatus, withHostedDist } from './browser';
import { fixturesDir } from './server';

const answer = [
  'Here is a **Rust** example with a `main` function:\n\n',
  '```rust\nfn main() {\n    let greeting = "hello";\n    println!("{greeting}, world");\n}\n```\n\n',
  '- fast\n- local\n\n<img src=x onerror="window.__xss = 1">',
];
const itl = [12.1, 11.8, 12.6, 14.2, 11.9, 25.3, 12.2, 12.0, 13.1, 12.4, 11.7, 12.9];
const entry = {
  id: 'chatcmpl-mock-1', model: 'qwen3-tiny', ttft_ms: 41.37, itl_p50_ms: 12.3, itl_ms: itl, tokens_in: 27, tokens_out: 13,
  draft_tokens: 8, accepted_tokens: 6, ended: 1,
};

async function scriptServer(page: Page, options: { fail?: boolean } = {}): Promise<void> {
  await page.route('**/v1/models', (route) =>
    route.fulfill({
      json: {
        object: 'list',
        data: [
          { id: 'qwen3-tiny', object: 'model', loaded: true, vision: false, context_length: 2048 },
          { id: 'qwen3-vl-tiny', object: 'model', loaded: true, vision: true, context_length: 262144 },
        ],
      },
    }),
  );
  await page.route('**/metrics/cache', (route) => route.fulfill({ json: { recent: [entry], in_flight: 0, queue_depth: 0 } }));
  await page.route('**/v1/chat/completions', (route) => {
    if (options.fail) {
      return route.fulfill({
        status: 400,
        json: { error: { message: 'prompt is 3000 tokens, the context is 2048', type: 'invalid_request_error', param: null, code: 'context_length_exceeded' } },
      });
    }
    const chunks = answer.map((content) => ({ id: entry.id, choices: [{ index: 0, delta: { content }, finish_reason: null }] }));
    chunks.push({ id: entry.id, choices: [{ index: 0, delta: {}, finish_reason: 'stop' }] } as never);
    const usage = { id: entry.id, choices: [], usage: { prompt_tokens: 27, completion_tokens: 13, total_tokens: 40 } };
    const body = [...chunks, usage].map((c) => `data: ${JSON.stringify(c)}\n\n`).join('') + 'data: [DONE]\n\n';
    return route.fulfill({ status: 200, headers: { 'content-type': 'text/event-stream' }, body });
  });
}

describe('rMLX UI against a scripted server', () => {
  let url: string;
  let browser: Browser;
  withHostedDist((hosted) => ({ url, browser } = hosted));

  for (const colorScheme of ['light', 'dark'] as const) {
    it(`renders markdown, code and the request's metrics (${colorScheme})`, async () => {
      const context = await browser.newContext({ viewport: { width: 1280, height: 820 }, colorScheme });
      const page = await context.newPage();
      await scriptServer(page);
      await page.goto(url);
      await page.waitForSelector('[data-testid=model-picker] option[value="qwen3-tiny"]', { state: 'attached' });
      await ask(page, 'Show me some Rust');
      await waitForStatus(page, 'done');
      const message = lastAnswer(page);
      await message.locator('[data-metric="ttft"]').waitFor();

      expect(await message.locator('pre code .hljs-keyword').first().innerText()).toBe('fn');
      expect(await page.evaluate(() => (window as { __xss?: number }).__xss)).toBeUndefined();
      expect(await message.locator('[data-metric="ttft"]').innerText()).toBe('TTFT 41.4 ms');
      // 13 tokens over the summed gaps.
      const rate = 13 / (itl.reduce((a, b) => a + b, 0) / 1000);
      expect(await message.locator('[data-metric="tps"]').innerText()).toBe(`${rate.toFixed(1)} tok/s`);
      expect(await message.locator('[data-metric="tokens"]').innerText()).toBe('27 in · 13 out');
      expect(await message.locator('[data-metric="drafts"]').innerText()).toBe('drafted 8 · kept 6 (75%)');
      expect(await message.getByTestId('sparkline').getAttribute('data-points')).toBe(String(itl.length));
      expect(await message.getByRole('img', { name: /Inter-token latency/ }).getAttribute('aria-label')).toContain('max 25.3 ms');

      // Accessible names of the controls the tests and screen readers rely on.
      for (const name of ['New chat', 'Chat settings', 'Attach images', 'Send message', 'Copy answer', 'Regenerate answer']) {
        expect(await page.getByRole('button', { name, exact: true }).count(), name).toBeGreaterThan(0);
      }
      await page.getByRole('button', { name: 'Chat settings' }).click();
      await page.screenshot({ path: path.join(artifactsDir, `answer-${colorScheme}-mocked.png`) });
      await context.close();
    });
  }

  it('edits, regenerates, renames, deletes, and keeps threads across a reload', async () => {
    const context = await browser.newContext({ viewport: { width: 1100, height: 700 } });
    const page = await context.newPage();
    await scriptServer(page);
    const sent: { messages: { role: string; content: unknown }[] }[] = [];
    page.on('request', (request) => {
      if (request.url().endsWith('/v1/chat/completions')) sent.push(request.postDataJSON());
    });
    await page.goto(url);
    await page.waitForSelector('[data-testid=model-picker] option[value="qwen3-tiny"]', { state: 'attached' });
    await ask(page, 'First question');
    await waitForStatus(page, 'done');

    await page.getByRole('button', { name: 'Regenerate answer' }).click();
    await page.waitForFunction(() => document.querySelectorAll('li.message').length === 2 && document.querySelector('li.message.assistant[data-status="done"]'));
    expect(sent).toHaveLength(2);
    expect(sent[1].messages).toEqual(sent[0].messages);

    await page.locator('li.message.user').hover();
    await page.getByRole('button', { name: 'Edit and resend' }).click();
    await page.getByLabel('Edit message').fill('Second version');
    await page.getByLabel('Edit message').press('Enter');
    await page.waitForFunction(() => document.querySelector('li.message.user .bubble')?.textContent === 'Second version');
    await waitForStatus(page, 'done');
    expect(await page.locator('li.message').count()).toBe(2);
    expect(sent[2].messages.at(-1)).toEqual({ role: 'user', content: 'Second version' });

    // The title followed the edited first question; rename it with the pencil, then add a chat and delete it.
    await page.getByRole('button', { name: 'Rename Second version' }).click();
    await page.getByLabel('New name for Second version').fill('Renamed chat');
    await page.getByLabel('New name for Second version').press('Enter');
    expect(await page.locator('.thread-title').allInnerTexts()).toEqual(['Renamed chat']);
    await page.getByRole('button', { name: 'New chat' }).click();
    await ask(page, 'Throwaway');
    await waitForStatus(page, 'done');
    await page.getByRole('button', { name: 'Delete Throwaway' }).click();
    await page.getByRole('group', { name: 'Delete Throwaway?' }).getByRole('button', { name: 'Delete' }).click();
    expect(await page.locator('.thread-title').allInnerTexts()).toEqual(['Renamed chat']);

    // Saved (debounced) to localStorage: a reload brings the conversation back.
    await page.waitForFunction(() => (localStorage.getItem('rmlx.threads') ?? '').includes('Renamed chat') && !(localStorage.getItem('rmlx.threads') ?? '').includes('Throwaway'));
    await page.reload();
    await page.locator('li.message.user .bubble').waitFor();
    expect(await page.locator('li.message.user .bubble').innerText()).toBe('Second version');
    expect(await page.locator('.chat-title').innerText()).toBe('Renamed chat');
    await context.close();
  });

  it('downscales a picture over the pixel budget; warns when the model cannot see', async () => {
    const context = await browser.newContext({ viewport: { width: 1100, height: 700 } });
    const page = await context.newPage();
    await scriptServer(page);
    await page.goto(url);
    await page.waitForSelector('[data-testid=model-picker] option[value="qwen3-tiny"]', { state: 'attached' });
    await page.getByRole('button', { name: 'Chat settings' }).click();
    await page.getByLabel('Pixel budget').fill('1000');
    await page.getByLabel('Pixel budget').press('Tab');
    await page.getByRole('button', { name: 'Close settings' }).click();

    // 80 x 100 = 8000 pixels > 1000: shrunk to 28 x 35 (980 pixels), same aspect ratio.
    await dropImage(page, path.join(fixturesDir, 'vision-images', 'noise_80x100.png'));
    await page.locator('.image-tray .thumb img').waitFor();
    expect(await page.locator('.image-tray .thumb-size').innerText()).toContain('28×35');
    // A loaded text model: the composer says so instead of sending.
    expect(await page.getByRole('alert').innerText()).toContain('qwen3-tiny cannot see pictures');
    expect(await page.getByRole('button', { name: 'Send message' }).isDisabled()).toBe(true);
    await page.getByLabel('Model', { exact: true }).selectOption('qwen3-vl-tiny');
    const request = page.waitForRequest((r) => r.url().endsWith('/v1/chat/completions'));
    await page.getByLabel('Message', { exact: true }).press('Enter');
    const body = (await request).postDataJSON() as { messages: { content: { type: string; image_url?: { url: string } }[] }[] };
    const url64 = body.messages[0].content[0].image_url!.url;
    expect(url64.startsWith('data:image/png;base64,')).toBe(true);
    const png = Buffer.from(url64.split(',')[1], 'base64');
    expect([png.readUInt32BE(16), png.readUInt32BE(20)]).toEqual([28, 35]); // IHDR width, height
    await context.close();
  });

  it('works from the keyboard: Shift+Enter newline, Enter sends, Esc closes settings', async () => {
    const context = await browser.newContext({ viewport: { width: 1100, height: 700 } });
    const page = await context.newPage();
    await scriptServer(page);
    let requests = 0;
    page.on('request', (request) => {
      if (request.url().endsWith('/v1/chat/completions')) requests++;
    });
    await page.goto(url);
    await page.waitForSelector('[data-testid=model-picker] option[value="qwen3-tiny"]', { state: 'attached' });
    const box = page.getByLabel('Message', { exact: true });
    await box.focus();
    await page.keyboard.type('line one');
    await page.keyboard.press('Shift+Enter');
    await page.keyboard.type('line two');
    expect(await box.inputValue()).toBe('line one\nline two');
    expect(requests).toBe(0);
    await page.keyboard.press('Enter');
    await waitForStatus(page, 'done');
    expect(requests).toBe(1);
    expect(await page.locator('li.message.user .bubble').innerText()).toBe('line one\nline two');

    await page.getByRole('button', { name: 'Chat settings' }).click();
    expect(await page.evaluate(() => document.activeElement?.id)).toBe('system-prompt');
    await page.keyboard.press('Escape');
    expect(await page.locator('#chat-settings').count()).toBe(0);
    expect(await page.evaluate(() => document.activeElement?.getAttribute('aria-label'))).toBe('Chat settings');
    await context.close();
  });

  it('shows a server error under the question, with its code', async () => {
    const context = await browser.newContext({ viewport: { width: 1000, height: 600 } });
    const page = await context.newPage();
    await scriptServer(page, { fail: true });
    await page.goto(url);
    await page.waitForSelector('[data-testid=model-picker] option[value="qwen3-tiny"]', { state: 'attached' });
    await ask(page, 'A very long prompt');
    await waitForStatus(page, 'error');
    expect(await lastAnswer(page).getByRole('alert').innerText()).toContain('context_length_exceeded');
    await page.screenshot({ path: path.join(artifactsDir, 'error-light-mocked.png') });
    await context.close();
  });
});
