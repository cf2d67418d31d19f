/// <reference types="vitest/config" />
import { defineConfig } from 'vite';
import { svelte } from '@sveltejs/vite-plugin-svelte';

export default defineConfig({
  plugins: [svelte()],
  // Relative asset URLs: the same dist/ works at `/` of `rmlx serve --ui-dir` and inside Tauri.
  base: './',
  // Tauri's dev server expects a fixed port and must not hide Rust errors.
  clearScreen: false,
  server: {
    port: 5173,
    strictPort: true,
    // `npm run dev` next to `rmlx serve` on its default port: same-origin API calls via the proxy.
    proxy: {
      '/v1': 'http://127.0.0.1:8080',
      '/metrics': 'http://127.0.0.1:8080',
      '/health': 'http://127.0.0.1:8080',
    },
  },
  build: { target: 'es2022', sourcemap: true },
  // Under vitest (Node), resolve Svelte's client runtime as the browser would get it.
  resolve: process.env.VITEST ? { conditions: ['browser'] } : undefined,
  test: {
    // Node by default (fast); files that need a DOM say `@vitest-environment jsdom`.
    environment: 'node',
    include: ['src/**/*.test.ts'],
    // One worker: the build machine is small and shared.
    pool: 'threads',
    maxWorkers: 1,
  },
});
