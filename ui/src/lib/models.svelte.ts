import { describeError, type MemoryInfo, type ModelInfo, type Transport } from './transport/types';

/** The models the engine can serve (`GET /v1/models` / `models_overview`), and the machine's memory. */
export class ModelList {
  models = $state<ModelInfo[]>([]);
  memory = $state<MemoryInfo | null>(null);
  error = $state<string | null>(null);
  loading = $state(false);

  async refresh(transport: Transport): Promise<void> {
    this.loading = true;
    try {
      const catalog = await transport.listModels();
      this.models = catalog.models;
      this.memory = catalog.memory;
      this.error = null;
    } catch (error) {
      this.error = describeError(error);
    } finally {
      this.loading = false;
    }
  }

  find(id: string): ModelInfo | undefined {
    return this.models.find((m) => m.id === id);
  }

  /** For a new thread: a model already in memory if there is one (no load wait), else the first. */
  preferred(): string {
    return (this.models.find((m) => m.loaded) ?? this.models[0])?.id ?? '';
  }
}
