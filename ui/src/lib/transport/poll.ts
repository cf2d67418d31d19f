// Polling for the browser transport's subscriptions: one request at a time (the next is timed
// from the end of the last), paused while the page is hidden when asked, and `kick` to poll
// now (after an action that changes what is polled).

import { TransportError, type Unsubscribe } from './types';

export interface PollOptions<T> {
  fetch: () => Promise<T>;
  onValue: (value: T) => void;
  onError?: (error: TransportError) => void;
  /** Milliseconds until the next poll, from the last value (or the error); null stops polling. */
  delay: (last: { value: T } | { error: TransportError }) => number | null;
  /** Skip polls while `document.visibilityState` is `hidden`; poll at once when the page shows again. */
  whileVisible?: boolean;
}

export interface Poller {
  stop: Unsubscribe;
  /** Polls now (or right after the request in flight), even if polling had stopped. */
  kick(): void;
}

function hidden(): boolean {
  return typeof document !== 'undefined' && document.visibilityState === 'hidden';
}

export function poll<T>(options: PollOptions<T>): Poller {
  let stopped = false;
  let inFlight = false;
  let again = false;
  let timer: ReturnType<typeof setTimeout> | null = null;

  const clear = () => {
    if (timer !== null) clearTimeout(timer);
    timer = null;
  };

  const schedule = (ms: number | null) => {
    clear();
    if (stopped || ms === null) return;
    timer = setTimeout(() => void tick(), ms);
  };

  async function tick(): Promise<void> {
    timer = null;
    if (stopped) return;
    if (options.whileVisible && hidden()) return; // visibilitychange starts it again
    inFlight = true;
    let outcome: { value: T } | { error: TransportError };
    try {
      outcome = { value: await options.fetch() };
    } catch (error) {
      outcome = { error: error instanceof TransportError ? error : new TransportError(String(error), 'network') };
    }
    inFlight = false;
    if (stopped) return;
    if ('value' in outcome) options.onValue(outcome.value);
    else options.onError?.(outcome.error);
    if (again) {
      again = false;
      schedule(0);
    } else {
      schedule(options.delay(outcome));
    }
  }

  const onVisibility = () => {
    if (!hidden() && !inFlight && timer === null && !stopped) void tick();
  };
  if (options.whileVisible && typeof document !== 'undefined') document.addEventListener('visibilitychange', onVisibility);

  void tick();

  return {
    stop() {
      stopped = true;
      clear();
      if (options.whileVisible && typeof document !== 'undefined') document.removeEventListener('visibilitychange', onVisibility);
    },
    kick() {
      if (stopped) return;
      if (inFlight) again = true;
      else {
        clear();
        void tick();
      }
    },
  };
}
