// Starts a real `rmlx serve` for the browser tests: $RMLX_BIN with the two tiny fixture models
// and `--ui-dir ui/dist`. The first stdout line is `rmlx serve: listening on http://ADDR:PORT`.
//
// Until the server has `--ui-dir`, a small Node server hosts dist/ and forwards the API routes to
// rmlx (same origin for the page either way); it says so on stderr.

import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { createReadStream, existsSync, statSync } from 'node:fs';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
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

function supportsUiDir(): boolean {
  const help = spawnSync(rmlxBin, ['serve', '--help'], { encoding: 'utf8' });
  return `${help.stdout}${help.stderr}`.includes('--ui-dir');
}

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

const contentTypes: Record<string, string> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript',
  '.css': 'text/css',
  '.svg': 'image/svg+xml',
  '.map': 'application/json',
};

/** Static dist/ plus, given an rmlx URL, a streaming pass-through of the API routes to it. */
export function hostDist(apiUrl: string | null): Promise<http.Server> {
  const api = apiUrl ? new URL(apiUrl) : null;
  const server = http.createServer((request, response) => {
    const url = new URL(request.url ?? '/', 'http://localhost');
    if (api && /^\/(v1|metrics|health)(\/|$)/.test(url.pathname)) {
      const upstream = http.request(
        { host: api.hostname, port: api.port, path: request.url, method: request.method, headers: { ...request.headers, host: api.host } },
        (answer) => {
          response.writeHead(answer.statusCode ?? 502, answer.headers);
          answer.pipe(response);
        },
      );
      upstream.on('error', () => response.destroy());
      // A closed page cancels the generation, as it would against rmlx directly.
      response.on('close', () => upstream.destroy());
      request.pipe(upstream);
      return;
    }
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

export async function startServer(): Promise<RunningServer> {
  if (!existsSync(path.join(distDir, 'index.html'))) throw new Error(`${distDir} has no build: run \`npm run build\` first`);
  const withUiDir = supportsUiDir();
  const args = [
    'serve',
    '--port', '0',
    '--model', path.join(fixturesDir, 'qwen3-tiny'),
    '--model', path.join(fixturesDir, 'qwen3-vl-tiny'),
    ...(withUiDir ? ['--ui-dir', distDir] : []),
  ];
  const child = spawn(rmlxBin, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  const apiUrl = await waitForUrl(child);
  let host: http.Server | null = null;
  let url = apiUrl;
  if (!withUiDir) {
    process.stderr.write(`e2e: ${rmlxBin} has no --ui-dir yet; hosting ui/dist from Node and proxying the API to ${apiUrl}\n`);
    host = await hostDist(apiUrl);
    url = `http://127.0.0.1:${(host.address() as AddressInfo).port}`;
  }
  return {
    url,
    apiUrl,
    async stop() {
      host?.closeAllConnections();
      await new Promise<void>((resolve) => (host ? host.close(() => resolve()) : resolve()));
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
