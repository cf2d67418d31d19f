// Numbers for people: bytes, percentages, durations.

const units = ['B', 'KB', 'MB', 'GB', 'TB'];

/** 1536 -> "1.5 KB" (powers of 1024, one decimal from KB up; "—" for unknown). */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) return '—';
  let value = Math.max(0, bytes);
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit++;
  }
  return unit === 0 ? `${Math.round(value)} B` : `${value.toFixed(value >= 100 ? 0 : 1)} ${units[unit]}`;
}

/** 0.4567 -> "46%". */
export function formatPercent(fraction: number | null): string {
  return fraction === null ? '—' : `${Math.round(fraction * 100)}%`;
}

/** 40960 -> "40K", 262144 -> "256K", 2048 -> "2K" (context lengths, in tokens). */
export function formatTokens(count: number | null | undefined): string {
  if (!count) return '—';
  if (count >= 1024 && count % 1024 === 0) return `${count / 1024}K`;
  if (count >= 1000) return `${(count / 1000).toFixed(count >= 100_000 ? 0 : 1)}k`;
  return String(count);
}

/** 0.634 -> "0.6 s", 12.3 -> "12 s", 135 -> "2 min 15 s" (a warm-up's or a load's time). */
export function formatSeconds(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds) || seconds < 0) return '—';
  if (seconds < 10) return `${seconds.toFixed(1)} s`;
  if (seconds < 60) return `${Math.round(seconds)} s`;
  const whole = Math.round(seconds);
  return `${Math.floor(whole / 60)} min ${whole % 60} s`;
}

/**
 * The release structure the server recognised, without the model type it starts with:
 * ("gemma4, MoE 128 experts top-8, k_eq_v", "gemma4") -> "MoE 128 experts top-8, k_eq_v".
 */
export function structureDetails(structure: string | undefined, modelType: string | undefined): string {
  if (!structure) return '';
  const prefix = modelType ? `${modelType}, ` : '';
  if (structure === modelType) return '';
  return prefix && structure.startsWith(prefix) ? structure.slice(prefix.length) : structure;
}
