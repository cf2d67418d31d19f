import type { ModelInfo, Transport } from './transport/types';

/** The models the engine can serve (list_models / GET /v1/models). */
export class ModelList {
  models = $state<ModelInfo[]>([]);
  error = $state<string | null>(null);
  loading = $state(false);

  async refresh(transport: Transport): Promise<void> {
    this.loading = true;
    try {
      this.models = await transport.listModels();
      this.error = null;
    } catch (error) {
      this.error = error instanceof Error ? error.message : String(error);
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
