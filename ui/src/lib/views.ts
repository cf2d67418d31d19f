// The top-level views and their URL hashes (`#/models`): links work, reloads stay put, and the
// app's tray can open `#/dashboard`.

export type View = 'chat' | 'models' | 'dashboard' | 'settings';

export const VIEWS: { id: View; label: string }[] = [
  { id: 'chat', label: 'Chat' },
  { id: 'models', label: 'Models' },
  { id: 'dashboard', label: 'Dashboard' },
  { id: 'settings', label: 'Settings' },
];

export function parseView(hash: string): View {
  const id = hash.replace(/^#\/?/, '').split(/[/?]/)[0];
  return VIEWS.some((v) => v.id === id) ? (id as View) : 'chat';
}
