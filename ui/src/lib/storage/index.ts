import { inTauri } from '../transport';
import { LocalThreadStorage, MemoryThreadStorage } from './local';
import { TauriThreadStorage } from './tauri';
import type { ThreadStorage } from './types';

export type { ThreadStorage } from './types';

export function createThreadStorage(): ThreadStorage {
  if (inTauri()) return new TauriThreadStorage();
  try {
    return new LocalThreadStorage(window.localStorage);
  } catch {
    return new MemoryThreadStorage(); // storage disabled (privacy mode): keep this session only
  }
}
