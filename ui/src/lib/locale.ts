// WebKitGTK reports the POSIX locale as `navigator.language` "C" when the app starts under
// LANG=C, and Intl rejects that tag with a RangeError. uPlot builds a NumberFormat from it when
// its module loads, which once left the app window blank: main.ts imports this guard first.

/** Whether Intl accepts `tag` as a locale. */
export function isValidLocale(tag: string | undefined | null): boolean {
  if (!tag) return false;
  try {
    return Intl.getCanonicalLocales(tag).length > 0;
  } catch {
    return false;
  }
}

/** The first usable tag: the language, else one of the languages, else en-US. */
export function usableLanguage(language: string | undefined, languages: readonly string[] = []): string {
  if (isValidLocale(language)) return language as string;
  return languages.find(isValidLocale) ?? 'en-US';
}

/** Replaces an invalid `navigator.language` with a usable one (no-op when it is valid). */
export function guardNavigatorLanguage(nav: Navigator | undefined = globalThis.navigator): void {
  if (!nav || isValidLocale(nav.language)) return;
  const language = usableLanguage(nav.language, nav.languages ?? []);
  Object.defineProperty(nav, 'language', { configurable: true, get: () => language });
}

guardNavigatorLanguage();
