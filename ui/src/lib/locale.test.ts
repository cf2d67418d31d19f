import { describe, expect, it } from 'vitest';
import { guardNavigatorLanguage, isValidLocale, usableLanguage } from './locale';

describe('locale guard', () => {
  it('tells tags Intl accepts from the POSIX locale', () => {
    expect(isValidLocale('en-GB')).toBe(true);
    expect(isValidLocale('C')).toBe(false);
    expect(isValidLocale('C.UTF-8')).toBe(false);
    expect(isValidLocale('')).toBe(false);
  });

  it('falls back to the languages list, then en-US', () => {
    expect(usableLanguage('fr-FR', ['de'])).toBe('fr-FR');
    expect(usableLanguage('C', ['C', 'de-DE'])).toBe('de-DE');
    expect(usableLanguage('C', [])).toBe('en-US');
  });

  it('patches a navigator whose language would make Intl throw', () => {
    const nav = { language: 'C', languages: ['C'] } as unknown as Navigator;
    expect(() => new Intl.NumberFormat(nav.language)).toThrow(RangeError);
    guardNavigatorLanguage(nav);
    expect(nav.language).toBe('en-US');
    expect(() => new Intl.NumberFormat(nav.language)).not.toThrow();
  });
});
