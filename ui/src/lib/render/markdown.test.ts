// @vitest-environment jsdom
import { describe, expect, it } from 'vitest';
import { renderMarkdown } from './markdown';

/** The rendered HTML as a DOM, to ask structural questions. */
function render(source: string): HTMLElement {
  const root = document.createElement('div');
  root.innerHTML = renderMarkdown(source);
  return root;
}

describe('renderMarkdown', () => {
  it('renders markdown', () => {
    const root = render('# Title\n\nSome **bold** and `code`.\n\n- a\n- b');
    expect(root.querySelector('h1')?.textContent).toBe('Title');
    expect(root.querySelector('strong')?.textContent).toBe('bold');
    expect(root.querySelectorAll('li')).toHaveLength(2);
  });

  it('highlights fenced code and adds a copy button', () => {
    const root = render('```rust\nfn main() { let x = 1; }\n```');
    const code = root.querySelector('pre code');
    expect(code?.className).toContain('language-rust');
    expect(code?.querySelector('.hljs-keyword')?.textContent).toBe('fn');
    expect(code?.textContent).toBe('fn main() { let x = 1; }');
    expect(root.querySelector('button[data-copy-code]')).not.toBeNull();
  });

  it('escapes code in unknown languages', () => {
    const root = render('```nosuchlang\n<script>alert(1)</script>\n```');
    expect(root.querySelector('script')).toBeNull();
    expect(root.querySelector('code')?.textContent).toBe('<script>alert(1)</script>');
  });

  it('strips <script>, event handlers and javascript: URLs', () => {
    const html = renderMarkdown(
      'Hi <script>alert(1)</script>\n\n<img src="data:image/png;base64,AAAA" onerror="alert(2)">\n\n' +
        '<a href="javascript:alert(3)">x</a> [y](javascript:alert(4)) <svg onload="alert(5)"><circle /></svg>\n\n' +
        '<iframe src="https://evil.example"></iframe><div style="position:fixed" onclick="alert(6)">z</div>',
    );
    expect(html).not.toMatch(/<script/i);
    expect(html).not.toMatch(/onerror|onload|onclick/i);
    expect(html).not.toMatch(/javascript:/i);
    expect(html).not.toMatch(/<iframe|style=/i);
    const root = render('<img src=x onerror="alert(1)">');
    expect(root.querySelector('[onerror]')).toBeNull();
  });

  it('removes remote images (no silent fetches) but keeps data: images', () => {
    expect(render('![t](https://tracker.example/p.png)').querySelector('img')).toBeNull();
    expect(render('![ok](data:image/png;base64,AAAA)').querySelector('img')).not.toBeNull();
  });

  it('opens links in a new window without an opener', () => {
    const link = render('[rmlx](https://example.com)').querySelector('a');
    expect(link?.getAttribute('target')).toBe('_blank');
    expect(link?.getAttribute('rel')).toBe('noopener noreferrer');
  });
});
