import { describe, expect, it } from 'vitest';

import { formatSeconds, structureDetails } from './format';

describe('structureDetails', () => {
  it('drops the model type the server puts first', () => {
    expect(structureDetails('qwen3_moe, MoE 128 experts top-8, untied lm_head', 'qwen3_moe')).toBe(
      'MoE 128 experts top-8, untied lm_head',
    );
  });

  it('is empty when the structure says nothing beyond the type', () => {
    expect(structureDetails('qwen3', 'qwen3')).toBe('');
    expect(structureDetails(undefined, 'qwen3')).toBe('');
  });

  it('keeps a structure that does not start with the type', () => {
    expect(structureDetails('vision tower', undefined)).toBe('vision tower');
  });
});

describe('formatSeconds', () => {
  it('gives tenths under 10 s, whole seconds under a minute, then minutes', () => {
    expect(formatSeconds(0.634)).toBe('0.6 s');
    expect(formatSeconds(12.3)).toBe('12 s');
    expect(formatSeconds(135)).toBe('2 min 15 s');
  });

  it('says unknown for what is not a duration', () => {
    expect(formatSeconds(null)).toBe('—');
    expect(formatSeconds(undefined)).toBe('—');
    expect(formatSeconds(Number.NaN)).toBe('—');
  });
});
