import { describe, expect, it } from 'vitest';

import { structureDetails } from './format';

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
