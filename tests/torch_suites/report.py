"""Count what passed in a run of PyTorch's own tests (a pytest ``--junitxml`` file), by
suite, with the cause of each failure: ``python -m tests.torch_suites.report run.xml``."""

from __future__ import annotations

import collections
import re
import sys
import xml.etree.ElementTree as ET

_CAUSE = re.compile(r"^E?\s*(\w+(?:Error|Exception|Exit)|AssertionError|NotImplementedError)"
                    r"(:.*)?$")


def cause(text: str) -> str:
    """The last exception line a failed test's output shows (a child's, when it has one)."""
    lines = [ln.strip()[2:].strip() if ln.strip().startswith("E ") else ln.strip()
             for ln in text.splitlines()]
    found = [ln for ln in lines if _CAUSE.match(ln) and "exited with error code" not in ln]
    return (found[-1] if found else (lines[-1] if lines else "?"))[:160]


def summarize(path: str) -> dict[str, collections.Counter]:
    by_suite: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case in ET.parse(path).getroot().iter("testcase"):
        suite = case.get("classname", "?").rsplit(".", 1)[-1]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":  # an expected failure (a listed exception) or a skip
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        by_suite[suite][outcome] += 1
    return by_suite


def failures(path: str) -> list[tuple[str, str]]:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                name = f"{case.get('classname', '?').rsplit('.', 1)[-1]}.{case.get('name')}"
                out.append((name, cause((child.text or "") + "\n" + (child.get("message") or ""))))
    return out


def _line(suite: str, counts: collections.Counter) -> str:
    run = counts["passed"] + counts["failed"] + counts["xfailed"]
    return (f"  {suite:45s} {counts['passed']:4d} of {run:4d} passed "
            f"({counts['xfailed']} listed exceptions, {counts['failed']} other failures), "
            f"{counts['skipped']} skipped")


def main(argv: list[str]) -> None:
    for path in argv:
        total: collections.Counter = collections.Counter()
        print(f"{path}:")
        for suite, counts in sorted(summarize(path).items()):
            total.update(counts)
            print(_line(suite, counts))
        print(_line("total", total))
        for name, why in failures(path):
            print(f"    FAIL {name}: {why}")


if __name__ == "__main__":
    main(sys.argv[1:])
