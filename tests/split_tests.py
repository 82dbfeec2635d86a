"""Split the test files into groups of about equal GPU time, for several pytest processes on one machine.

    python tests/split_tests.py --procs 3          # one line per group: its test files
    python tests/split_tests.py --procs 3 --show   # with each group's expected seconds

A file's weight is its tests' time (skipped ones excluded) in the newest JUnit report of the GPU suite that
ran it, among the records (``records/benchmarks/<card>-<YYYY-MM-DD>-<what>/**/junit*.xml``, newest by the
date in the folder name; not the extension's suite, ``junit_csrc*.xml``, whose every process repeats test_csrc.py); a file no report has (no GPU test, or a new file) weighs the median of the files
that have one, so that such files spread over the groups (on a GPU host the CPU tests take time too, and
weighing nothing put them all in one group, which ran four times as long as the others). Groups are filled greedily, heaviest file first, into the lightest group (the
longest-processing-time rule), and each group lists its files in the tests folder's order.
``benchmarks/device_check.sh``'s tests stage runs one pytest process per group when ``TEST_PROCS`` > 1.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORD_DATE = re.compile(r"[a-z0-9]+-(\d{4}-\d{2}-\d{2})-")


def report_durations(junit: Path) -> dict[str, float]:
    """Seconds of the tests that ran (not skipped) per test file, as ``tests/test_x.py``, in one JUnit report."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        module = case.get("classname", "").split("::")[0]
        parts = module.split(".")
        # pytest writes a test function's classname as the module path (tests.test_x) or with its class after it
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if parts:
            path = "/".join(parts) + ".py"
            seconds[path] = seconds.get(path, 0.0) + float(case.get("time") or 0.0)
    return seconds


def record_of(report: Path) -> tuple[str, str]:
    """``(date, folder)`` of the record a report belongs to: the nearest folder named ``<card>-<date>-<what>``."""
    for folder in report.parents:
        m = RECORD_DATE.match(folder.name)
        if m:
            return m.group(1), str(folder)
    return "", str(report.parent)


def newest_durations(reports: list[Path]) -> dict[str, float]:
    """Per test file, its seconds in the newest record (by the date in its name) whose reports ran any of its
    tests; the reports of one record add up (a suite split over processes writes one report each)."""
    by_record: dict[tuple[str, str], dict[str, float]] = {}
    for report in reports:
        into = by_record.setdefault(record_of(report), {})
        for path, secs in report_durations(report).items():
            into[path] = into.get(path, 0.0) + secs
    durations: dict[str, float] = {}
    for record in sorted(by_record, reverse=True):
        for path, secs in by_record[record].items():
            durations.setdefault(path, secs)
    return durations


def split(files: list[str], durations: dict[str, float], procs: int) -> list[tuple[float, list[str]]]:
    """``procs`` groups of ``files`` as ``(expected seconds, files in their given order)``, heaviest first."""
    known = sorted(durations[f] for f in files if f in durations)
    unknown = known[len(known) // 2] if known else 1.0
    weight = {f: durations.get(f, unknown) for f in files}
    groups: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(min(procs, len(files)))]
    for f in sorted(files, key=lambda f: (-weight[f], f)):
        k = min(range(len(groups)), key=lambda i: (groups[i][0], i))
        groups[k] = (groups[k][0] + weight[f], groups[k][1] + [f])
    order = {f: i for i, f in enumerate(files)}
    return sorted(((secs, sorted(g, key=order.get)) for secs, g in groups), key=lambda g: -g[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, required=True, help="number of groups (pytest processes)")
    p.add_argument("--tests", default="tests", help="the tests folder (its test_*.py files are split)")
    p.add_argument("--records", default=str(REPO_ROOT / "records" / "benchmarks"),
                   help="where the JUnit reports of earlier GPU suites are found (**/junit*.xml, not junit_csrc*)")
    p.add_argument("--show", action="store_true", help="print each group's expected seconds before its files")
    args = p.parse_args(argv)
    if args.procs < 1:
        p.error(f"--procs must be at least 1, got {args.procs}")
    tests = Path(args.tests)
    if not tests.is_dir():
        p.error(f"--tests: {args.tests} is not a folder")
    # a file's key is its path as pytest reports it from the repository root (tests/test_x.py)
    paths = {f"tests/{f.name}": str(f) for f in sorted(tests.glob("test_*.py"))}
    if not paths:
        p.error(f"--tests: no test_*.py files in {args.tests}")
    # the suite without the extension: the extension's suite repeats test_csrc.py at the head of every process
    reports = sorted(r for r in Path(args.records).glob("**/junit*.xml") if not r.name.startswith("junit_csrc"))
    for secs, group in split(list(paths), newest_durations(reports), args.procs):
        print((f"{secs:.0f}s " if args.show else "") + " ".join(paths[f] for f in group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
