// App-wide preferences (not per thread), kept in localStorage in both shells: where the server
// is, its key, and the image pixel budget.

import { DEFAULT_PIXEL_BUDGET } from './images/plan';

export interface AppSettings {
  /** Empty: the page's own origin (the server hosts the UI). */
  baseUrl: string;
  apiKey: string;
  pixelBudget: number;
}

export const SETTINGS_KEY = 'rmlx.settings';

const defaults: AppSettings = { baseUrl: '', apiKey: '', pixelBudget: DEFAULT_PIXEL_BUDGET };

function read(storage: Storage | undefined): AppSettings {
  try {
    const saved = JSON.parse(storage?.getItem(SETTINGS_KEY) ?? 'null') as Partial<AppSettings> | null;
    const pixelBudget = Number(saved?.pixelBudget);
    return {
      baseUrl: typeof saved?.baseUrl === 'string' ? saved.baseUrl : defaults.baseUrl,
      apiKey: typeof saved?.apiKey === 'string' ? saved.apiKey : defaults.apiKey,
      pixelBudget: Number.isFinite(pixelBudget) && pixelBudget > 0 ? pixelBudget : defaults.pixelBudget,
    };
  } catch {
    return { ...defaults };
  }
}

export class AppSettingsStore {
  value = $state<AppSettings>({ ...defaults });

  constructor(private readonly storage: Storage | undefined = globalThis.localStorage) {
    this.value = read(storage);
  }

  update(change: Partial<AppSettings>): void {
    this.value = { ...this.value, ...change };
    try {
      this.storage?.setItem(SETTINGS_KEY, JSON.stringify(this.value));
    } catch {
      // private mode: the settings last for this session
    }
  }
}
