// A Transport that can do nothing, for tests to extend with the parts they play.

import {
  TransportError,
  type ChatOptions,
  type ChatOutcome,
  type ChatRequest,
  type DownloadJob,
  type MetricsSnapshot,
  type ModelCatalog,
  type Transport,
  type Unsubscribe,
} from './types';

const unsupported = (what: string) => Promise.reject(new TransportError(`${what}: not in this stub`, 'not_found', 404));

export class StubTransport implements Transport {
  readonly kind: 'http' | 'tauri' = 'http';
  readonly app = null;
  chat(_request: ChatRequest, _options: ChatOptions): Promise<ChatOutcome> {
    return unsupported('chat');
  }
  async listModels(): Promise<ModelCatalog> {
    return { models: [], memory: null };
  }
  loadModel(_id: string): Promise<void> {
    return unsupported('loadModel');
  }
  unloadModel(_id: string): Promise<void> {
    return unsupported('unloadModel');
  }
  deleteModel(_id: string): Promise<void> {
    return unsupported('deleteModel');
  }
  async metrics(): Promise<MetricsSnapshot> {
    return { recent: [], in_flight: 0, queue_depth: 0 };
  }
  clearDiskCache(): Promise<number> {
    return unsupported('clearDiskCache');
  }
  startDownload(_repo: string, _revision?: string | null): Promise<DownloadJob> {
    return unsupported('startDownload');
  }
  async listDownloads(): Promise<DownloadJob[]> {
    return [];
  }
  pauseDownload(_id: string): Promise<DownloadJob> {
    return unsupported('pauseDownload');
  }
  resumeDownload(_id: string): Promise<DownloadJob> {
    return unsupported('resumeDownload');
  }
  cancelDownload(_id: string): Promise<DownloadJob> {
    return unsupported('cancelDownload');
  }
  onDownloads(): Unsubscribe {
    return () => {};
  }
  onMetrics(): Unsubscribe {
    return () => {};
  }
}
