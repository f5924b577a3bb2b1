"""`.ci/mutants.py`'s hand-kept lists name mutants by ``module:line:col:operator``, so an edit that
moves a line silently orphans an entry (issue 66 §3 found seven). Every entry of EQUIVALENT and
UNTESTABLE must name a mutant the current sources generate, and every mutated module has a test
subset whose files exist."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _mutants():
    spec = importlib.util.spec_from_file_location("ci_mutants", ROOT / ".ci" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_hand_classified_mutant_is_one_the_sources_generate():
    m = _mutants()
    current = {x["id"] for x in m.all_mutants()}
    stale = sorted((set(m.EQUIVALENT) | set(m.UNTESTABLE) | set(m.SURVIVOR_NOTES)) - current)
    assert not stale, f"entries naming no current mutant (a line moved? re-key them): {stale}"


def test_every_module_has_a_subset_of_existing_tests():
    m = _mutants()
    assert set(m.SUITE) == set(m.MODULES)
    for module, tests in m.SUITE.items():
        for test in tests:
            path, _, name = test.partition("::")
            assert (ROOT / path).is_file(), (module, test)
            assert not name or f"def {name}(" in (ROOT / path).read_text(), (module, test)
