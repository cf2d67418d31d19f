import { defineConfig } from 'vitest/config';

// Browser tests against a real `rmlx serve` (see e2e/server.ts); one file at a time, long timeouts.
export default defineConfig({
  test: {
    environment: 'node',
    include: ['e2e/**/*.spec.ts'],
    testTimeout: 120_000,
    hookTimeout: 120_000,
    fileParallelism: false,
    maxWorkers: 1,
  },
});
