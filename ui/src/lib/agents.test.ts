import { describe, expect, it } from 'vitest';
import { agentSetups, MODEL_PLACEHOLDER } from './agents';

describe('agentSetups', () => {
  it('points each agent at the live server, key and model', () => {
    const [claude, codex, qwen] = agentSetups('http://127.0.0.1:9123', 's3cret', 'qwen3-4b');
    expect(claude.launch).toBe('rmlx launch claude --port 9123 --api-key s3cret --model qwen3-4b');
    expect(claude.manual).toContain('export ANTHROPIC_BASE_URL=http://127.0.0.1:9123\n');
    expect(claude.manual).toContain('ANTHROPIC_MODEL=qwen3-4b ANTHROPIC_SMALL_FAST_MODEL=qwen3-4b');
    expect(codex.launch).toBe('rmlx launch codex --port 9123 --api-key s3cret --model qwen3-4b');
    expect(codex.manual).toContain('base_url = "http://127.0.0.1:9123/v1"');
    expect(codex.manual).toContain('wire_api = "responses"');
    expect(codex.manual).toContain('RMLX_API_KEY=s3cret codex');
    expect(qwen.manual).toContain('OPENAI_BASE_URL=http://127.0.0.1:9123/v1 OPENAI_API_KEY=s3cret OPENAI_MODEL=qwen3-4b');
    expect(qwen.manual).toContain('qwen --auth-type openai --model qwen3-4b');
  });

  it('leaves out what the server does not need and quotes what a shell would split', () => {
    const [claude, codex] = agentSetups('http://192.168.1.5:8080/', null, null);
    expect(claude.launch).toBe('rmlx launch claude --host 192.168.1.5 --port 8080');
    expect(claude.manual).toContain('ANTHROPIC_API_KEY=rmlx');
    expect(codex.manual).toContain(`model = "${MODEL_PLACEHOLDER}"`);
    const [quoted] = agentSetups('http://127.0.0.1:8080', "it's secret", 'org/model name');
    expect(quoted.launch).toBe("rmlx launch claude --port 8080 --api-key 'it'\\''s secret' --model 'org/model name'");
  });
});
