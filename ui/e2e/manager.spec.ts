// The Models, Dashboard and Settings views against a scripted server (page.route plays the
// contract of docs/MODELS-API.md and docs/SERVER.md), and the desktop app's Settings against a
// scripted Tauri IPC (a stand-in `window.__TAURI_INTERNALS__`). Screenshots, light and dark.

import path from 'node:path';
import type { Browser, Page, Route } from 'playwright-core';
import { describe, expect, it } from 'vitest';
import type { DownloadJob, MetricsSnapshot, ModelInfo, RecentRequest } from '../src/lib/transport/types';
import { artifactsDir, withHostedDist } from './browser';

const GB = 1024 ** 3;
const modelList: ModelInfo[] = [
  { id: 'qwen3-tiny', object: 'model', loaded: true, vision: false, context_length: 2048, size_bytes: 1_310_720, model_type: 'qwen3', quantization: null, source: 'model', deletable: false, fits: 'yes' },
  { id: 'mlx-community/Qwen3-4B-4bit', object: 'model', loaded: false, vision: false, context_length: 40960, size_bytes: 2.26 * GB, model_type: 'qwen3', quantization: { bits: 4, group_size: 64, mode: 'affine' }, source: 'models_dir', deletable: true, fits: 'tight', max_context_fits: 32768 },
  { id: 'mlx-community/Qwen3-VL-32B-Instruct-8bit', object: 'model', loaded: false, vision: true, context_length: 262144, size_bytes: 35.1 * GB, model_type: 'qwen3_vl', quantization: { bits: 8, group_size: 64, mode: 'affine' }, source: 'hf_cache', deletable: true, fits: 'no' },
];
const memory = { total_bytes: 32 * GB, available_bytes: 19.5 * GB };

interface Sent {
  method: string;
  path: string;
  body: unknown;
  auth: string | null;
}

/** A contract-shaped server with one download job that advances on every list. */
function scriptedServer(options: { admin?: boolean; failDownload?: boolean; ranks?: boolean } = {}) {
  const admin = options.admin ?? true;
  const sent: Sent[] = [];
  let models = modelList.map((m) => ({ ...m }));
  let job: DownloadJob | null = null;
  let recent: RecentRequest[] = [];
  let polls = 0;
  // Speculative decoding's counters: some tokens drafted and kept on most polls.
  let drafted = 0;
  let kept = 0;
  const notFound = (route: Route, p: string) =>
    route.fulfill({ status: 404, json: { error: { message: `no route for ${p}`, type: 'invalid_request_error', param: null, code: 'not_found' } } });

  const advance = () => {
    if (!job || job.state !== 'running') return;
    const [a, b] = job.files;
    if (options.failDownload && a.bytes_done >= (a.size ?? 0)) {
      job = { ...job, state: 'failed', error: 'sha256 of model.safetensors does not match the hub (expected 3f1a…, got 77c2…)' };
      return;
    }
    const step = 400_000_000;
    const fa = Math.min(a.size ?? 0, a.bytes_done + step);
    const fb = fa >= (a.size ?? 0) ? Math.min(b.size ?? 0, b.bytes_done + step) : b.bytes_done;
    const files = [
      { ...a, bytes_done: fa, state: fa >= (a.size ?? 0) ? ('done' as const) : ('running' as const) },
      { ...b, bytes_done: fb, state: fb >= (b.size ?? 0) ? ('done' as const) : fa >= (a.size ?? 0) ? ('running' as const) : ('pending' as const) },
    ];
    const done = files.every((f) => f.state === 'done');
    job = { ...job, files, bytes_done: fa + fb, state: done ? 'done' : 'running', model_id: done ? job.repo : null };
    if (done) models = [...models, { id: job.repo, object: 'model', loaded: false, vision: false, context_length: 32768, size_bytes: job.bytes_total ?? 0, model_type: 'llama', quantization: { bits: 4, group_size: 64, mode: 'affine' }, source: 'models_dir', deletable: true, fits: 'yes' }];
  };

  async function handle(route: Route): Promise<void> {
    const request = route.request();
    const url = new URL(request.url());
    const p = url.pathname;
    const method = request.method();
    if (!p.startsWith('/v1/') && !p.startsWith('/admin/') && !p.startsWith('/metrics')) return route.continue();
    const body = request.postData() ? request.postDataJSON() : undefined;
    sent.push({ method, path: p, body, auth: request.headers()['authorization'] ?? null });

    if (p === '/metrics/cache') {
      polls++;
      drafted += [0, 24, 16, 32, 8][polls % 5];
      kept += [0, 20, 9, 30, 2][polls % 5];
      const snapshot: MetricsSnapshot = {
        models: [{ model_id: 'qwen3-tiny', prefix_cache_hits: 2 + polls, disk_cache_hits: 1 + Math.floor(polls / 2), prefix_cache_misses: 3, draft_tokens: drafted, accepted_tokens: kept }],
        recent, in_flight: polls % 3 === 0 ? 1 : 0, queue_depth: polls % 5 === 0 ? 1 : 0,
        kv_cache_bytes: (polls % 4) * 2_000_000, active_memory_bytes: 350_000_000 + polls * 3_000_000, peak_memory_bytes: 420_000_000 + polls * 3_000_000,
        disk_cache: {
          path: '/Users/me/.rmlx/cache', budget_bytes: 1_200_000_000, bytes: 600_000_000 + polls * 20_000_000, files: 40 + polls,
          read_bytes: 150_000_000 + Math.floor(polls / 2) * 40_000_000, read_ms: 90, written_bytes: 200_000_000 + polls * 20_000_000,
          evicted_files: 0, evicted_bytes: 0, writing_stopped: false,
        },
        ...(options.ranks
          ? {
              ranks: [
                { rank: 0, endpoint: '192.168.2.1:32323', layers: [0, 30] as [number, number], last_heartbeat_ms: null },
                { rank: 1, endpoint: '192.168.2.2:32324', layers: [30, 64] as [number, number], last_heartbeat_ms: 180 + (polls % 4) * 90 },
              ],
            }
          : {}),
      };
      return route.fulfill({ json: snapshot });
    }
    if (p === '/v1/models' && method === 'GET') return route.fulfill({ json: admin ? { object: 'list', data: models, memory } : { object: 'list', data: models.map(({ id, object, loaded, vision, context_length }) => ({ id, object, loaded, vision, context_length })) } });
    const modelAction = /^\/v1\/models\/([^/]+)(?:\/(load|unload))?$/.exec(p);
    if (modelAction) {
      const id = decodeURIComponent(modelAction[1]);
      if (modelAction[2] && method === 'POST') {
        models = models.map((m) => (m.id === id ? { ...m, loaded: modelAction[2] === 'load' } : m));
        return route.fulfill({ json: models.find((m) => m.id === id) });
      }
      if (method === 'DELETE' && admin) {
        models = models.filter((m) => m.id !== id);
        return route.fulfill({ json: { id, deleted: true } });
      }
      return route.fulfill({ status: 405, body: '' });
    }
    if (!admin) return notFound(route, p);
    if (p === '/admin/downloads' && method === 'POST') {
      const { repo, revision } = body as { repo: string; revision?: string };
      job = {
        id: 'dl-1', repo, revision: revision ?? 'main', state: 'running', bytes_done: 0, bytes_total: 1_900_000_000, error: null, model_id: null,
        files: [
          { name: 'model.safetensors', size: 1_200_000_000, bytes_done: 0, state: 'running' },
          { name: 'model-00002-of-00002.safetensors', size: 700_000_000, bytes_done: 0, state: 'pending' },
        ],
      };
      return route.fulfill({ status: 202, json: job });
    }
    if (p === '/admin/downloads' && method === 'GET') {
      advance();
      return route.fulfill({ json: { data: job ? [job] : [] } });
    }
    const jobAction = /^\/admin\/downloads\/([^/]+)(?:\/(pause|resume))?$/.exec(p);
    if (jobAction && job) {
      if (jobAction[2] === 'pause') job = { ...job, state: 'paused' };
      else if (jobAction[2] === 'resume') job = { ...job, state: 'running' };
      else if (method === 'DELETE') job = { ...job, state: 'cancelled', files: job.files.map((f) => ({ ...f, bytes_done: 0 })) };
      return route.fulfill({ json: job });
    }
    return notFound(route, p);
  }

  return {
    sent,
    handle,
    setRecent(entries: RecentRequest[]) {
      recent = entries;
    },
    pauseProgress() {
      if (job) job = { ...job, state: 'paused' };
    },
  };
}

describe('Models, Dashboard and Settings against a scripted server', () => {
  let url: string;
  let browser: Browser;
  withHostedDist((hosted) => ({ url, browser } = hosted));

  async function open(view: string, server: ReturnType<typeof scriptedServer>, colorScheme: 'light' | 'dark' = 'light', height = 860): Promise<Page> {
    const context = await browser.newContext({ viewport: { width: 1280, height }, colorScheme });
    const page = await context.newPage();
    page.on('pageerror', (error) => process.stderr.write(`page error: ${error.message}\n`));
    await context.route('**/*', (route) => server.handle(route));
    await page.goto(`${url}/#/${view}`);
    return page;
  }

  it('navigates between the views from the keyboard', async () => {
    const page = await open('chat', scriptedServer());
    const nav = page.getByRole('navigation', { name: 'Main' });
    expect(await nav.getByRole('link').allInnerTexts()).toEqual(['Chat', 'Models', 'Dashboard', 'Settings']);
    expect(await nav.getByRole('link', { name: 'Chat' }).getAttribute('aria-current')).toBe('page');
    await nav.getByRole('link', { name: 'Models' }).focus();
    await page.keyboard.press('Enter');
    await page.getByRole('heading', { name: 'Models', level: 1 }).waitFor();
    expect(await nav.getByRole('link', { name: 'Models' }).getAttribute('aria-current')).toBe('page');
    await page.keyboard.press('Tab');
    await page.keyboard.press('Enter');
    await page.getByRole('heading', { name: 'Dashboard', level: 1 }).waitFor();
    await page.goBack();
    await page.getByRole('heading', { name: 'Models', level: 1 }).waitFor();
    await page.context().close();
  });

  for (const colorScheme of ['light', 'dark'] as const) {
    it(`lists models with their fit, and runs a download with pause, resume, cancel (${colorScheme})`, async () => {
      const server = scriptedServer();
      const page = await open('models', server, colorScheme);
      const rows = page.locator('tbody tr');
      await rows.first().waitFor();
      expect(await rows.count()).toBe(3);
      expect(await page.getByTestId('memory').innerText()).toBe('Memory: 19.5 GB free of 32.0 GB');
      expect(await page.getByTestId('fits').allInnerTexts()).toEqual(['Fits', 'Tight', 'Too big']);
      // Only a model whose whole context does not fit says how much does.
      expect(await page.getByTestId('fit-context').allInnerTexts()).toEqual(['up to 32K context']);
      const big = page.locator('tr[data-model-id="mlx-community/Qwen3-VL-32B-Instruct-8bit"]');
      expect(await big.locator('td').allInnerTexts()).toEqual(['qwen3_vl', '35.1 GB', '8-bit · g64', '256K', 'Yes', 'Too big\nNeeds more memory than is available', 'Not loaded', 'Load Delete']);
      // `--model` folders cannot be deleted.
      expect(await page.getByRole('button', { name: 'Delete qwen3-tiny' }).isDisabled()).toBe(true);

      // A bad repo id is refused before any request.
      await page.getByLabel('Repository').fill('not-a-repo');
      await page.getByRole('button', { name: 'Download', exact: true }).click();
      expect(await page.locator('#download-repo-error').innerText()).toContain('not a repository id');
      expect(server.sent.filter((s) => s.path === '/admin/downloads' && s.method === 'POST')).toEqual([]);

      await page.getByLabel('Repository').fill('mlx-community/Llama-3.2-3B-Instruct-4bit');
      await page.getByLabel('Revision (optional)').fill('main');
      await page.getByRole('button', { name: 'Download', exact: true }).click();
      const job = page.locator('li.job[data-job-id="dl-1"]');
      await job.waitFor();
      expect(server.sent.find((s) => s.path === '/admin/downloads' && s.method === 'POST')?.body).toEqual({ repo: 'mlx-community/Llama-3.2-3B-Instruct-4bit', revision: 'main' });
      // Progress moves with the polls (500 ms while the job runs).
      await page.waitForFunction(() => Number(document.querySelector('li.job [data-testid=job-progress]')?.getAttribute('data-fraction')) > 0.2);
      const fraction = Number(await job.getByTestId('job-progress').getAttribute('data-fraction'));
      expect(fraction).toBeGreaterThan(0.2);
      expect(fraction).toBeLessThan(1);
      expect(await job.locator('li.file progress').count()).toBe(2);

      await job.getByRole('button', { name: 'Pause mlx-community/Llama-3.2-3B-Instruct-4bit' }).click();
      await page.locator('li.job[data-state="paused"]').waitFor();
      if (colorScheme === 'dark') {
        await page.screenshot({ path: path.join(artifactsDir, 'models-dark.png'), fullPage: true });
        await page.context().close();
        return;
      }
      await page.screenshot({ path: path.join(artifactsDir, 'models-light.png'), fullPage: true });
      await job.getByRole('button', { name: 'Resume mlx-community/Llama-3.2-3B-Instruct-4bit' }).click();
      await page.locator('li.job[data-state="running"]').waitFor();
      await job.getByRole('button', { name: 'Cancel mlx-community/Llama-3.2-3B-Instruct-4bit' }).click();
      await page.locator('li.job[data-state="cancelled"]').waitFor();
      expect(server.sent.filter((s) => s.path.startsWith('/admin/downloads/')).map((s) => `${s.method} ${s.path}`)).toEqual([
        'POST /admin/downloads/dl-1/pause',
        'POST /admin/downloads/dl-1/resume',
        'DELETE /admin/downloads/dl-1',
      ]);
      // Delete asks first; Cancel sends nothing.
      await page.getByRole('button', { name: 'Delete mlx-community/Qwen3-4B-4bit' }).click();
      const confirm = page.getByRole('group', { name: 'Delete mlx-community/Qwen3-4B-4bit?' });
      await confirm.getByRole('button', { name: 'Cancel' }).click();
      expect(server.sent.filter((s) => s.method === 'DELETE' && s.path.startsWith('/v1/'))).toEqual([]);
      await page.getByRole('button', { name: 'Delete mlx-community/Qwen3-4B-4bit' }).click();
      await confirm.getByRole('button', { name: 'Delete' }).click();
      await page.locator('tr[data-model-id="mlx-community/Qwen3-4B-4bit"]').waitFor({ state: 'detached' });
      expect(server.sent.filter((s) => s.method === 'DELETE' && s.path.startsWith('/v1/')).map((s) => s.path)).toEqual(['/v1/models/mlx-community%2FQwen3-4B-4bit']);
      // Load sends the load route.
      await page.getByRole('button', { name: 'Load mlx-community/Qwen3-VL-32B-Instruct-8bit' }).click();
      await page.getByRole('button', { name: 'Unload mlx-community/Qwen3-VL-32B-Instruct-8bit' }).waitFor();
      expect(server.sent.some((s) => s.method === 'POST' && s.path === '/v1/models/mlx-community%2FQwen3-VL-32B-Instruct-8bit/load')).toBe(true);
      await page.context().close();
    });
  }

  it('refreshes the model list when a download is done', async () => {
    const server = scriptedServer();
    const page = await open('models', server);
    await page.locator('tbody tr').first().waitFor();
    await page.getByLabel('Repository').fill('org/fresh-model');
    await page.getByRole('button', { name: 'Download', exact: true }).click();
    await page.locator('li.job[data-state="done"]').waitFor({ timeout: 20_000 });
    await page.locator('tr[data-model-id="org/fresh-model"]').waitFor();
    expect(await page.locator('li.job[data-state="done"] progress').first().getAttribute('data-fraction')).toBe('1');
    await page.context().close();
  });

  it('shows a failed download with its reason', async () => {
    const server = scriptedServer({ failDownload: true });
    const page = await open('models', server);
    await page.getByLabel('Repository').fill('org/broken');
    await page.getByRole('button', { name: 'Download', exact: true }).click();
    const failed = page.locator('li.job[data-state="failed"]');
    await failed.waitFor({ timeout: 20_000 });
    expect(await failed.getByRole('alert').innerText()).toBe('Download failed: sha256 of model.safetensors does not match the hub (expected 3f1a…, got 77c2…)');
    expect(await failed.getByRole('button').count()).toBe(0);
    await page.screenshot({ path: path.join(artifactsDir, 'models-failed-light.png'), fullPage: true });
    await page.context().close();
  });

  it('says so when the server has no model manager routes', async () => {
    const server = scriptedServer({ admin: false });
    const page = await open('models', server);
    await page.getByTestId('downloads-unsupported').waitFor();
    expect(await page.getByTestId('downloads-unsupported').innerText()).toContain('This server has no download support');
    expect(await page.getByLabel('Repository').isDisabled()).toBe(true);
    expect(await page.getByTestId('memory').innerText()).toBe('Memory: not reported by this server');
    expect(await page.getByRole('button', { name: 'Delete qwen3-tiny' }).getAttribute('title')).toBe('This server cannot delete models');
    await page.context().close();
  });

  for (const colorScheme of ['light', 'dark'] as const) {
    it(`draws the dashboard and follows the newest request (${colorScheme})`, async () => {
      // Served across two machines: the dashboard lists them with their heartbeats.
      const server = scriptedServer({ ranks: true });
      const now = Date.now();
      const itl = (n: number, base: number) => Array.from({ length: n }, (_, i) => base + ((i * 7) % 5) * 0.6);
      const entries: RecentRequest[] = Array.from({ length: 6 }, (_, i) => ({
        id: `chatcmpl-${i}`, model: 'qwen3-tiny', ttft_ms: 30 + i * 7.5, itl_p50_ms: 11 + i, itl_ms: itl(20 + i * 4, 10 + i),
        tokens_in: 40 + i * 25, tokens_out: 20 + i * 4, ended: now - (6 - i) * 15_000,
      }));
      server.setRecent(entries);
      const page = await open('dashboard', server, colorScheme, 1660);
      const ttft = page.getByTestId('chart-ttft');
      await page.waitForFunction(() => document.querySelector('[data-testid=chart-ttft]')?.getAttribute('data-last-ttft') === '67.5');
      expect(await page.locator('.chart canvas').count()).toBe(9);
      expect(await ttft.getAttribute('data-points')).toBe('6');
      expect(await ttft.getAttribute('data-last-id')).toBe('chatcmpl-5');
      // A new request arrives on a later poll: the last point is its TTFT exactly, and listed twice it is added once.
      const fresh: RecentRequest = { id: 'chatcmpl-new', model: 'qwen3-tiny', ttft_ms: 41.37, itl_ms: itl(24, 12), tokens_in: 27, tokens_out: 25, ended: Date.now() };
      server.setRecent([...entries, fresh]);
      await page.waitForFunction(() => document.querySelector('[data-testid=chart-ttft]')?.getAttribute('data-last-ttft') === '41.37');
      expect(Number(await ttft.getAttribute('data-last-ttft'))).toBe(fresh.ttft_ms);
      expect(await ttft.getAttribute('data-last-id')).toBe('chatcmpl-new');
      await page.waitForTimeout(1200);
      expect(await ttft.getAttribute('data-points')).toBe('7');
      expect(await page.getByTestId('headline-requests').innerText()).toBe('7');
      // Sampled series grow with every poll.
      const samples = Number(await page.getByTestId('chart-memory').getAttribute('data-points'));
      await page.waitForTimeout(1100);
      expect(Number(await page.getByTestId('chart-memory').getAttribute('data-points'))).toBeGreaterThan(samples);
      // Drawn: the TTFT and speculative decoding canvases have non-background pixels.
      const inked = (chart: string) => page.evaluate((testid) => {
        const canvas = document.querySelector(`[data-testid=${testid}] canvas`) as HTMLCanvasElement;
        const data = canvas.getContext('2d')!.getImageData(0, 0, canvas.width, canvas.height).data;
        let n = 0;
        for (let i = 3; i < data.length; i += 4) if (data[i] > 0) n++;
        return n;
      }, chart);
      expect(await inked('chart-ttft')).toBeGreaterThan(500);
      expect(await inked('chart-drafts')).toBeGreaterThan(500);
      // Drafted and kept: the server's cumulative counters, and the share kept in the headline.
      const drafts = page.getByTestId('chart-drafts');
      const [drafted, kept] = [Number(await drafts.getAttribute('data-drafted')), Number(await drafts.getAttribute('data-kept'))];
      expect(drafted).toBeGreaterThan(kept);
      expect(await page.getByRole('img', { name: /^Speculative decoding: in this window \d+ drafted, \d+ kept \(\d+% acceptance\); since start/ }).count()).toBe(1);
      expect(await page.getByTestId('headline-drafts').innerText()).toMatch(/^\d+%\n?\d+ of \d+ drafted$/);
      expect(await page.getByTestId('rank-0').innerText()).toMatch(/Rank 0\s+192\.168\.2\.1:32323\s+layers 0–29\s+serving here/);
      expect(await page.getByTestId('rank-1').innerText()).toMatch(/Rank 1\s+192\.168\.2\.2:32324\s+layers 30–63\s+heartbeat 0\.\d s ago/);
      await page.screenshot({ path: path.join(artifactsDir, `dashboard-${colorScheme}.png`), fullPage: true });
      await page.context().close();
    });
  }

  it('keeps the browser settings (server URL and API key) and uses them', async () => {
    const server = scriptedServer();
    const page = await open('settings', server);
    expect(await page.getByRole('heading', { name: 'Server settings' }).isVisible()).toBe(true);
    expect(await page.getByLabel('Models folder').count()).toBe(0);
    await page.getByLabel('API key').fill('s3cret');
    await page.getByLabel('API key').press('Tab');
    await page.getByLabel('Server URL').fill(url);
    await page.getByLabel('Server URL').press('Tab');
    expect(JSON.parse((await page.evaluate(() => localStorage.getItem('rmlx.settings'))) ?? '{}')).toMatchObject({ apiKey: 's3cret', baseUrl: url });
    // The coding agents' set-up follows the server and key just set, naming a served model.
    const port = new URL(url).port;
    await page.waitForFunction((p) => document.querySelector('[data-testid=launch-claude]')?.textContent?.includes(`--port ${p} --api-key s3cret --model `), port);
    for (const agent of ['claude', 'codex', 'qwen']) {
      expect(await page.getByTestId(`launch-${agent}`).innerText()).toMatch(new RegExp(`^rmlx launch ${agent} --port ${port} --api-key s3cret --model \\S+$`));
    }
    await page.getByText('Set up by hand').nth(1).click();
    expect(await page.getByTestId('manual-codex').innerText()).toContain(`base_url = "${new URL(url).origin}/v1"`);
    await page.screenshot({ path: path.join(artifactsDir, 'settings-browser-light.png'), fullPage: true });
    await page.getByRole('link', { name: 'Models' }).click();
    await page.locator('tbody tr').first().waitFor();
    expect(server.sent.filter((s) => s.path === '/v1/models').at(-1)?.auth).toBe('Bearer s3cret');
    await page.context().close();
  });
});

/** A stand-in for the Tauri shell: scripted commands, recorded calls, and `__emit` for events. */
function fakeTauri() {
  const w = window as unknown as Record<string, unknown>;
  const callbacks = new Map<number, (message: unknown) => void>();
  const listeners: Record<string, number[]> = {};
  const calls: [string, unknown][] = [];
  let settings = {
    models_dir: '/Users/me/Models', hub_url: null, server_enabled: true, server_host: '127.0.0.1', server_port: 8080, api_key: null,
    cors_origins: ['http://localhost:3000'], default_max_context: null, launch_at_login: false, update_channel: 'stable',
  };
  let nextId = 1;
  let diskBytes = 3_221_225_472;
  const handlers: Record<string, (args: Record<string, unknown>) => unknown> = {
    threads_load: () => null,
    threads_save: () => null,
    models_overview: () => ({ object: 'list', data: [{ id: 'qwen3-tiny', loaded: false, vision: false, context_length: 2048 }], memory: { total_bytes: 17179869184, available_bytes: 9663676416 } }),
    metrics_snapshot: () => ({
      recent: [], in_flight: 0, queue_depth: 0,
      disk_cache: {
        path: '/Users/me/.rmlx/cache', budget_bytes: 16_000_000_000, bytes: diskBytes, files: 120, read_bytes: 0, read_ms: 0,
        written_bytes: diskBytes, evicted_files: 0, evicted_bytes: 0, writing_stopped: false,
      },
    }),
    disk_cache_clear: () => {
      const freed = diskBytes;
      diskBytes = 0;
      return { freed_bytes: freed };
    },
    downloads_list: () => [],
    settings_get: () => settings,
    settings_set: (args) => (settings = args.settings as typeof settings),
    server_status: () => ({ state: 'failed', message: 'port 8080 is in use; choose another port', port: 8080 }),
    server_set: (args) => (args.port === 0 ? { state: 'on', url: 'http://127.0.0.1:51234' } : { state: 'on', url: `http://127.0.0.1:${args.port}` }),
    launch_at_login_set: (args) => args.enabled,
    update_check: () => ({ version: '0.2.0', current_version: '0.1.0', notes: null }),
    update_install: () =>
      new Promise((resolve) => {
        const emit = w.__emit as (event: string, payload: unknown) => void;
        setTimeout(() => emit('update-progress', { downloaded: 12_000_000, total: 48_000_000 }), 50);
        setTimeout(() => emit('update-progress', { downloaded: 30_000_000, total: 48_000_000 }), 150);
        setTimeout(resolve, 800);
      }),
    app_restart: () => null,
  };
  w.__calls = calls;
  w.__emit = (event: string, payload: unknown) => {
    for (const id of listeners[event] ?? []) callbacks.get(id)?.({ event, id, payload });
  };
  w.__TAURI_EVENT_PLUGIN_INTERNALS__ = { unregisterListener: () => {} };
  w.__TAURI_INTERNALS__ = {
    transformCallback(callback: (message: unknown) => void) {
      const id = nextId++;
      callbacks.set(id, callback);
      return id;
    },
    unregisterCallback(id: number) {
      callbacks.delete(id);
    },
    async invoke(command: string, args: Record<string, unknown> = {}) {
      if (command === 'plugin:event|listen') {
        (listeners[args.event as string] ??= []).push(args.handler as number);
        return args.handler;
      }
      if (command === 'plugin:event|unlisten') return null;
      calls.push([command, args]);
      const handler = handlers[command];
      if (!handler) throw `command ${command} not found`;
      return handler(args);
    },
  };
}

describe('the desktop app\'s Settings over a scripted Tauri IPC', () => {
  let url: string;
  let browser: Browser;
  withHostedDist((hosted) => ({ url, browser } = hosted));

  for (const colorScheme of ['light', 'dark'] as const) {
    it(`edits every app setting, shows the busy port and picks a free one, checks for updates (${colorScheme})`, async () => {
      const context = await browser.newContext({ viewport: { width: 1280, height: 1180 }, colorScheme });
      await context.addInitScript(fakeTauri);
      const page = await context.newPage();
      page.on('pageerror', (error) => process.stderr.write(`page error: ${error.message}\n`));
      await page.goto(`${url}/#/settings`);
      await page.getByLabel('Models folder').waitFor();
      const calls = () => page.evaluate(() => (window as unknown as { __calls: [string, Record<string, unknown>][] }).__calls);
      expect(await page.getByLabel('Models folder').inputValue()).toBe('/Users/me/Models');
      expect(await page.getByTestId('server-status').innerText()).toContain('port 8080 is in use; choose another port');
      for (const label of ['Hugging Face hub URL', 'Default max context (tokens)', 'KV cache', 'Prompt cache on disk', 'Prompt cache folder', 'Speculative decoding', 'Host', 'Port', 'API key', 'CORS origins', 'Launch at login', 'Update channel']) {
        expect(await page.getByLabel(label, { exact: true }).count(), label).toBe(1);
      }
      if (colorScheme === 'dark') {
        await page.getByTestId('agent-setup').screenshot({ path: path.join(artifactsDir, 'settings-app-agents-dark.png') });
        await page.screenshot({ path: path.join(artifactsDir, 'settings-app-dark.png'), fullPage: true });
        await context.close();
        return;
      }
      await page.getByTestId('disk-usage').waitFor();
      expect(await page.getByTestId('disk-usage').innerText()).toContain('3.0 GB of 14.9 GB used in /Users/me/.rmlx/cache');
      await page.screenshot({ path: path.join(artifactsDir, 'settings-app-light.png'), fullPage: true });
      await page.getByTestId('disk-usage').getByRole('button', { name: 'Clear' }).click();
      await page.waitForFunction(() => document.querySelector('[data-testid=disk-usage]')?.textContent?.includes('0 B of'));
      expect((await calls()).some(([c]) => c === 'disk_cache_clear')).toBe(true);

      await page.getByRole('button', { name: 'Use a free port' }).click();
      await page.waitForFunction(() => document.querySelector('[data-testid=server-status]')?.textContent?.includes('51234'));
      expect(await page.getByLabel('Port').inputValue()).toBe('51234');
      // The agents' set-up follows the live port.
      expect(await page.getByTestId('launch-codex').innerText()).toContain('rmlx launch codex --port 51234');
      expect((await calls()).find(([c]) => c === 'server_set')?.[1]).toEqual({ enabled: true, port: 0 });

      await page.getByLabel('Hugging Face hub URL').fill('http://127.0.0.1:9999');
      await page.getByLabel('Default max context (tokens)').fill('32768');
      await page.getByLabel('Default max context (tokens)').press('Tab');
      expect(await page.getByLabel('KV cache').inputValue()).toBe('off');
      await page.getByLabel('KV cache').selectOption('8');
      expect(await page.getByLabel('Prompt cache on disk').inputValue()).toBe('auto');
      await page.getByLabel('Prompt cache on disk').selectOption('8');
      await page.getByLabel('Prompt cache folder').fill('/Volumes/fast/rmlx-cache');
      expect(await page.getByLabel('Speculative decoding').inputValue()).toBe('default');
      await page.getByLabel('Speculative decoding').selectOption('draft');
      expect(await page.getByLabel('Draft model folder').inputValue()).toBe('');
      await page.getByLabel('Draft model folder').fill('/Users/me/Models/Qwen3.5-0.8B-4bit');
      await page
        .locator('fieldset', { has: page.getByLabel('Draft model folder') })
        .screenshot({ path: path.join(artifactsDir, 'settings-draft-model-light.png') });
      await page.getByLabel('API key').fill('k3y');
      await page.getByLabel('CORS origins').fill('https://a.example\nhttps://b.example');
      await page.getByLabel('Launch at login').check();
      await page.getByLabel('Update channel').selectOption('beta');
      await page.getByLabel('Port').fill('9090');
      await page.getByRole('button', { name: 'Save settings' }).click();
      await page.getByText('Saved.').waitFor();
      const log = await calls();
      expect(log.find(([c]) => c === 'launch_at_login_set')?.[1]).toEqual({ enabled: true });
      expect(log.filter(([c]) => c === 'settings_set').at(-1)?.[1]).toEqual({
        settings: {
          models_dir: '/Users/me/Models', hub_url: 'http://127.0.0.1:9999', server_enabled: true, server_host: '127.0.0.1', server_port: 9090,
          api_key: 'k3y', cors_origins: ['https://a.example', 'https://b.example'], default_max_context: 32768, kv_cache_bits: 8,
          prefix_disk_gb: 8, prefix_disk_dir: '/Volumes/fast/rmlx-cache', speculative: 'draft', draft_model: '/Users/me/Models/Qwen3.5-0.8B-4bit',
          launch_at_login: true, update_channel: 'beta',
        },
      });
      expect(log.filter(([c]) => c === 'server_set').at(-1)?.[1]).toEqual({ enabled: true, port: 9090 });
      // The shell reports a status change by event.
      await page.evaluate(() => (window as unknown as { __emit: (e: string, p: unknown) => void }).__emit('server-status', { state: 'off' }));
      await page.waitForFunction(() => document.querySelector('[data-testid=server-status]')?.getAttribute('data-state') === 'off');

      await page.getByRole('button', { name: 'Check for updates' }).click();
      await page.getByText('rMLX 0.2.0 is available.').waitFor();
      await page.getByRole('button', { name: 'Install', exact: true }).click();
      await page.waitForFunction(() => document.querySelector('[data-testid=update-status]')?.textContent?.includes('28.6 MB of 45.8 MB'));
      await page.screenshot({ path: path.join(artifactsDir, 'settings-app-update-light.png'), fullPage: true });
      await page.getByText('rMLX 0.2.0 is installed (its signature checked out).').waitFor();
      await page.getByRole('button', { name: 'Restart now' }).click();
      await page.waitForFunction(() => (window as unknown as { __calls: [string, unknown][] }).__calls.at(-1)?.[0] === 'app_restart');
      await context.close();
    });
  }
});
