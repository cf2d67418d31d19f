// Starts a real `rmlx serve` for the browser tests: $RMLX_BIN with the two tiny fixture models,
// serving the UI built into the binary (what a Homebrew user gets; `make` builds ui/dist before
// rmlx). RMLX_E2E_UI_DIR=1 serves ui/dist with `--ui-dir` instead, for UI work without
// rebuilding rmlx. The first stdout line is `rmlx serve: listening on http://ADDR:PORT`.
// `hostDist` serves dist/ alone, for the tests that script the API themselves.

import { spawn, type ChildProcess } from 'node:child_process';
import { createReadStream, existsSync, mkdtempSync, statSync } from 'node:fs';
import http from 'node:http';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

export const uiDir = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
export const repoDir = path.resolve(uiDir, '..');
export const fixturesDir = path.join(repoDir, 'tests', 'fixtures');
export const distDir = path.join(uiDir, 'dist');

export interface RunningServer {
  /** Where the page is loaded from (and, same origin, the API). */
  url: string;
  /** The rmlx server itself, for direct API calls from the tests. */
  apiUrl: string;
  stop(): Promise<void>;
}

export const rmlxBin = process.env.RMLX_BIN ?? '';
export const skipReason = rmlxBin
  ? null
  : 'RMLX_BIN is not set: e2e tests need a built `rmlx` (e.g. RMLX_BIN=../target/release/rmlx npm run e2e)';

function waitForUrl(child: ChildProcess): Promise<string> {
  return new Promise((resolve, reject) => {
    let stderr = '';
    child.stderr?.on('data', (data: Buffer) => (stderr += data.toString()));
    const lines = createInterface({ input: child.stdout! });
    const timer = setTimeout(() => reject(new Error(`rmlx serve printed no URL within 30 s\n${stderr}`)), 30_000);
    lines.once('line', (line) => {
      clearTimeout(timer);
      const match = /listening on (http:\/\/\S+)/.exec(line);
      if (match) resolve(match[1]);
      else reject(new Error(`unexpected first line from rmlx serve: ${line}\n${stderr}`));
    });
    child.once('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`rmlx serve exited with ${code}\n${stderr}`));
    });
  });
}

export interface RunningHub {
  url: string;
  stop(): Promise<void>;
}

/** The imitation of the Hugging Face file API (`crates/rmlx-hub/examples/test_hub.rs`, built
 * by `cargo test` next to `rmlx`), serving `repos` (`org/name` → folder). */
export async function startHub(repos: Record<string, string>, options: { trickleMs?: number } = {}): Promise<RunningHub> {
  const bin = process.env.RMLX_TEST_HUB ?? path.join(path.dirname(rmlxBin), 'examples', 'test_hub');
  if (!existsSync(bin)) throw new Error(`${bin} is missing: \`cargo test --workspace --no-run\` builds it`);
  const args = [
    ...(options.trickleMs ? ['--trickle-ms', String(options.trickleMs)] : []),
    ...Object.entries(repos).map(([repo, dir]) => `${repo}=${dir}`),
  ];
  // Its stdin is a pipe we hold: closing it (or our exit) stops the hub.
  const child = spawn(bin, args, { stdio: ['pipe', 'pipe', 'pipe'] });
  const url = await new Promise<string>((resolve, reject) => {
    const lines = createInterface({ input: child.stdout! });
    lines.once('line', (line) => {
      const match = /serving on (http:\/\/\S+)/.exec(line);
      if (match) resolve(match[1]);
      else reject(new Error(`unexpected first line from test_hub: ${line}`));
    });
    child.once('exit', (code) => reject(new Error(`test_hub exited with ${code}`)));
  });
  return {
    url,
    async stop() {
      if (child.exitCode === null) {
        const exited = new Promise((resolve) => child.once('exit', resolve));
        child.stdin?.end();
        await exited;
      }
    },
  };
}

const contentTypes: Record<string, string> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript',
  '.css': 'text/css',
  '.svg': 'image/svg+xml',
  '.map': 'application/json',
};

/** dist/ as static files on a free loopback port. */
export function hostDist(): Promise<http.Server> {
  const server = http.createServer((request, response) => {
    const url = new URL(request.url ?? '/', 'http://localhost');
    const file = path.join(distDir, path.normalize(url.pathname === '/' ? '/index.html' : url.pathname));
    if (!file.startsWith(distDir) || !existsSync(file) || !statSync(file).isFile()) {
      response.writeHead(404).end('not found');
      return;
    }
    response.writeHead(200, { 'content-type': contentTypes[path.extname(file)] ?? 'application/octet-stream' });
    createReadStream(file).pipe(response);
  });
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(server)));
}

export interface ServerOptions {
  /** `--models-dir`: downloads land here (default: an empty scratch folder per server). */
  modelsDir?: string;
  /** `--hub-url`: where downloads come from (a `startHub()` imitation in tests). */
  hubUrl?: string;
}

export async function startServer(options: ServerOptions = {}): Promise<RunningServer> {
  if (!existsSync(path.join(distDir, 'index.html'))) throw new Error(`${distDir} has no build: run \`npm run build\` first`);
  // Never the user's ~/.rmlx/models: a scratch folder unless the test brings its own.
  const modelsDir = options.modelsDir ?? mkdtempSync(path.join(tmpdir(), 'rmlx-e2e-models-'));
  const args = [
    'serve',
    '--port', '0',
    '--model', path.join(fixturesDir, 'qwen3-tiny'),
    '--model', path.join(fixturesDir, 'qwen3-vl-tiny'),
    '--models-dir', modelsDir,
    ...(process.env.RMLX_E2E_UI_DIR ? ['--ui-dir', distDir] : []),
    ...(options.hubUrl ? ['--hub-url', options.hubUrl] : []),
  ];
  const child = spawn(rmlxBin, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  const url = await waitForUrl(child);
  return {
    url,
    apiUrl: url,
    async stop() {
      if (child.exitCode === null) {
        const exited = new Promise((resolve) => child.once('exit', resolve));
        child.kill('SIGTERM');
        // SIGTERM lets running requests finish; a stuck one must not hang the test run.
        const force = setTimeout(() => child.kill('SIGKILL'), 5_000);
        await exited;
        clearTimeout(force);
      }
    },
  };
}
