// The Models view against a real `rmlx serve` whose downloads come from the imitation hub
// (crates/rmlx-hub/examples/test_hub.rs serving tests/fixtures/qwen3-tiny as test/qwen3-tiny):
// a download through the page lands verified on disk, pauses and resumes to identical bytes,
// loads, answers like the model it was copied from, unloads, and is deleted after a confirmation.

import { cpSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import type { Browser, Page } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { api, artifactsDir, launchBrowser, openApp } from './browser';
import { fixturesDir, skipReason, startHub, startServer, type RunningHub, type RunningServer } from './server';

const REPO = 'test/qwen3-tiny';
const source = path.join(fixturesDir, 'qwen3-tiny');

interface Completion {
  choices: { message: { content: string } }[];
}

function filesBelow(dir: string): string[] {
  return readdirSync(dir, { recursive: true, withFileTypes: true })
    .filter((entry) => entry.isFile())
    .map((entry) => path.relative(dir, path.join(entry.parentPath, entry.name)))
    .sort();
}

describe.skipIf(skipReason !== null)('the Models view against rmlx serve and the imitation hub', () => {
  let hub: RunningHub;
  let server: RunningServer;
  let browser: Browser;
  let models: string;

  beforeAll(async () => {
    mkdirSync(artifactsDir, { recursive: true });
    models = mkdtempSync(path.join(tmpdir(), 'rmlx-e2e-downloads-'));
    // Slow enough to pause mid-file even on a busy machine: 16 KiB every 40 ms puts the
    // fixture's ~1 MB of weights at ~3 s, against the page's 500 ms polling.
    hub = await startHub({ [REPO]: source }, { trickleMs: 40 });
    server = await startServer({ modelsDir: models, hubUrl: hub.url });
    browser = await launchBrowser();
  });

  afterAll(async () => {
    await browser?.close();
    await server?.stop();
    await hub?.stop();
    if (models) rmSync(models, { recursive: true, force: true });
  });

  async function modelsPage(): Promise<Page> {
    const page = await openApp(browser, server.url);
    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Models' }).click();
    await page.locator('tr[data-model-id="qwen3-tiny"]').waitFor();
    return page;
  }

  it('downloads, pauses, resumes, loads, chats with, unloads and deletes a model', async () => {
    const page = await modelsPage();
    await page.getByLabel('Repository').fill(REPO);
    await page.getByRole('button', { name: 'Download', exact: true }).click();
    const job = page.locator('li.job').filter({ hasText: REPO });
    await job.waitFor();
    await page.waitForFunction(() => Number(document.querySelector('li.job [data-testid=job-progress]')?.getAttribute('data-fraction')) > 0);

    await job.getByRole('button', { name: `Pause ${REPO}` }).click();
    await page.locator('li.job[data-state="paused"]').waitFor();
    const folder = path.join(models, 'test', 'qwen3-tiny');
    // Paused mid-file, the `.partial` stays for the resume; paused between two files there is
    // none, but config.json (always fetched last) has not arrived.
    const held = filesBelow(folder);
    expect(held.some((name) => name.endsWith('.partial')) || !held.some((name) => name.endsWith('config.json'))).toBe(true);
    // A paused download is not a model yet.
    expect(await page.locator(`tr[data-model-id="${REPO}"]`).count()).toBe(0);
    await page.screenshot({ path: path.join(artifactsDir, 'models-real-paused.png'), fullPage: true });

    await job.getByRole('button', { name: `Resume ${REPO}` }).click();
    await page.locator('li.job[data-state="done"]').waitFor({ timeout: 60_000 });
    const row = page.locator(`tr[data-model-id="${REPO}"]`);
    await row.waitFor();
    // Every file arrived whole: byte for byte the repository's.
    const expected = filesBelow(source);
    expect(filesBelow(folder)).toEqual(expected);
    for (const name of expected) expect(readFileSync(path.join(folder, name)).equals(readFileSync(path.join(source, name)))).toBe(true);
    expect(await row.innerText()).toContain('qwen3');

    await page.getByRole('button', { name: `Load ${REPO}` }).click();
    await page.getByRole('button', { name: `Unload ${REPO}` }).waitFor();
    await page.screenshot({ path: path.join(artifactsDir, 'models-real-downloaded.png'), fullPage: true });
    const ask = (model: string) =>
      api<Completion>(server.apiUrl, '/v1/chat/completions', {
        model, temperature: 0, max_tokens: 8, messages: [{ role: 'user', content: 'Name a colour.' }],
      });
    expect((await ask(REPO)).choices[0].message.content).toBe((await ask('qwen3-tiny')).choices[0].message.content);

    // Unload frees it; the list says so.
    await page.getByRole('button', { name: `Unload ${REPO}` }).click();
    await page.getByRole('button', { name: `Load ${REPO}` }).waitFor();
    const listing = await api<{ data: { id: string; loaded: boolean }[] }>(server.apiUrl, '/v1/models');
    expect(listing.data.find((m) => m.id === REPO)?.loaded).toBe(false);

    await page.getByRole('button', { name: `Delete ${REPO}` }).click();
    await page.getByRole('group', { name: `Delete ${REPO}?` }).getByRole('button', { name: 'Delete' }).click();
    await row.waitFor({ state: 'detached' });
    expect(existsSync(folder)).toBe(false);
    // The finished job clears from the list (the server forgets it).
    await job.getByRole('button', { name: `Clear ${REPO} from the list` }).click();
    await job.waitFor({ state: 'detached' });
    expect((await api<{ data: unknown[] }>(server.apiUrl, '/admin/downloads')).data).toEqual([]);
    // `--model` folders are not the server's to delete.
    expect(await page.getByRole('button', { name: 'Delete qwen3-tiny' }).isDisabled()).toBe(true);
    await page.context().close();
  });

  it('shows a release MoE checkpoint with its structure and loads it', async () => {
    // The tiny Qwen3-30B-A3B built from its published config (tests/fixtures/releases).
    const id = 'test/qwen3-30b-a3b';
    cpSync(path.join(fixturesDir, 'releases', 'qwen3-30b-a3b'), path.join(models, 'test', 'qwen3-30b-a3b'), { recursive: true });
    const page = await modelsPage();
    await page.getByRole('button', { name: 'Refresh' }).click();
    const row = page.locator(`tr[data-model-id="${id}"]`);
    await row.waitFor();
    expect(await row.locator('[data-testid=structure]').innerText()).toBe('MoE 16 experts top-8, untied lm_head');
    await page.getByRole('button', { name: `Load ${id}` }).click();
    await page.getByRole('button', { name: `Unload ${id}` }).waitFor();
    // Loading warms the model up (`rmlx serve --warm-up on`, the default): the row says how long.
    expect(await row.locator('[data-testid=warm-up]').innerText()).toMatch(/^warmed up in \d+(\.\d)? s$/);
    expect(await row.locator('[data-testid=load-time]').innerText()).toMatch(/^loaded in \d+(\.\d)? s$/);
    await page.screenshot({ path: path.join(artifactsDir, 'models-real-moe.png'), fullPage: true });
    await page.context().close();
  });

  it('says which checkpoints ship a draft head', async () => {
    // Qwen3.6-35B-A3B as released ships `mtp.*`; the mlx-community 4-bit conversion drops it.
    for (const name of ['qwen3.6-35b-a3b', 'qwen3.6-35b-a3b-4bit']) {
      cpSync(path.join(fixturesDir, 'releases', name), path.join(models, 'test', name), { recursive: true });
    }
    const page = await modelsPage();
    await page.getByRole('button', { name: 'Refresh' }).click();
    const headed = page.locator('tr[data-model-id="test/qwen3.6-35b-a3b"]');
    await headed.waitFor();
    expect(await headed.locator('[data-testid=draft-head]').innerText()).toBe('MTP draft head');
    const converted = page.locator('tr[data-model-id="test/qwen3.6-35b-a3b-4bit"]');
    await converted.waitFor();
    expect(await converted.locator('[data-testid=draft-head]').count()).toBe(0);
    await headed.screenshot({ path: path.join(artifactsDir, 'models-draft-head.png') });
    await page.context().close();
  });
});
