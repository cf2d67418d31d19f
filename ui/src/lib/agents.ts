// How each coding agent is pointed at an rMLX server: the one `rmlx launch` command, and the
// set-up by hand. The same set-up `rmlx launch` writes (crates/rmlx-cli/src/launch.rs) and
// docs/SERVER.md ("Coding agents") documents; Settings shows it with the live port and key.

export type AgentId = 'claude' | 'codex' | 'qwen';

export interface AgentSetup {
  id: AgentId;
  name: string;
  /** The agent's npm package (what to install when it is missing). */
  install: string;
  /** One command: `rmlx launch …`. */
  launch: string;
  /** The set-up by hand: shell lines (and, for Codex, its config.toml). */
  manual: string;
}

/** Placeholder while no model is known. */
export const MODEL_PLACEHOLDER = 'MODEL-ID';

function quoted(value: string): string {
  return /^[\w@%+=:,./-]+$/.test(value) ? value : `'${value.replaceAll("'", "'\\''")}'`;
}

/**
 * The set-ups for a server at `baseUrl` (`http://127.0.0.1:8080`, no path), its API key
 * (null: none; the agents still want some value) and a served model id.
 */
export function agentSetups(baseUrl: string, apiKey: string | null, model: string | null): AgentSetup[] {
  const url = new URL(baseUrl);
  const base = url.origin;
  const port = url.port || (url.protocol === 'https:' ? '443' : '80');
  const key = quoted(apiKey || 'rmlx');
  const id = quoted(model || MODEL_PLACEHOLDER);
  const options = [
    url.hostname === '127.0.0.1' ? '' : ` --host ${url.hostname}`,
    ` --port ${port}`,
    apiKey ? ` --api-key ${key}` : '',
    model ? ` --model ${id}` : '',
  ].join('');
  const launch = (agent: AgentId) => `rmlx launch ${agent}${options}`;
  return [
    {
      id: 'claude',
      name: 'Claude Code',
      install: 'npm install -g @anthropic-ai/claude-code',
      launch: launch('claude'),
      manual: [
        `export ANTHROPIC_BASE_URL=${base}`,
        `export ANTHROPIC_API_KEY=${key}`,
        `export ANTHROPIC_MODEL=${id} ANTHROPIC_SMALL_FAST_MODEL=${id}`,
        'export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1',
        'claude',
      ].join('\n'),
    },
    {
      id: 'codex',
      name: 'Codex CLI',
      install: 'npm install -g @openai/codex',
      launch: launch('codex'),
      manual: [
        '# ~/.codex/config.toml',
        `model = "${model || MODEL_PLACEHOLDER}"`,
        'model_provider = "rmlx"',
        '[model_providers.rmlx]',
        'name = "rMLX"',
        `base_url = "${base}/v1"`,
        'wire_api = "responses"',
        'env_key = "RMLX_API_KEY"',
        '',
        `# then: RMLX_API_KEY=${key} codex`,
      ].join('\n'),
    },
    {
      id: 'qwen',
      name: 'Qwen Code',
      install: 'npm install -g @qwen-code/qwen-code',
      launch: launch('qwen'),
      manual: [
        `export OPENAI_BASE_URL=${base}/v1 OPENAI_API_KEY=${key} OPENAI_MODEL=${id}`,
        `qwen --auth-type openai --model ${id}`,
      ].join('\n'),
    },
  ];
}
