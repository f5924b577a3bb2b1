"""The book built without executing a chapter (about 25 s): every page, the API reference
(autodoc) and every cross-reference, under the same -n (nitpicky) flag as the full build.

Nothing is executed, so every glue reference warns here; those warnings are the full build's to
check and are ignored. Any other warning or error fails, in CI's first minutes instead of after the
chapters have run (a docstring that names an undocumented object, a broken link in api.md).

Usage: python .ci/book_static.py
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    config = (ROOT / "_config.yml").read_text()
    static, n = re.subn(r"execute_notebooks:\s*force", 'execute_notebooks: "off"', config)
    if n != 1:
        print("book_static: _config.yml has no `execute_notebooks: force` line to switch off", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / ".ci"))
    from nbval_record import absolute_extension_paths

    static = yaml.safe_dump(absolute_extension_paths(yaml.safe_load(static), ROOT), sort_keys=False)
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "_config.yml").write_text(static)
        build = subprocess.run(
            [str(pathlib.Path(sys.executable).with_name("jupyter-book")), "build", str(ROOT),
             "--config", f"{tmp}/_config.yml", "--path-output", tmp, "-n", "--keep-going"],
            capture_output=True, text=True, cwd=ROOT)
    log = re.sub(r"\x1b\[[0-9;]*m", "", build.stdout + build.stderr)
    problems = [line for line in log.splitlines()
                if re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line) and "[mystnb.glue]" not in line]
    if build.returncode != 0 and not problems:
        problems = log.splitlines()[-30:]
    for line in problems:
        print(line)
    print(f"book_static: {len(problems)} problem(s) outside glue (nothing executed)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
