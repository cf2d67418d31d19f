// Helpers that drive the UI the way a person would, plus direct API calls for cross-checks.

import { mkdirSync, readFileSync } from 'node:fs';
import type http from 'node:http';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { chromium, type Browser, type Page, type Response } from 'playwright-core';
import { afterAll, beforeAll } from 'vitest';
import { hostDist, uiDir } from './server';

export const artifactsDir = path.join(uiDir, 'e2e', 'artifacts');

/**
 * For a describe block whose tests script the API themselves: dist/ on a loopback port and one
 * browser, started in its beforeAll (handed over through `ready`) and closed in its afterAll.
 */
export function withHostedDist(ready: (hosted: { url: string; browser: Browser }) => void): void {
  let host: http.Server | undefined;
  let browser: Browser | undefined;
  beforeAll(async () => {
    mkdirSync(artifactsDir, { recursive: true });
    host = await hostDist();
    browser = await launchBrowser();
    ready({ url: `http://127.0.0.1:${(host.address() as AddressInfo).port}`, browser });
  });
  afterAll(async () => {
    await browser?.close();
    await new Promise((resolve) => host?.close(resolve));
  });
}

export function launchBrowser(): Promise<Browser> {
  return chromium.launch({
    executablePath: process.env.CHROMIUM_BIN ?? '/usr/bin/chromium',
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu'],
  });
}

export async function openApp(browser: Browser, url: string, colorScheme: 'light' | 'dark' = 'light'): Promise<Page> {
  const context = await browser.newContext({ viewport: { width: 1280, height: 820 }, colorScheme });
  const page = await context.newPage();
  page.on('pageerror', (error) => process.stderr.write(`page error: ${error.message}\n`));
  await page.goto(url);
  // The model list has arrived when the picker offers the fixture models.
  await page.waitForSelector('[data-testid=model-picker] option[value="qwen3-tiny"]', { state: 'attached' });
  return page;
}

export async function pickModel(page: Page, model: string): Promise<void> {
  await page.getByLabel('Model', { exact: true }).selectOption(model);
}

/** Opens the settings panel, sets temperature / max tokens, closes it. */
export async function setSampling(page: Page, sampling: { temperature?: number; maxTokens?: number }): Promise<void> {
  await page.getByRole('button', { name: 'Chat settings' }).click();
  if (sampling.temperature !== undefined) {
    await page.getByLabel('Temperature').fill(String(sampling.temperature));
    await page.getByLabel('Temperature').press('Tab');
  }
  if (sampling.maxTokens !== undefined) {
    await page.getByLabel('Max tokens').fill(String(sampling.maxTokens));
    await page.getByLabel('Max tokens').press('Tab');
  }
  await page.getByRole('button', { name: 'Close settings' }).click();
}

export function composer(page: Page) {
  return page.getByRole('textbox', { name: 'Message', exact: true });
}

/** Types a question, presses Enter, and returns the chat request's response (to read its body later). */
export async function ask(page: Page, text: string): Promise<Response> {
  const response = page.waitForResponse((r) => r.url().endsWith('/v1/chat/completions') && r.request().method() === 'POST');
  await composer(page).fill(text);
  await composer(page).press('Enter');
  return response;
}

export function lastAnswer(page: Page) {
  return page.locator('li.message.assistant').last();
}

export async function waitForStatus(page: Page, status: 'done' | 'stopped' | 'streaming' | 'error'): Promise<void> {
  await page.locator(`li.message.assistant[data-status="${status}"]`).last().waitFor({ timeout: 60_000 });
}

export interface StreamSummary {
  id: string;
  usage: { prompt_tokens: number; completion_tokens: number };
}

/**
 * The id and usage from the SSE body the server sent (after it finished). Not the text: Chrome
 * keeps a charset-less text/event-stream body as Windows-1252, so read answers from the page.
 */
export async function readStream(response: Response): Promise<StreamSummary> {
  const body = await response.text();
  let id = '';
  let usage = { prompt_tokens: -1, completion_tokens: -1 };
  for (const line of body.split('\n')) {
    if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
    const chunk = JSON.parse(line.slice(6));
    id ||= chunk.id;
    if (chunk.usage) usage = chunk.usage;
  }
  return { id, usage };
}

/** The streamed answer as text, from the aria-live region (raw text, not rendered markdown). */
export async function liveAnswer(page: Page): Promise<string> {
  return (await page.getByTestId('live-answer').textContent()) ?? '';
}

function filePayload(file: string, mime: string) {
  return { base64: readFileSync(file).toString('base64'), name: path.basename(file), mime };
}

/** A real drop: a DataTransfer with the file, dispatched as dragenter/dragover/drop on the chat. */
export async function dropImage(page: Page, file: string, mime = 'image/png'): Promise<void> {
  await page.evaluate(({ base64, name, mime }) => {
    const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
    const data = new DataTransfer();
    data.items.add(new File([bytes], name, { type: mime }));
    const target = document.querySelector('main.chat');
    if (!target) throw new Error('no chat to drop on');
    for (const type of ['dragenter', 'dragover', 'drop']) {
      target.dispatchEvent(new DragEvent(type, { bubbles: true, cancelable: true, dataTransfer: data }));
    }
  }, filePayload(file, mime));
}

/** A clipboard paste of an image file into the message box. */
export async function pasteImage(page: Page, file: string, mime = 'image/png'): Promise<void> {
  await page.evaluate(({ base64, name, mime }) => {
    const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
    const data = new DataTransfer();
    data.items.add(new File([bytes], name, { type: mime }));
    const input = document.getElementById('composer-input');
    if (!input) throw new Error('no message box');
    input.dispatchEvent(new ClipboardEvent('paste', { bubbles: true, cancelable: true, clipboardData: data }));
  }, filePayload(file, mime));
}

export async function attachedCount(page: Page): Promise<number> {
  return page.locator('ul[aria-label="Attached images"] img').count();
}

export async function api<T>(baseUrl: string, route: string, body?: unknown): Promise<T> {
  const response = await fetch(`${baseUrl}${route}`, body === undefined ? {} : {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  if (!response.ok) throw new Error(`${route}: HTTP ${response.status} ${await response.text()}`);
  return (await response.json()) as T;
}
