import { describe, expect, it } from 'vitest';
import { DEFAULT_PIXEL_BUDGET, fitToBudget, isHeic, planImage, sniffMime } from './plan';

describe('planImage', () => {
  it('keeps the original bytes of a readable picture within the budget', () => {
    expect(planImage({ mime: 'image/png', width: 64, height: 48 })).toEqual({ action: 'keep' });
    expect(planImage({ mime: 'image/jpeg', width: 4096, height: 4096 })).toEqual({ action: 'keep' }); // exactly the budget
    expect(planImage({ mime: 'image/webp', width: 100, height: 100 }, 10_000)).toEqual({ action: 'keep' });
  });

  it('downscales only past the budget, keeping the aspect ratio and JPEG for photos', () => {
    const plan = planImage({ mime: 'image/jpeg', width: 8000, height: 6000 });
    expect(plan).toMatchObject({ action: 'reencode', mime: 'image/jpeg', reason: 'budget' });
    if (plan.action !== 'reencode') throw new Error('unreachable');
    expect(plan.width * plan.height).toBeLessThanOrEqual(DEFAULT_PIXEL_BUDGET);
    expect(plan.width * plan.height).toBeGreaterThan(DEFAULT_PIXEL_BUDGET * 0.99);
    expect(plan.width / plan.height).toBeCloseTo(8000 / 6000, 2);
    expect(planImage({ mime: 'image/png', width: 4097, height: 4096 })).toMatchObject({ action: 'reencode', mime: 'image/png', reason: 'budget' });
  });

  it('honours a configured budget', () => {
    expect(planImage({ mime: 'image/png', width: 200, height: 100 }, 5000)).toEqual({ action: 'reencode', width: 100, height: 50, mime: 'image/png', reason: 'budget' });
  });

  it('converts formats the server cannot read (HEIC, AVIF) at their own size', () => {
    expect(planImage({ mime: 'image/heic', width: 300, height: 200 })).toEqual({ action: 'reencode', width: 300, height: 200, mime: 'image/png', reason: 'format' });
    expect(planImage({ mime: 'image/avif', width: 10, height: 10 })).toMatchObject({ action: 'reencode', reason: 'format' });
  });

  it('fitToBudget never exceeds the budget and never goes below 1 pixel', () => {
    for (const [w, h, budget] of [[10_000, 3, 1000], [3, 10_000, 1000], [12_345, 6_789, 16_777_216], [5, 5, 1]]) {
      const size = fitToBudget(w, h, budget);
      expect(size.width * size.height).toBeLessThanOrEqual(budget);
      expect(Math.min(size.width, size.height)).toBeGreaterThanOrEqual(1);
    }
  });
});

describe('sniffMime', () => {
  const bytes = (...values: (number | string)[]) =>
    new Uint8Array(values.flatMap((v) => (typeof v === 'string' ? [...v].map((c) => c.charCodeAt(0)) : [v])));

  it('recognises formats by their first bytes', () => {
    expect(sniffMime(bytes(0x89, 'PNG', 0x0d, 0x0a, 0x1a, 0x0a))).toBe('image/png');
    expect(sniffMime(bytes(0xff, 0xd8, 0xff, 0xe0))).toBe('image/jpeg');
    expect(sniffMime(bytes('GIF89a'))).toBe('image/gif');
    expect(sniffMime(bytes('RIFF', 0, 0, 0, 0, 'WEBP'))).toBe('image/webp');
    expect(sniffMime(bytes(0, 0, 0, 0x18, 'ftypheic'))).toBe('image/heic');
    expect(sniffMime(bytes('hello world!'))).toBeNull();
  });

  it('treats .heic names as HEIC even without a type', () => {
    expect(isHeic('', 'IMG_0001.HEIC')).toBe(true);
    expect(isHeic('image/heif', 'x')).toBe(true);
    expect(isHeic('image/png', 'x.png')).toBe(false);
  });
});
