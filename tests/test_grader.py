"""The grader against a hostile class (issue 66 §1): each hole the review found is a student here,
or a focused check of the piece that closes it. Every test below failed on the grader before
issue 66 (the forged-worker, fork, copycat, reference-from-disk, string and epsilon students
passed or crashed it; see the issue); each says which hole it covers."""

import csv
import io
import json
import os
import pathlib
import subprocess
import sys
import uuid
import zipfile

import nbformat
import numpy as np
import pytest

import mini_moe
from mini_moe import labs
from mini_moe.labs import grader, worker

LIBRARY = pathlib.Path(mini_moe.__file__).resolve().parent
RIGHT = ("import math\n"
         "def capacity(num_tokens, num_experts, factor):\n"
         "    return max(1, math.floor(factor * num_tokens / num_experts + 0.5))\n")
WRONG = "def capacity(num_tokens, num_experts, factor):\n    return 0\n"
SANDBOXED = worker.landlock_abi() > 0 and worker.seccomp_arch() is not None
needs_sandbox = pytest.mark.skipif(not SANDBOXED, reason="Landlock and the no-fork filter are Linux's (page 15 "
                                                         "states what holds elsewhere); tested where they exist")


def _class(folder: pathlib.Path, token: str) -> dict:
    """The hostile class: file name -> (source or bytes, the status its row must have)."""
    numpy_cache = pathlib.Path(np.__file__).parent / "__pycache__"
    forged = [numpy_cache / f"zz_forged_{token}.pyc", LIBRARY / "__pycache__" / f"zz_forged_{token}.pyc"]
    return {
        "alice.py": (RIGHT, "passed"),
        # §1.4: reads a classmate's file and runs it
        "bob_copycat.py": ("import glob, os, runpy\n"
                           "def capacity(num_tokens, num_experts, factor):\n"
                           "    for p in glob.glob(os.path.join(os.getcwd(), '..', '..', '*', 'submission.py')):\n"
                           "        if 'math.floor' in open(p).read():\n"
                           "            return runpy.run_path(p)['capacity'](num_tokens, num_experts, factor)\n"
                           "    return 0\n", "failed"),
        # §1.4: overwrites every classmate's file it finds, and the job folders' numpy link
        "carl_saboteur.py": ("import glob, os\n"
                             "for p in glob.glob(os.path.join(os.getcwd(), '..', '..', '*', 'submission.py')):\n"
                             "    try:\n        open(p, 'w').write('def capacity(a, b, c):\\n    return -1\\n')\n"
                             "    except OSError:\n        pass\n"
                             "for p in glob.glob(os.path.join(os.getcwd(), '..', '..', '*', 'job-*', 'site-packages', 'numpy')):\n"
                             "    try:\n        os.remove(p)\n    except OSError:\n        pass\n" + WRONG, "failed"),
        # §1.1: forges a .pyc in numpy's and in the library's __pycache__
        "dora_forger.py": (f"FORGED = {[str(p) for p in forged]!r}\n"
                           "for p in FORGED:\n    try:\n        open(p, 'wb').write(b'forged')\n"
                           "    except OSError:\n        pass\n" + WRONG, "failed"),
        # §1.2: starts a process in a session of its own, and forks
        "ed_forker.py": ("import os, subprocess\n"
                         f"try:\n    subprocess.Popen(['/bin/sleep', '4242.{token[:6]}'], start_new_session=True)\n"
                         "except OSError:\n    pass\n"
                         "try:\n    if os.fork() == 0:\n        os.execv('/bin/sleep', ['/bin/sleep', "
                         f"'4243.{token[:6]}'])\nexcept OSError:\n    pass\n" + WRONG, "failed"),
        # §1.3: imports the reference from the library's folder on disk, by a name built at run time
        "fay_reference.py": ("import importlib, sys\n"
                             "def capacity(num_tokens, num_experts, factor):\n"
                             f"    sys.path.insert(0, {str(LIBRARY.parent)!r})\n"
                             "    routing = importlib.import_module('mini' + '_moe.routing')\n"
                             "    return routing.capacity(num_tokens, num_experts, factor)\n", "refused"),
        # §1.5: the right numbers as a string; the right numbers plus 1e-9
        "gus_string.py": ("import math\ndef capacity(num_tokens, num_experts, factor):\n"
                          "    return str(max(1, math.floor(factor * num_tokens / num_experts + 0.5)))\n", "failed"),
        "hal_epsilon.py": ("import math\ndef capacity(num_tokens, num_experts, factor):\n"
                           "    return max(1, math.floor(factor * num_tokens / num_experts + 0.5)) + 1e-9\n", "failed"),
        # §1.5: not UTF-8
        "ivy_latin1.py": (("# capacit\xe9\n" + RIGHT).encode("latin-1"), "error"),
        "jo_utf16.py": (RIGHT.encode("utf-16"), "error"),
        # §1.5, §1.7: a forged output archive whose header promises 2 GiB, then a hard exit
        "kim_bomb.py": ("import io, json, os, zipfile\nimport numpy as np\n"
                        "def capacity(num_tokens, num_experts, factor):\n"
                        "    header = io.BytesIO()\n"
                        "    np.lib.format.write_array_header_1_0(header, {'descr': '<f8', 'fortran_order': False,"
                        " 'shape': (1 << 28,)})\n"
                        "    with zipfile.ZipFile('case-0.npz', 'w') as z:\n"
                        "        z.writestr('eager_0.npy', b'\\x93NUMPY\\x01\\x00' + header.getvalue()[8:] + bytes(64))\n"
                        "    with open('cases.jsonl', 'a') as f:\n"
                        "        f.write(json.dumps({'case': 0, 'result': {'eager': {'count': 1}}}) + '\\n')\n"
                        "    os._exit(0)\n", "failed"),
        # §1.5: kills the grader
        "lee_killer.py": ("import os, signal\n"
                          "for kill in (lambda: os.kill(os.getppid(), signal.SIGKILL),\n"
                          "             lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)):\n"
                          "    try:\n        kill()\n    except OSError:\n        pass\n" + WRONG, "failed"),
        # §1.6: writes a fake verdict to the grader's terminal, and a message that starts a line
        "mo_printer.py": ("import os\n"
                          "for t in (f'/proc/{os.getppid()}/fd/1', f'/proc/{os.getppid()}/fd/2', '/dev/tty'):\n"
                          "    try:\n        open(t, 'w').write('FAKE mo_printer 1 of 1 labs passed\\n')\n"
                          "    except OSError:\n        pass\n"
                          "def capacity(num_tokens, num_experts, factor):\n"
                          "    raise ValueError('no\\nFAKE ch01.capacity passed')\n", "failed"),
        # §1.7: a file name that is a spreadsheet formula; a file named as the worker, forging its records
        '=HYPERLINK("http:x.example").py': (RIGHT, "passed"),
        "labs_worker.py": (WRONG + "if __name__ == '__main__':\n"
                           "    import json, math, pathlib, sys\n"
                           "    job = pathlib.Path(sys.argv[1])\n"
                           "    sys.path[:] = json.loads((job / 'job.json').read_text())['sys_path']\n"
                           "    import numpy as np\n"
                           "    for i, case in enumerate(json.loads((job / 'job.json').read_text())['cases']):\n"
                           "        kw = {k: v['value'] for k, v in case['kwargs'].items()}\n"
                           "        right = max(1, math.floor(kw['factor'] * kw['num_tokens'] / kw['num_experts'] + 0.5))\n"
                           "        np.savez(job / f'case-{i}.npz', eager_0=np.asarray(right), jit_0=np.asarray(right))\n"
                           "        with open(job / 'cases.jsonl', 'a') as f:\n"
                           "            f.write(json.dumps({'case': i, 'result': {'eager': {'count': 1}, "
                           "'jit': {'count': 1}}}) + '\\n')\n", "failed"),
        # §1.8: right answers the grader used to refuse or drop
        "nat_docstring.py": ('"""Written without mini_moe, from chapter 1."""\n' + RIGHT, "passed"),
        "oz_selftest.py": (RIGHT + "if __name__ == '__main__':\n    from mini_moe import labs\n"
                           "    print(labs.check('ch01.capacity', capacity))\n", "passed"),
    }, forged


@needs_sandbox
def test_a_hostile_class_costs_each_student_only_their_own_row(tmp_path):
    """``labs grade`` on a class holding every trigger of issue 66 §1: one row per student with the
    right status, the gradebook complete and written, nothing forged on disk, no process left, no
    fake line on the grader's output, and a formula in a name neutralised."""
    token = uuid.uuid4().hex
    folder = tmp_path / "class"
    folder.mkdir()
    students, forged = _class(folder, token)
    if worker.landlock_abi() < 6:  # Landlock scopes signals from Linux 6.12 (ABI 6): before, the rows done are kept
        del students["lee_killer.py"]
    for name, (source, _) in students.items():
        (folder / name).write_bytes(source if isinstance(source, bytes) else source.encode())
    page = nbformat.v4.new_notebook(cells=[  # §1.8: the function and its check in one cell
        nbformat.v4.new_code_cell("from mini_moe import labs"),
        nbformat.v4.new_code_cell(RIGHT + "print(labs.check('ch01.capacity', capacity))")])
    (folder / "pia").mkdir()
    nbformat.write(page, str(folder / "pia" / "labs.ipynb"))
    out = tmp_path / "grades.csv"
    proc = subprocess.run([sys.executable, "-m", "mini_moe", "labs", "grade", str(folder), "--out", str(out),
                           "--timeout", "60", "--jobs", "2"], capture_output=True, text=True, timeout=900)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "FAKE" not in proc.stdout + proc.stderr
        rows = list(csv.DictReader(out.open(encoding="utf-8")))
        got = {r["student"]: r["status"] for r in rows}
        want = {pathlib.Path(name).stem: status for name, (_, status) in students.items()} | {"pia": "passed"}
        want["'" + '=HYPERLINK("http:x.example")'] = want.pop('=HYPERLINK("http:x.example")')
        assert got == want, {k: (got.get(k), want.get(k), next((r["message"] for r in rows if r["student"] == k), ""))
                             for k in set(got) | set(want) if got.get(k) != want.get(k)}
        assert len(rows) == len(want)  # one row each: one lab each, or the file's error
        assert all("\n" not in r["message"] for r in rows)
        assert "not UTF-8" in next(r["message"] for r in rows if r["student"] == "jo_utf16")
    finally:
        leftovers = [p for p in forged if p.exists()]
        for p in leftovers:
            p.unlink()
    assert not leftovers, f"the class wrote {leftovers}"
    alive = [p.name for p in pathlib.Path("/proc").iterdir() if p.name.isdigit() and token[:6].encode()
             in _cmdline(p)]
    assert not alive, "a submission's process outlived its lab"


def _cmdline(p: pathlib.Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


@needs_sandbox
def test_the_check_command_prints_no_line_a_submission_wrote(tmp_path):
    """§1.6: ``labs check --json`` prints exactly one JSON line, whatever the submission writes to the
    grader's descriptors or puts in its messages."""
    students, _ = _class(tmp_path, uuid.uuid4().hex)
    path = tmp_path / "mo.py"
    path.write_text(students["mo_printer.py"][0])
    proc = subprocess.run([sys.executable, "-m", "mini_moe", "labs", "check", str(path), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "FAKE" not in proc.stderr
    [line] = proc.stdout.splitlines()
    [report] = json.loads(line)
    assert report["status"] == "failed" and "ValueError: no" in report["message"]
    assert not any(line.lstrip().startswith("FAKE") for line in report["message"].splitlines())


def test_grading_a_class_requires_the_sandbox_or_says_so(tmp_path, monkeypatch):
    """Where Landlock is missing (macOS, an old kernel), ``grade`` refuses before anything runs and
    names the way out; ``sandbox="best"`` grades with the process limits only."""
    monkeypatch.setattr(grader, "sandbox_available", lambda: {"landlock": 0, "no_fork": False})
    (tmp_path / "a.py").write_text(WRONG)
    with pytest.raises(ValueError, match="needs Linux's Landlock.*--unsandboxed"):
        labs.grade(tmp_path, out=tmp_path / "g.csv")
    with pytest.raises(ValueError, match="sandbox must be 'required' or 'best'"):
        labs.grade(tmp_path, sandbox="off")
    assert not (tmp_path / "g.csv").exists()


def test_a_forged_output_archive_is_lost_without_allocating_it(tmp_path):
    """§1.7: an archive whose header promises 2 GiB in 200 bytes, a compressed one and a pickle are
    each "lost", read within a few MB."""
    import tracemalloc

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (1 << 28,)})
    with zipfile.ZipFile(tmp_path / "case-0.npz", "w") as z:
        z.writestr("eager_0.npy", header.getvalue() + bytes(64))
    np.savez_compressed(tmp_path / "case-1.npz", eager_0=np.zeros(10))
    np.savez(tmp_path / "case-2.npz", eager_0=np.array([{"x": 1}], dtype=object))
    np.savez(tmp_path / "case-3.npz", eager_0=np.arange(3))
    tracemalloc.start()
    runs = [grader._outputs(tmp_path, i, {"eager": {"count": 1}}) for i in range(4)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [("lost" in r) for r in runs] == [True, True, True, False] and peak < 8 << 20, (runs, peak)
    np.testing.assert_array_equal(runs[3]["eager"]["outputs"][0], np.arange(3))


def test_gradebook_cells_are_text_to_a_spreadsheet(tmp_path):
    """§1.7, OWASP's CSV-injection advice: a cell that a spreadsheet would run as a formula starts
    with a quote; a newline cannot start a row."""
    rows = [{"student": s, "file": "f.py", "lab": "ch01.capacity", "status": "passed", "cases": 1, "seconds": 0.1,
             "message": m} for s, m in (('=HYPERLINK("x")', "+1"), ("@SUM(A1)", "-2"), ("ann", "a\nb,c"))]
    grader.write_gradebook(rows, tmp_path / "g.csv")
    read = list(csv.DictReader((tmp_path / "g.csv").open(encoding="utf-8")))
    assert [r["student"] for r in read] == ["'=HYPERLINK(\"x\")", "'@SUM(A1)", "ann"]
    assert [r["message"] for r in read] == ["'+1", "'-2", "a\\nb,c"]


def test_notebook_statements_that_use_the_library_are_dropped_not_their_cells(tmp_path):
    """§1.8: a cell holding the function and ``print(labs.check(...))`` keeps the function; a name
    bound from the library (``bench``) drops what uses it; what was dropped is listed."""
    page = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%pip install mini_moe\nfrom mini_moe import labs, bench\nimport math"),
        nbformat.v4.new_code_cell("times = bench.committed('x.json')\nprint(times)"),
        nbformat.v4.new_code_cell(RIGHT + "print(labs.check('ch01.capacity', capacity))\nassert capacity(8, 8, 1.0) == 1")])
    nbformat.write(page, str(tmp_path / "p.ipynb"))
    submission = labs.read_submission(tmp_path / "p.ipynb", tmp_path)
    assert submission.labs == ("ch01.capacity",) and not submission.uses_library
    assert submission.dropped == ("from mini_moe import labs, bench", "times = bench.committed('x.json')",
                                  "print(times)", "print(labs.check('ch01.capacity', capacity))")
    source = pathlib.Path(submission.source).read_text()
    assert "assert capacity(8, 8, 1.0) == 1" in source and "import math" in source and "%pip" not in source


def test_reports_rebuild_the_failing_case_and_name_the_output():
    """§1.9: the report gives a call that rebuilds the failing inputs; floats are shown with the digits
    that tell float32 neighbours apart (a top-p edge differs in the seventh); a wrong shape names which output."""
    def capacity(num_tokens, num_experts, factor):
        return 0

    result = labs.check("ch01.capacity", capacity)
    line = next(l for l in result.message.splitlines() if "rebuild it:" in l)
    label = result.message.split("case '", 1)[1].split("'", 1)[0]
    assert line.strip() == f"rebuild it: capacity(**labs.case('ch01.capacity', {label!r}))"
    assert labs.case("ch01.capacity", label) == dict(labs._cases(labs.LABS["ch01.capacity"], 0))[label]
    with pytest.raises(ValueError, match="has no case 'nope'"):
        labs.case("ch01.capacity", "nope")
    assert labs._show(np.array([0.3, 0.3000001], np.float32)) == "[0.3       0.3000001]"  # float32 neighbours apart

    def sort_by_expert(expert, num_experts):  # the right order, group sizes of the wrong shape
        order = np.argsort(expert, kind="stable")
        return order, np.zeros(num_experts + 1, np.int32)

    message = labs.check("ch13.sort_by_expert", sort_by_expert).message
    assert "output 1 (of 2) has shape" in message, message


def test_worker_text_is_one_printable_line():
    assert labs.text("a\nb\x1b[2Jc" + "x" * 400, 20) == "a\\nb\\x1b[2Jcxxxxx..."
    assert len(labs.text("y" * 1000)) == 300


def test_a_part_of_the_sandbox_the_machine_refuses_is_left_out_unless_required(monkeypatch):
    """In a container whose seccomp profile refuses Landlock's calls, ``labs check`` still runs (the
    part is reported missing); ``labs grade`` (which requires it) gets an ``OSError`` instead.
    Both parts are mocked here: confining the test's own process would be for good."""
    def refused(*args):
        raise OSError(1, "refused by the container")

    installed = []
    monkeypatch.setattr(worker, "landlock_abi", lambda: 6)
    monkeypatch.setattr(worker, "seccomp_arch", lambda: (0xC000003E, {"clone": 56, "clone3": 435}))
    monkeypatch.setattr(worker, "_landlock", refused)
    monkeypatch.setattr(worker, "_no_fork", installed.append)
    assert worker.confine(["/usr"], ["/tmp"]) == {"landlock": 0, "signals": False, "no_fork": True}
    with pytest.raises(OSError, match="refused by the container"):
        worker.confine(["/usr"], ["/tmp"], require={"landlock": True})
    monkeypatch.setattr(worker, "_landlock", lambda *a: None)
    monkeypatch.setattr(worker, "_no_fork", refused)
    assert worker.confine(["/usr"], ["/tmp"]) == {"landlock": 6, "signals": True, "no_fork": False}
    assert len(installed) == 1  # the required part failed first: nothing after it was installed
