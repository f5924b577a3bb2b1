"""Open built book pages in headless Chromium with no network and check what a reader sees.

The book is a web page and is tested like one (DESIGN.md §5): every equation must be typeset
by the math renderer that ships inside the build (no CDN), and every figure must load.

    python .ci/browser_check.py                          # _build/html: intro, every chapter, back matter
    python .ci/browser_check.py --html _build/html book/01_unified_formulation.html ...

It checks a book that is already built (`make book`, or `make nbval-book` as `make test` does):
by default the introduction, every chapter page (``book/NN_topic.html``) and the back matter (API
reference, references), so every part of the book. :data:`PROBE_PAGE` is a chapter whose code cells emit LaTeX outputs
(``display(Math(...))``, ``glue``); CI's self-check (.ci/book_selfcheck.py) builds it into a
throw-away book and checks it here, so that typesetting of cell outputs stays tested.

For each page, Chromium (found as $CHROMIUM, chromium, chromium-browser or google-chrome) runs
headless inside ``unshare -n`` when that works, and always with DNS resolution and proxying
pointed at nothing. The page is driven over the DevTools protocol on a pipe
(--remote-debugging-pipe), so nothing listens on a port and no extra Python package is needed.
A page passes when MathJax typeset every math element (``span.math``/``div.math`` each holds an
``mjx-container``, no ``mjx-merror``, no web font failed), no raw TeX delimiter is left in its
visible text outside code, no display equation is cut off where scrolling cannot reach it (in a
1280 px and a 412 px wide window), no code cell input is wider than its box (long lines wrap,
_static/mini_moe.css), and every ``<img>`` in the article has ``naturalWidth > 0``; a chapter page
must also show at least one typeset equation and one figure, and a probe page its LaTeX outputs.
It also reads the page as a reader does (issue 63, :data:`READER_JS`): no Markdown table left as
text, no output that is a lone value, no output, image or table wider than the article's column
(text outputs wrap, _static/mini_moe.css), and at least as many ``<table>`` elements as the page's
source displays (:func:`displayed_tables` of the executed notebook, nbval's or the build's own; for
a Markdown page, its source).
The pages of the table of contents' "Course kit" part (the labs, the instructor's page) are
numbered like chapters but are not held to the equation and figure rule.
A page with routing explorers (``.mini-moe-explorer``, mini_moe/explorer.js: the explorer page and
chapter 8) must also pass :func:`check_explorers`: every control (router, capacity factor, MoE
layer, image, Soft MoE slot), set the way a reader sets it, changes what is drawn; the expert drawn
on each patch equals what mini_moe computes in this process from the same model and images, for
one setting per model; no script error is raised or logged; the data stays within 2 MB. A screenshot of
each explorer goes to --screenshots (default _build/browser-check) and its path is printed.
Exit status 1 with a message saying what failed otherwise.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHONE_WIDTH = 412  # a second window width for the cut-off-equation check

PROBE_PAGE = textwrap.dedent(r'''
    ---
    jupytext:
      text_representation:
        extension: .md
        format_name: myst
    kernelspec:
      display_name: Python 3 (ipykernel)
      language: python
      name: python3
    ---

    # Browser probe

    Inline math $a^2 + b^2 = c^2$ and a numbered display equation:

    $$
    \operatorname{softmax}(\mathbf{x})_i = \frac{e^{x_i}}{\sum_j e^{x_j}}
    $$ (probe-softmax)

    An amsmath environment:

    \begin{align}
      \mathbf{y} &= \sum_{e=1}^{E} \sum_{c=1}^{C} \mathbf{C}_{t,e,c}\, f_e(\mathbf{X}_{e,c}) \\
      \mathbf{X}_{e,c} &= \sum_{t=1}^{T} \mathbf{D}_{t,e,c}\, \mathbf{x}_t
    \end{align}

    ```{code-cell} ipython3
    from IPython.display import Math, display
    from myst_nb import glue

    display(Math(r"\sum_{c=1}^{C} \mathbf{D}_{t,e,c} \le 1"))
    glue("probe_glued", Math(r"\tfrac{k T}{E}"), display=False)
    ```

    ```{code-cell} ipython3
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1, 2], [0, 1, 4])
    ax.set_title("probe figure");
    ```

    A glued LaTeX output inline: {glue:}`probe_glued`, and a reference to {eq}`probe-softmax`.

    A table in the prose:

    | router | picks |
    |---|---|
    | top-k | $k$ |

    ```{code-cell} ipython3
    from IPython.display import Markdown

    display(Markdown("A table a cell displays, with math and an em dash:\n\n"
                     "| router | $c = 1$ | share |\n|---|---|---|\n| top-k | 0.50 | 10 % |\n| EC | 0.75 | — |"))
    print("a long trace wraps inside its box: "
          + " ".join(f"step {i:4d} lambda={0.1 * i:.4f} sparsity={0.5:.3f};" for i in range(12)))
    ```
''').lstrip()

# Runs in the page: the measurements, returned as JSON.
MEASURE_JS = r"""
(() => {
  const main = document.querySelector('main article') || document.querySelector('article')
            || document.querySelector('main') || document.body;
  const maths = [...main.querySelectorAll('.math')];
  const unrendered = maths.filter(e => !e.querySelector('mjx-container'))
                          .map(e => e.textContent.trim().slice(0, 80));
  const errors = [...main.querySelectorAll('mjx-merror')]
                   .map(e => e.getAttribute('data-mjx-error') || e.textContent.slice(0, 80));
  const clone = main.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, textarea, mjx-container, .cell_input')
       .forEach(e => e.remove());
  const text = clone.textContent;
  const raw = [];
  for (const tok of ['$$', '\\begin{', '\\(', '\\[', '\\frac', '\\mathbf']) {
    const i = text.indexOf(tok);
    if (i >= 0) raw.push(JSON.stringify(text.slice(Math.max(0, i - 30), i + 50)));
  }
  // Prose that a stray or missing $ pulled into an equation: five plain words in a row in one
  // equation's TeX (outside \text{...}), which MathJax then sets as run-together italic letters.
  const swallowed = [];
  const items = window.MathJax && MathJax.startup && MathJax.startup.document && MathJax.startup.document.math;
  for (const item of (items || [])) {
    const tex = String(item.math || '');
    let run = 0, best = 0;
    for (const w of tex.replace(/\\(?:text|mathrm|operatorname|mbox|textrm|textbf|textit)\s*\{[^}]*\}/g, ' ').split(/\s+/))
      best = Math.max(best, run = /^[A-Za-z][A-Za-z'\u2019]+[,.;:]?$/.test(w) ? run + 1 : 0);
    if (best >= 5) swallowed.push(tex.replace(/\s+/g, ' ').slice(0, 90));
  }
  const imgs = [...main.querySelectorAll('img')].map(i => ({
    src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0,
    w: i.naturalWidth, h: i.naturalHeight, output: !!i.closest('.cell_output, figure, .figure')}));
  const fonts = document.fonts ? [...document.fonts] : [];
  return JSON.stringify({
    title: document.title,
    mathjax: !!(window.MathJax && MathJax.version) ? MathJax.version : null,
    math_elements: maths.length,
    mjx: main.querySelectorAll('mjx-container').length,
    mjx_display: main.querySelectorAll('mjx-container[display="true"]').length,
    output_math: main.querySelectorAll('.text_latex mjx-container').length,
    unrendered, errors, raw, swallowed, imgs,
    font_errors: fonts.filter(f => f.status === 'error').map(f => f.family),
    fonts_loaded: fonts.filter(f => f.status === 'loaded').map(f => f.family),
    mathjax_src: [...document.scripts].map(s => s.src).filter(s => /mathjax|tex-/i.test(s)),
  });
})()
"""

# Display equations whose typeset box sticks out of the text column where no scrolling reaches
# it (cut off at the left, or at the right of a box that does not scroll).
CLIPPED_JS = r"""
JSON.stringify([...document.querySelectorAll('main .math mjx-container[display="true"]')].filter(c => {
  const box = c.closest('.math').getBoundingClientRect();
  const m = (c.querySelector('mjx-math') || c).getBoundingClientRect();
  const scrolls = c.scrollWidth > c.clientWidth + 1 && /auto|scroll/.test(getComputedStyle(c).overflowX);
  return m.left < box.left - 1 || (m.right > box.right + 1 && !scrolls);
}).map(c => (c.querySelector('mjx-assistive-mml') || c).textContent.replace(/\s+/g, ' ').slice(0, 50)))
"""

# Code cell inputs whose text is wider than their box (cut at the column edge, or hidden behind a
# horizontal scroll): the first line of each.
WIDE_CODE_JS = r"""
JSON.stringify([...document.querySelectorAll('main div.cell_input pre')]
  .filter(p => p.scrollWidth > p.clientWidth + 1)
  .map(p => p.textContent.split('\n').reduce((a, b) => (b.length > a.length ? b : a), '').slice(0, 60)))
"""

# What a reader reads (issue 63), in the article at the window's width:
# - tables left as text: a paragraph, list item or cell output (outside code inputs and tables) whose
#   visible text holds a Markdown table rule (|---|, or |—| after docutils' smart quotes) or a row of
#   three or more pipes on one line;
# - stray values: a cell output that is nothing but a number (0.878, np.float64(0.5), Array(3.7,
#   dtype=float32)) or a matplotlib object's repr (Text(0.5, 1.0, '...'), [<matplotlib.lines...>]);
# - wide outputs and figures: an output, image or table that sticks out of the article's column
#   where no scrolling box of its own holds it, or a text output whose lines are cut at its box.
READER_JS = r"""
(() => {
  const main = document.querySelector('main article') || document.querySelector('article')
            || document.querySelector('main') || document.body;
  const visible = e => {
    const c = e.cloneNode(true);
    c.querySelectorAll('mjx-container, script, style, button, .copybtn, .cell_input').forEach(x => x.remove());
    return c.textContent;
  };
  const snippet = s => s.replace(/\s+/g, ' ').trim().slice(0, 90);
  const RULE = /\|\s*:?(?:-{3,}|[\u2014\u2013]+)\s*:?\s*\|/;
  const ROW = /^[ \t]*\|[^\n|]*\|[^\n|]*\|[^\n]*$/m;
  const textish = [...main.querySelectorAll('p, li, dd, .cell_output .output, .cell_output pre')]
    .filter(e => !e.closest('table, .cell_input, pre.literal-block') && !e.querySelector('p, li, .output'));
  const tables_as_text = [...new Set(textish.filter(e => { const s = visible(e); return RULE.test(s) || ROW.test(s); })
                                        .map(e => snippet(visible(e))))];
  const NUMBER = /^(?:(?:np\.)?(?:float|int)\d*\(|Array\(|tensor\()?\s*[-+]?(?:\d[\d_,]*\.?\d*|\.\d+|nan|inf)(?:[eE][-+]?\d+)?\s*(?:,\s*dtype=[\w.]+)?\s*\)?$/;
  const REPR = /^(?:\[?<matplotlib\.|Text\(-?[\d.]+, -?[\d.]+, |<Figure size |<Axes: |\[<Axes)/;
  const stray = [...main.querySelectorAll('.cell_output > .output')]
    .map(e => visible(e).trim()).filter(s => s && (NUMBER.test(s) || REPR.test(s))).map(snippet);
  const col = main.getBoundingClientRect();
  const scroller = (e, stop) => {
    for (let a = e.parentElement; a && a !== stop; a = a.parentElement) {
      const r = a.getBoundingClientRect();
      if (/auto|scroll/.test(getComputedStyle(a).overflowX) && r.right <= col.right + 1 && r.left >= col.left - 1)
        return a;
    }
    return null;
  };
  const wide = [];
  for (const e of main.querySelectorAll('.cell_output .output, .cell_output pre, .cell_output img, .cell_output table, '
                                        + '.cell_output svg, .cell_output iframe, .cell_output div[style], figure img, '
                                        + 'img, table')) {
    if (e.closest('mjx-container')) continue;
    const r = e.getBoundingClientRect();
    if (!r.width) continue;
    const out = r.right > col.right + 1 || r.left < col.left - 1;
    if (out && !scroller(e, main))
      wide.push(`${e.tagName.toLowerCase()} ${Math.round(r.width)} px in a ${Math.round(col.width)} px column: `
                + snippet(e.tagName === 'IMG' ? (e.getAttribute('src') || '') : visible(e)));
  }
  for (const p of main.querySelectorAll('.cell_output pre'))
    if (p.scrollWidth > p.clientWidth + 1)
      wide.push(`a text output cut at its box (${p.scrollWidth} px of text in ${p.clientWidth} px): `
                + snippet(p.textContent.split('\n').reduce((a, b) => (b.length > a.length ? b : a), '')));
  const tables = [...main.querySelectorAll('table')].filter(e => !e.closest('.highlight, .cell_input')).length;
  return JSON.stringify({tables_as_text, stray, wide: [...new Set(wide)], tables});
})()
"""

# Waits until MathJax finished typesetting (if it loaded at all) and images and fonts are in.
SETTLE_JS = r"""
(async () => {
  const t0 = Date.now();
  while (document.readyState !== 'complete' && Date.now() - t0 < 20000)
    await new Promise(r => setTimeout(r, 50));
  let state = 'no MathJax library';
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
    state = 'typeset';
  }
  await Promise.all([...document.images].map(i => { i.loading = 'eager';
    return i.decode().catch(() => null); }));
  if (document.fonts) await document.fonts.ready;
  await new Promise(r => setTimeout(r, 200));
  return state;
})()
"""


# A pipe table's delimiter row (|---|:---:|, two columns or more) and the line above it (its header).
TABLE_RULE = re.compile(r"^[ \t]*\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)+\|?[ \t]*$")
FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.S | re.M)
TABLE_DIRECTIVE = re.compile(r"^[ \t]*(`{3,}|:{3,})\{(list-table|csv-table)\}", re.M)


def markdown_tables(text: str) -> int:
    """Pipe tables (a delimiter row under a row with a pipe) and list/CSV-table directives in MyST
    Markdown ``text``, outside fenced code."""
    count = len(TABLE_DIRECTIVE.findall(text))
    text = FENCE.sub("", text)
    lines = text.splitlines()
    return count + sum(1 for i, line in enumerate(lines)
                       if i and "|" in lines[i - 1] and TABLE_RULE.match(line))


def executed_notebook(html: Path, page: str) -> Path | None:
    """The executed notebook that ``page`` was built from: nbval's recording (`make nbval-book`,
    _build/nbval) or the build's own execution (`make book`, _build/jupyter_execute), whichever
    holds outputs; None for a page built from no notebook."""
    import nbformat

    for folder in ("nbval", "jupyter_execute"):
        path = html.parent / folder / page.replace(".html", ".ipynb")
        if path.exists() and any(c.get("outputs") for c in nbformat.read(path, as_version=4).cells
                                 if c.cell_type == "code"):
            return path
    return None


def displayed_tables(notebook: Path) -> int:
    """The tables a reader must see for this notebook: pipe tables in its Markdown cells and in the
    Markdown its cells display, and HTML tables its cells display; cells tagged remove-cell or
    remove-output (and glue records, which a cell does not show) do not count."""
    import nbformat

    count = 0
    for cell in nbformat.read(notebook, as_version=4).cells:
        tags = set(cell.get("metadata", {}).get("tags", []))
        if "remove-cell" in tags:
            continue
        if cell.cell_type == "markdown":
            count += markdown_tables(cell.source)
        elif cell.cell_type == "code" and "remove-output" not in tags:
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                if "text/html" in data:
                    count += len(re.findall(r"<table\b", "".join(data["text/html"]), re.I))
                elif "text/markdown" in data:
                    count += markdown_tables("".join(data["text/markdown"]))
    return count


class Browser:
    """Headless Chromium driven over --remote-debugging-pipe (fd 3: commands, fd 4: replies)."""

    def __init__(self, executable: str, width: int = 1280, height: int = 900):
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="browser-check-profile-")
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-default-apps", "--disable-domain-reliability", "--metrics-recording-only",
            "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
            "--proxy-bypass-list=<-loopback>", "--hide-scrollbars", "--mute-audio",
            f"--window-size={width},{height}", "--force-device-scale-factor=1",
            f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank",
        ]
        self.isolation = "DNS/proxy blocked"
        prefix: list[str] = []
        for cand in (["unshare", "-n"], ["unshare", "-rn"]):
            if shutil.which("unshare") and subprocess.run(
                    cand + ["true"], capture_output=True).returncode == 0:
                prefix, self.isolation = cand, f"{' '.join(cand)} (no network namespace) + DNS/proxy blocked"
                break
        to_child_r, self._w = os.pipe()
        self._r, from_child_w = os.pipe()
        # Close-on-exec copies above fd 100, moved onto 3 and 4 in the child (dup2 clears
        # close-on-exec there); every other descriptor of ours is close-on-exec already.
        hi = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in (to_child_r, from_child_w)]

        def plumb():
            os.dup2(hi[0], 3)
            os.dup2(hi[1], 4)

        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(prefix + [executable] + flags, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log,
                                     close_fds=False, preexec_fn=plumb)
        for fd in (to_child_r, from_child_w, *hi):
            os.close(fd)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        self.session = None
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]
        self.resize(width, height)
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def resize(self, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError("Chromium exited:\n" + self.log.read().decode(errors="replace")[-3000:])
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def evaluate(self, expression: str, timeout: float = 60):
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True, "timeout": timeout * 1000},
                           timeout=timeout + 5)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, timeout: float = 60) -> None:
        self.events.clear()
        self.call("Page.navigate", {"url": url})
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._read(deadline))

    def screenshot(self, path: Path, max_height: int = 12000) -> list[Path]:
        """The whole page, taken with a window as tall as the page (captureBeyondViewport
        shifts this theme's layout sideways); a page taller than ``max_height`` comes in parts
        ``path-1.png``, ``path-2.png``, ... (Chromium draws at most about 16,000 px at once). The
        files written."""
        import base64
        height = int(self.call("Page.getLayoutMetrics")["cssContentSize"]["height"])
        parts = -(-height // max_height)
        self.resize(self.width, min(height, max_height))
        self.evaluate("new Promise(r => setTimeout(r, 300))")
        written = []
        for part in range(parts):
            self.evaluate(f"window.scrollTo(0, {part * max_height}); new Promise(r => setTimeout(r, 200))")
            data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
            target = path if parts == 1 else path.with_name(f"{path.stem}-{part + 1}{path.suffix}")
            target.write_bytes(base64.b64decode(data))
            written.append(target)
        self.evaluate("window.scrollTo(0, 0)")
        self.resize(self.width, self.height)
        return written

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._w)
        os.close(self._r)
        shutil.rmtree(self.profile, ignore_errors=True)


def find_chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    sys.exit("browser check: no Chromium found (apt-get install chromium, or set CHROMIUM)")


def check_page(browser: Browser, html: Path, page: str, shots: Path | None) -> tuple[dict, list[str]]:
    path = (html / page).resolve()
    if not path.is_file():
        return {}, [f"{page}: not built ({path} is missing)"]
    browser.open(path.as_uri())
    state = browser.evaluate(SETTLE_JS)
    m = json.loads(browser.evaluate(MEASURE_JS))
    m["state"] = state
    external = sorted({e["params"]["request"]["url"] for e in browser.events
                       if e.get("method") == "Network.requestWillBeSent"
                       and not e["params"]["request"]["url"].startswith(("file:", "data:", "blob:", "about:"))})
    failed_ids = {e["params"]["requestId"]: e["params"].get("errorText", "") for e in browser.events
                  if e.get("method") == "Network.loadingFailed"}
    failed_files = sorted({e["params"]["request"]["url"] for e in browser.events
                           if e.get("method") == "Network.requestWillBeSent"
                           and e["params"]["requestId"] in failed_ids
                           and e["params"]["request"]["url"].startswith("file:")})
    m["external"], m["failed_files"] = external, failed_files
    reader = json.loads(browser.evaluate(READER_JS))
    m["tables"] = reader["tables"]
    clipped, wide_code = {}, {}
    for width in (browser.width, PHONE_WIDTH):
        browser.resize(width, browser.height)
        clipped[width] = json.loads(browser.evaluate(CLIPPED_JS))
        wide_code[width] = json.loads(browser.evaluate(WIDE_CODE_JS))
    browser.resize(browser.width, browser.height)
    if shots:
        shots.mkdir(parents=True, exist_ok=True)
        browser.screenshot(shots / (page.replace("/", "_").removesuffix(".html") + ".png"))
    problems = check_explorers(browser, page, shots or html.parent / "browser-check")
    # Any script error or console error, the theme's included, while loading the page and while the
    # explorers' controls were moved (the theme's two were fixed at their source, issue 49).
    errors = [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown" or (
        e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") in ("error", "assert"))]
    if errors:
        problems.append(f"{len(errors)} script error(s) on the page, e.g. {json.dumps(errors[0]['params'])[:300]}")
    if m["unrendered"]:
        problems.append(f"{len(m['unrendered'])} of {m['math_elements']} math element(s) not typeset "
                        f"(MathJax: {state}; scripts {m['mathjax_src'] or 'none'}), "
                        f"e.g. {m['unrendered'][0]!r}")
    if m["errors"]:
        problems.append(f"{len(m['errors'])} MathJax error(s): {m['errors'][:3]}")
    if m["raw"]:
        problems.append(f"raw TeX visible in the text: {'; '.join(m['raw'][:3])}")
    if m["swallowed"]:
        problems.append(f"{len(m['swallowed'])} equation(s) holding a run of prose (a $ missing or misplaced, or "
                        f"display math that needs a blank line before it), e.g. {m['swallowed'][0]!r}")
    if m["font_errors"]:
        problems.append(f"web fonts failed to load: {sorted(set(m['font_errors']))}")
    bad = [i["src"] for i in m["imgs"] if not i["ok"]]
    if bad:
        problems.append(f"{len(bad)} of {len(m['imgs'])} image(s) did not load: {bad[:3]}")
    if failed_files:
        problems.append(f"local files failed to load: {failed_files[:5]}")
    for width, eqs in clipped.items():
        if eqs:
            problems.append(f"{len(eqs)} display equation(s) cut off in a {width} px wide window "
                            f"(no scrolling reaches the rest), e.g. {eqs[0]!r}")
    if reader["tables_as_text"]:
        problems.append(f"{len(reader['tables_as_text'])} Markdown table(s) left as text, e.g. "
                        f"{reader['tables_as_text'][0]!r}")
    if reader["stray"]:
        problems.append(f"{len(reader['stray'])} output(s) that are a lone value the page never explains "
                        f"(a cell's last expression?), e.g. {reader['stray'][0]!r}")
    if reader["wide"]:
        problems.append(f"{len(reader['wide'])} output(s) or figure(s) wider than the column: {reader['wide'][0]}")
    notebook = executed_notebook(html, page)
    markdown = html.parent.parent / page.replace(".html", ".md")
    source = notebook or (markdown if markdown.exists() else None)
    if source is not None:  # a chapter's executed notebook, else a Markdown page's source (the introduction)
        m["tables_expected"] = displayed_tables(source) if notebook else markdown_tables(source.read_text())
        if reader["tables"] < m["tables_expected"]:
            problems.append(f"{reader['tables']} <table> element(s) on the page, but its source displays "
                            f"{m['tables_expected']} table(s) ({source.relative_to(html.parent.parent)})")
    for width, lines in wide_code.items():
        if lines:
            problems.append(f"{len(lines)} code cell(s) wider than the column in a {width} px wide window, "
                            f"e.g. the line {lines[0]!r}")
    return m, [f"{page}: {p}" for p in problems]


#: The routing explorer's data may take this many characters on one page (issue 38: 2 MB).
EXPLORER_BUDGET = 2_000_000

EXPLORER_INFO_JS = r"""JSON.stringify([...document.querySelectorAll('.mini-moe-explorer')].map(root => {
  const script = root.querySelector('script.mme-data');
  const data = JSON.parse(script.textContent);
  const models = {};
  for (const [name, m] of Object.entries(data.models))
    models[name] = {capacities: m.capacities, layers: m.layers, slots: m.slots_per_expert,
                    dataset: m.dataset, source: m.source, null_experts: m.null_experts || 0};
  const datasets = {};
  for (const [name, d] of Object.entries(data.datasets)) datasets[name] = {count: d.images.length, source: d.source};
  return {id: root.id, chars: script.textContent.length, models, datasets, error: root.dataset.error || null,
          draws: Number(root.dataset.draws || 0), state: root.dataset.state || null};
}))"""

# Set control WHICH (model, capacity, layer, image, slot) of explorer ID to VALUE the way a reader
# does (the value, then the event the control fires); the drawn state, draws and patches after it.
EXPLORER_SET_JS = r"""((id, which, value) => {
  const root = document.getElementById(id), c = document.getElementById(id + '-' + which);
  c.value = String(value);
  c.dispatchEvent(new Event(which === 'image' ? 'input' : 'change', {bubbles: true}));
  return JSON.stringify({state: root.dataset.state, draws: Number(root.dataset.draws), value: c.value,
    disabled: c.disabled,
    experts: [...root.querySelectorAll('rect.mme-patch')].map(r => Number(r.dataset.expert)),
    real: [...root.querySelectorAll('rect.mme-patch')].map(r => r.dataset.real === undefined ? null : Number(r.dataset.real))});
})"""


def _set(browser: Browser, root: str, which: str, value) -> dict:
    return json.loads(browser.evaluate(f"{EXPLORER_SET_JS}({json.dumps(root)}, {json.dumps(which)}, "
                                       f"{json.dumps(str(value))})"))


def check_explorers(browser: Browser, page: str, shots: Path) -> list[str]:
    """The routing explorers on the open page (issue 38): each control changes the drawn state;
    the expert drawn on every patch, for one setting per model, equals what mini_moe computes in
    this process from the same model, images and capacity; no script error; the data within
    :data:`EXPLORER_BUDGET`. A screenshot of each goes to ``shots``."""
    roots = json.loads(browser.evaluate(EXPLORER_INFO_JS))
    if not roots:
        return []
    import numpy as np

    from mini_moe import explorer

    problems = []
    if sum(r["chars"] for r in roots) > EXPLORER_BUDGET:
        problems.append(f"the explorers' data takes {sum(r['chars'] for r in roots):,} characters, over the "
                        f"{EXPLORER_BUDGET:,} budget")
    for r in roots:
        root, models = r["id"], r["models"]
        if r["error"] or not r["draws"]:
            problems.append(f"explorer {root} did not draw: {r['error']}")
            continue
        names = list(models)
        with_capacity = next((n for n in names if models[n]["capacities"][0] is not None), None)
        soft = next((n for n in names if models[n]["slots"]), None)
        # each control, moved the way a reader moves it, changes what is drawn
        moves = []
        if len(names) > 1:
            moves.append(("model", names[0], names[1]))
        if with_capacity:
            # a model opens at its middle factor, so the first one is a change
            moves.append(("capacity", with_capacity, f"{models[with_capacity]['capacities'][0]:g}"))
        layered = next((n for n in names if models[n]["layers"] > 1), None)
        if layered:
            moves.append(("layer", layered, "1"))
        moves.append(("image", names[0], "5"))
        if soft:
            moves.append(("slot", soft, "0"))
        for which, model, value in moves:
            before = _set(browser, root, "model", model)
            if which != "model":
                before = _set(browser, root, "layer", "0")
            after = _set(browser, root, which, value)
            if after["state"] == before["state"] or after["draws"] <= before["draws"]:
                problems.append(f"explorer {root}: setting {which} to {value} (model {model}) changed nothing drawn")
        # the drawn experts against mini_moe in this process: for every model, one setting (the
        # capacity factors, layers and images taken in turn)
        settings = []
        for i, name in enumerate(names):
            caps = models[name]["capacities"]
            settings.append((name, caps[i % len(caps)], i % models[name]["layers"], (3 + 7 * i) % 24))
        compared = 0
        cache = {}
        for name, factor, layer, image in settings:
            m = models[name]
            count = r["datasets"][m["dataset"]]["count"]
            image = min(image, count - 1)
            _set(browser, root, "model", name)
            if factor is not None:
                _set(browser, root, "capacity", f"{factor:g}")
            _set(browser, root, "layer", str(layer))
            shown = _set(browser, root, "image", str(image))
            drawn = shown["experts"]
            if name not in cache:
                model, cfg, _ = explorer.load_source(m["source"], base=ROOT / "book")  # chapters run in book/
                cache[name] = (model, explorer.test_images(cfg, r["datasets"][m["dataset"]]["source"]["first"]))
            model, images = cache[name]
            view = explorer.batch_views(model, images[:count], factor)[layer][image]
            expected = np.asarray(view["expert"]).ravel().tolist()
            if drawn != expected:
                problems.append(f"explorer {root}: {name}, c = {factor}, layer {layer}, image {image}: drawn experts "
                                f"{drawn}, mini_moe computes {expected}")
            if m.get("null_experts"):  # each patch's count of real experts, on every image (a dropped patch: none)
                for index, v in enumerate(explorer.batch_views(model, images[:count], factor)[layer]):
                    shown = _set(browser, root, "image", str(index))
                    dropped = (np.asarray(v["expert"]) < 0) & ~np.asarray(v["null_only"], bool)
                    real = [None if d else int(n) for d, n in zip(dropped.ravel(), np.asarray(v["experts_per_patch"]).ravel())]
                    if shown["real"] != real:
                        problems.append(f"explorer {root}: {name}, layer {layer}, image {index}: drawn counts of real "
                                        f"experts {shown['real']}, mini_moe computes {real}")
                        break
            compared += len(expected)
        print(f"    explorer {root}: {len(names)} model(s), {len(moves)} control(s) moved, {compared} drawn patches "
              f"equal to mini_moe's routing; data {r['chars'] / 1e6:.2f} MB")
        shots.mkdir(parents=True, exist_ok=True)
        shot = shots / f"explorer-{page.replace('/', '_').removesuffix('.html')}-{root}.png"
        browser.evaluate(f"document.getElementById({json.dumps(root)}).scrollIntoView()")
        box = json.loads(browser.evaluate(f"(() => {{ const r = document.getElementById({json.dumps(root)})"
                                          ".getBoundingClientRect(); return JSON.stringify({x: r.x + window.scrollX, "
                                          "y: r.y + window.scrollY, width: r.width, height: r.height}); })()"))
        import base64
        png = browser.call("Page.captureScreenshot", {"format": "png", "clip": {  # page coordinates
            "x": box["x"], "y": box["y"], "width": max(box["width"], 1), "height": max(box["height"], 1), "scale": 1}})
        shot.write_bytes(base64.b64decode(png["data"]))
        print(f"    screenshot: {shot}")
    return problems


COURSE_KIT = "Course kit"


def course_kit(toc: Path) -> set[str]:
    """The pages (``book/NN_topic.html``) of the "Course kit" part of the book's ``_toc.yml``."""
    import yaml

    if not toc.exists():
        return set()
    parts = yaml.safe_load(toc.read_text()).get("parts", [])
    return {re.sub(r"\.(ipynb|md)$", "", entry["file"]) + ".html"
            for part in parts if part.get("caption") == COURSE_KIT for entry in part.get("chapters", [])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pages", nargs="*", help="pages relative to --html (default: book/intro.html, every "
                        "chapter page found, book/api.html and book/references.html); a chapter page "
                        "(book/NN_topic.html) must show an equation and a figure")
    parser.add_argument("--html", type=Path, default=ROOT / "_build" / "html",
                        help="a built book (default: _build/html, from `make book` or `make nbval-book`)")
    parser.add_argument("--screenshots", type=Path, help="save a full-page PNG of each page here (a long page in "
                        "parts, NAME-1.png, NAME-2.png, ...)")
    args = parser.parse_args(argv)

    html = args.html
    if not (html / "index.html").exists():
        sys.exit(f"browser check: {html} holds no built book (no index.html): run `make book` (or "
                 "`make nbval-book`) first, or pass --html")
    chromium = find_chromium()
    pages = args.pages or ["book/intro.html"] + sorted(p.relative_to(html).as_posix()
                                                        for p in html.glob("book/[0-9][0-9]_*.html")) + [
        p for p in ("book/api.html", "book/references.html") if (html / p).exists()]  # the back matter
    toc = html.resolve().parent.parent / "_toc.yml"  # the book of <book>/_build/html, else this repository's
    kit = course_kit(toc if toc.exists() else ROOT / "_toc.yml")
    chapters = [p for p in pages if re.fullmatch(r"book/\d\d_\w+\.html", p) and p not in kit]
    missing = [p for p in pages if not (html / p).exists()]
    if missing:
        sys.exit(f"browser check: no such page in {html}: {', '.join(missing)}")

    problems: list[str] = []
    browser = Browser(chromium)
    print(f"browser check: {Path(chromium).name}, network off: {browser.isolation}")
    try:
        for page in pages:
            m, page_problems = check_page(browser, html, page, args.screenshots)
            problems += page_problems
            if not m:
                continue
            figs = sum(i["ok"] for i in m["imgs"] if i["output"])
            print(f"  {page}: {m['mjx']} equation(s) rendered by MathJax {m['mathjax']} "
                  f"({m['mjx_display']} display, {m['output_math']} from cell outputs) "
                  f"of {m['math_elements']} math element(s); "
                  f"{sum(i['ok'] for i in m['imgs'])}/{len(m['imgs'])} image(s) loaded, {figs} figure(s); "
                  f"{m['tables']} table(s)" + (f" ({m['tables_expected']} displayed by its source)"
                                                if "tables_expected" in m else ""))
            if m["external"]:
                print(f"    blocked external request(s): {', '.join(m['external'][:5])}")
            if page in chapters and m["mjx"] == 0:  # a chapter without any equation typeset
                problems.append(f"{page}: no equation rendered (MathJax: {m['state']})")
            if page in chapters and figs == 0:
                problems.append(f"{page}: no figure loaded")
            if "browser_probe" in page and m["output_math"] < 2:
                problems.append(f"{page}: LaTeX cell outputs not typeset ({m['output_math']} of 2)")
    finally:
        browser.close()
    sys.stdout.flush()
    if problems:
        print("browser check FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"browser check: {len(pages)} page(s) render their equations and figures offline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
