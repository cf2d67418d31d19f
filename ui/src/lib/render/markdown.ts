// Model output is untrusted text: markdown is rendered with marked, code highlighted with
// highlight.js, and the HTML always goes through DOMPurify before it reaches the page.

import DOMPurify from 'dompurify';
import { Marked, type Tokens } from 'marked';
import hljs from 'highlight.js/lib/core';
import bash from 'highlight.js/lib/languages/bash';
import c from 'highlight.js/lib/languages/c';
import cpp from 'highlight.js/lib/languages/cpp';
import css from 'highlight.js/lib/languages/css';
import diff from 'highlight.js/lib/languages/diff';
import go from 'highlight.js/lib/languages/go';
import java from 'highlight.js/lib/languages/java';
import javascript from 'highlight.js/lib/languages/javascript';
import json from 'highlight.js/lib/languages/json';
import markdown from 'highlight.js/lib/languages/markdown';
import python from 'highlight.js/lib/languages/python';
import rust from 'highlight.js/lib/languages/rust';
import shell from 'highlight.js/lib/languages/shell';
import sql from 'highlight.js/lib/languages/sql';
import swift from 'highlight.js/lib/languages/swift';
import typescript from 'highlight.js/lib/languages/typescript';
import xml from 'highlight.js/lib/languages/xml';
import yaml from 'highlight.js/lib/languages/yaml';

// Only common languages: the full highlight.js set would triple the bundle.
const languages = { bash, c, cpp, css, diff, go, java, javascript, json, markdown, python, rust, shell, sql, swift, typescript, xml, yaml };
for (const [name, language] of Object.entries(languages)) hljs.registerLanguage(name, language);

function escapeHtml(text: string): string {
  return text.replace(/[&<>"']/g, (char) => `&#${char.charCodeAt(0)};`);
}

function highlight(code: string, lang: string | undefined): { html: string; language: string } {
  const name = (lang ?? '').trim().split(/\s+/)[0].toLowerCase();
  if (name && hljs.getLanguage(name)) {
    return { html: hljs.highlight(code, { language: name, ignoreIllegals: true }).value, language: name };
  }
  return { html: escapeHtml(code), language: name };
}

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    code({ text, lang }: Tokens.Code): string {
      const { html, language } = highlight(text, lang);
      const label = language ? `<span class="code-lang">${escapeHtml(language)}</span>` : '';
      // The button is wired by event delegation in Message.svelte (inline handlers are stripped).
      return (
        `<div class="code-block"><div class="code-head">${label}` +
        `<button type="button" class="code-copy" data-copy-code aria-label="Copy code">Copy</button></div>` +
        `<pre><code class="hljs${language ? ` language-${escapeHtml(language)}` : ''}">${html}</code></pre></div>`
      );
    },
  },
});

let hooksInstalled = false;

function installHooks(): void {
  if (hooksInstalled) return;
  hooksInstalled = true;
  DOMPurify.addHook('afterSanitizeAttributes', (node) => {
    if (node.tagName === 'A' && node.hasAttribute('href')) {
      node.setAttribute('target', '_blank');
      node.setAttribute('rel', 'noopener noreferrer');
    }
    // A remote picture in an answer would be fetched silently (a tracking beacon); keep data: only.
    if (node.tagName === 'IMG' && !(node.getAttribute('src') ?? '').startsWith('data:image/')) {
      node.remove();
    }
  });
}

/** Untrusted markdown to safe HTML. */
export function renderMarkdown(source: string): string {
  installHooks();
  const html = marked.parse(source, { async: false });
  return DOMPurify.sanitize(html, {
    USE_PROFILES: { html: true },
    FORBID_TAGS: ['style', 'form', 'iframe', 'object', 'embed'],
    FORBID_ATTR: ['style'],
  });
}
