"""The notebooks that the book's Colab button opens: the executed chapters with their MyST roles
rendered, so that a Colab reader sees numbers and citations instead of raw markup.

Jupyter Book renders ``{glue:text}`key:fmt``` from the values that the executed notebook glued,
``{cite:p}``/``{cite:t}`` from references.bib, and ``{math}`` blocks as equations; Colab shows all
of them as raw text. This script takes the notebooks that ``make book`` executed
(``_build/jupyter_execute/book/*.ipynb``) and writes, for each, a copy whose Markdown has

- every ``{glue:text}`` role replaced by the value that chapter's run glued, formatted as the
  role asks (``:.1%``, ``:.2f``, ``:d``);
- every ``{cite:p}`` role replaced by "(Author et al., Year)" and every ``{cite:t}`` by
  "Author et al. (Year)", from references.bib;
- every ``{math}`` block as ``$$ ... $$``;

with the outputs removed (the reader runs the cells) and a first cell saying where the numbers
in the text come from. The book workflow publishes them on the ``colab`` branch, which
``_config.yml``'s ``repository.branch`` points the Colab button at.

    python .ci/colab.py --out _build/colab/book _build/jupyter_execute/book/*.ipynb
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
ROLE = re.compile(r"\{(glue:text|glue:|glue|cite:p|cite:t|cite)\}`([^`]*)`")  # {cite} reads as {cite:p}


class Latex(str):
    """A glued value whose output is LaTeX (``IPython.display.Math``): its TeX, without delimiters."""
MATH_BLOCK = re.compile(r"```\{math\}[^\n]*\n(.*?)```", re.S)
# An admonition (```{admonition} Title, ```{note}, ...): Colab shows it as a quoted block, title in bold.
ADMONITION = re.compile(r"```\{(admonition|note|tip|important|warning|caution|seealso)\}([^\n]*)\n(.*?)```", re.S)


def _plain(text: str):
    """A glued value from its text/plain form (the repr of a number or a string)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def glued_values(nb, glue_data: dict | None = None) -> dict:
    """The values a chapter glued, by key: from myst-nb's ``.glue.json`` (``glue_data``: key ->
    output, which is where an executed book notebook keeps them) and from glue outputs still in
    the notebook (``scrapbook`` display outputs, as a kernel writes them)."""
    values = {key: Latex(output["data"]["text/latex"].strip().strip("$").strip())
              if "text/latex" in output.get("data", {}) else _plain(output["data"]["text/plain"])
              for key, output in (glue_data or {}).items()
              if {"text/plain", "text/latex"} & set(output.get("data", {}))}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            record = output.get("metadata", {}).get("scrapbook")
            if output.get("output_type") != "display_data" or not record:
                continue
            prefix = record.get("mime_prefix", "")
            latex, text = output["data"].get(prefix + "text/latex"), output["data"].get(prefix + "text/plain")
            if latex is not None:
                values[record["name"]] = Latex(latex.strip().strip("$").strip())
            elif text is not None:
                values[record["name"]] = _plain(text)
    return values


def _last_names(people: str) -> list[str]:
    names = []
    for person in re.split(r"\s+and\s+", people.strip()):
        person = person.strip().strip("{}")
        names.append(person.split(",")[0].strip() if "," in person else person.split()[-1])
    return [name.strip("{}") for name in names]


def bibliography(path: Path) -> dict[str, tuple[str, str]]:
    """``key -> (authors, year)`` from a BibTeX file: "A", "A and B" or "A et al."."""
    entries = {}
    for match in re.finditer(r"@\w+\s*\{\s*([^,\s]+)\s*,(.*?)\n\}", path.read_text(), re.S):
        key, body = match.group(1), match.group(2)
        author = re.search(r"author\s*=\s*[{\"](.*?)[}\"]\s*,?\s*\n", body, re.S)
        year = re.search(r"year\s*=\s*[{\"]?(\d{4})", body)
        names = _last_names(" ".join(author.group(1).split())) if author else [key]
        short = names[0] if len(names) == 1 else (f"{names[0]} and {names[1]}" if len(names) == 2
                                                  else f"{names[0]} et al.")
        entries[key] = (short, year.group(1) if year else "n.d.")
    return entries


def _glue_text(spec: str, values: dict) -> str:
    """The role's text as myst-nb formats it: the type character of the spec decides the type."""
    key, _, fmt = spec.partition(":")
    if key not in values:
        raise KeyError(f"{{glue:text}}`{spec}`: the notebook glued no value named {key!r}")
    value = values[key]
    if not fmt:
        return str(value)
    kind = {**dict.fromkeys("bcdoxX", int), **dict.fromkeys("eEfFgGn%", float), "s": str}.get(fmt[-1])
    return format(kind(value) if kind else value, fmt)


def render_markdown(text: str, values: dict, refs: dict) -> str:
    """``text`` with glue and cite roles rendered, ``{math}`` blocks as ``$$`` and admonitions as quotes."""
    def role(match):
        kind, content = match.groups()
        if kind == "glue:text":
            return _glue_text(content, values)
        if kind in ("glue:", "glue"):  # the glued output itself: LaTeX as inline math, else its text
            value = values.get(content)
            if value is None:
                raise KeyError(f"{{{kind}}}`{content}`: the notebook glued no value named {content!r}")
            return f"${value}$" if isinstance(value, Latex) else str(value)
        keys = [k.strip() for k in content.split(",") if k.strip()]
        missing = [k for k in keys if k not in refs]
        if missing:
            raise KeyError(f"{{{kind}}}`{content}`: {missing} not in references.bib")
        if kind == "cite:t":
            return "; ".join(f"{refs[k][0]} ({refs[k][1]})" for k in keys)
        return "(" + "; ".join(f"{refs[k][0]}, {refs[k][1]}" for k in keys) + ")"

    text = MATH_BLOCK.sub(lambda m: "$$\n" + "\n".join(line for line in m.group(1).strip().splitlines()
                                                       if not line.startswith(":")) + "\n$$", text)
    text = ADMONITION.sub(_admonition, text)
    return ROLE.sub(role, text)


def _admonition(match) -> str:
    """An admonition block as a Markdown quote: its title (an admonition's own, else the kind) in
    bold, then its body without the directive's ``:option:`` lines."""
    kind, title, body = match.groups()
    lines = [line for line in body.strip().splitlines() if not line.startswith(":")]
    return "\n".join([f"> **{title.strip() or kind.capitalize()}**", ">"] + [f"> {line}".rstrip() for line in lines])


def colab_notebook(executed, refs: dict, note: str, glue_data: dict | None = None):
    """A copy of the executed notebook for Colab: Markdown rendered (glued values from the
    notebook's outputs and ``glue_data``), outputs removed, a note first."""
    nb = nbformat.reads(nbformat.writes(executed), as_version=4)  # a copy
    values = glued_values(nb, glue_data)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = render_markdown(cell.source, values, refs)
        elif cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(note))
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path, help="executed chapter notebooks")
    parser.add_argument("--out", type=Path, required=True, help="folder for the Colab notebooks")
    parser.add_argument("--bib", type=Path, default=ROOT / "references.bib")
    args = parser.parse_args(argv)
    refs = bibliography(args.bib)
    args.out.mkdir(parents=True, exist_ok=True)
    note = ("*This notebook is a chapter of the mini_moe book, prepared for Colab: the numbers in its text "
            "come from the book's own run of these cells; when you run them, the printed values are yours, "
            "and on another machine they may differ in the last digits.*")
    for path in args.notebooks:
        glue_file = path.with_suffix(".glue.json")  # myst-nb keeps a chapter's glued values here
        glue_data = json.loads(glue_file.read_text()) if glue_file.exists() else None
        nb = colab_notebook(nbformat.read(path, as_version=4), refs, note, glue_data)
        left = [m.group(0) for cell in nb.cells if cell.cell_type == "markdown"
                for m in re.finditer(r"\{(?:glue|cite)[^}]*\}`[^`]*`|```\{[a-z]+\}", cell.source)]
        if left:  # a role or directive this script does not render
            print(f"colab: {path.name}: MyST left unrendered: {left[:3]}", file=sys.stderr)
            return 1
        nbformat.write(nb, args.out / path.name)
        print(f"colab: wrote {args.out / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
