import { HttpTransport, type HttpTransportOptions } from './http';
import { TauriTransport } from './tauri';
import type { Transport } from './types';

export * from './types';

/** True inside the Tauri webview, whose IPC bridge defines this global before any script runs. */
export function inTauri(): boolean {
  return typeof window !== 'undefined' && '__TAURI_INTERNALS__' in window;
}

export function createTransport(http: HttpTransportOptions = {}): Transport {
  return inTauri() ? new TauriTransport() : new HttpTransport(http);
}
