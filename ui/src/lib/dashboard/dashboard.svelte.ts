// The dashboard's live store: `DashboardSeries` fed from `transport.onMetrics`, with a
// `version` that changes on every snapshot so charts redraw.

import type { MetricsSnapshot, RankStatus, Transport, Unsubscribe } from '../transport/types';
import { describeError, isUnsupported } from '../transport/types';
import { DashboardSeries, type SeriesLimits } from './series';

export class DashboardStore {
  readonly series: DashboardSeries;
  /** Bumped on every snapshot: read it in an effect to redraw. */
  version = $state(0);
  error = $state<string | null>(null);
  /** When the last snapshot arrived (local ms), or null before the first. */
  updatedAt = $state<number | null>(null);
  /** The machines of a pipeline across machines (empty on one machine), and its failure. */
  ranks = $state<RankStatus[]>([]);
  pipelineError = $state<string | null>(null);

  constructor(limits?: SeriesLimits, private readonly now: () => number = Date.now) {
    this.series = new DashboardSeries(limits);
  }

  ingest(snapshot: MetricsSnapshot): void {
    this.series.ingest(snapshot, this.now());
    this.ranks = snapshot.ranks ?? [];
    this.pipelineError = snapshot.pipeline_error ?? null;
    this.updatedAt = this.now();
    this.error = null;
    this.version++;
  }

  subscribe(transport: Transport): Unsubscribe {
    return transport.onMetrics(
      (snapshot) => this.ingest(snapshot),
      (error) => {
        this.error = isUnsupported(error) ? 'This server has no /metrics/cache.' : `Cannot read metrics: ${describeError(error)}`;
      },
    );
  }
}
