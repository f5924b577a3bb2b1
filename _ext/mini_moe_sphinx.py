"""The book's own Sphinx extension (_config.yml: sphinx.local_extensions).

Each page lists every script once. Built with Jupyter Book 1, every page listed sphinx-thebe's inline
configuration script twice (one entry with the file name None, one with "", the same code; we
think one copy comes from Sphinx's registry and one from the builder, and have not traced it), and
the second copy's ``const THEBE_JS_URL`` declaration raised a SyntaxError in every browser (issue
49). A script that appears twice in a page is never wanted, so the page's list keeps each script's
first copy.
"""

from __future__ import annotations


def _script_key(script) -> tuple:
    """What makes two entries of ``script_files`` the same script: the file and its attributes
    (an inline script has no file, None in one copy and "" in the other, and its code in the
    ``body`` attribute)."""
    attributes = getattr(script, "attributes", {}) or {}
    return getattr(script, "filename", script) or "", tuple(sorted((k, str(v)) for k, v in attributes.items()))


def each_script_once(app, pagename, templatename, context, doctree) -> None:
    scripts, seen = [], set()
    for script in context.get("script_files", []):
        key = _script_key(script)
        if key not in seen:
            seen.add(key)
            scripts.append(script)
    context["script_files"] = scripts


def setup(app):
    app.connect("html-page-context", each_script_once, priority=900)  # after every other extension
    return {"parallel_read_safe": True, "parallel_write_safe": True}
