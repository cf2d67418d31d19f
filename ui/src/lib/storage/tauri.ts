// Desktop storage: the Tauri shell keeps the document in the app data folder.
// Commands: `threads_load` -> ThreadsDocument | null, `threads_save {document}` -> ().

import { invoke } from '@tauri-apps/api/core';
import type { ThreadsDocument } from '../chat/model';
import { validDocument, type ThreadStorage } from './types';

export class TauriThreadStorage implements ThreadStorage {
  async load(): Promise<ThreadsDocument | null> {
    return validDocument(await invoke<unknown>('threads_load'));
  }

  async save(document: ThreadsDocument): Promise<void> {
    await invoke('threads_save', { document });
  }
}
