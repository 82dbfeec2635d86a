"""Split the test files into groups of about equal GPU time, for several pytest processes on one machine.

    python tests/split_tests.py --procs 3          # one line per group: its test files
    python tests/split_tests.py --procs 3 --show   # with each group's expected seconds

A file's weight is its tests' time (skipped ones excluded) in the newest reports of the GPU suite that ran it,
among the records (``records/benchmarks/<card>-<YYYY-MM-DD>-<what>/**/junit*.xml``, and the test-times logs
``times*.jsonl`` that tests/conftest.py writes as tests end, which a process cut at a time limit leaves too,
naming the test it was in: that test weighs a process's share of its record, as does the test a process without
either was in, read from its ``pytest -v`` log ``tests*.log``; newest by the date in the folder name; with
``--extension``, those of the suite with the CUDA C++ extension built, ``junit_csrc*.xml`` and
``times_csrc*.jsonl``); a file no report has (no GPU test, or a new file) weighs the median of the files
that have one, so that such files spread over the groups (on a GPU host the CPU tests take time too, and
weighing nothing put them all in one group, which ran four times as long as the others). A file heavier than
half a group's share is split into its test functions (``tests/test_x.py::test_f``, every parametrisation of a
function together; found in the file's source, so a function no report has is still run), each weighed by its
own reports, or by the median of the file's weighed functions: one long file no longer sets the suite's time. A
function still heavier than half a share is split likewise into its parametrisations
(``tests/test_x.py::test_f[a]``, as ``pytest --collect-only`` finds them, so a case no report has is still run).
Groups are filled greedily, heaviest first, into the lightest group (the longest-processing-time rule), and each
group lists its files and functions in the tests folder's order.
``benchmarks/device_check.sh``'s tests stage runs one pytest process per group when ``TEST_PROCS`` > 1.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORD_DATE = re.compile(r"[a-z0-9]+-(\d{4}-\d{2}-\d{2})-")


def report_durations(junit: Path) -> dict[str, float]:
    """Seconds of each case that ran (not skipped) in one JUnit report, by pytest's node id
    (``tests/test_x.py::test_f[a-1]``, ``tests/test_x.py::TestC::test_f``); :func:`rolled_up` adds them up by
    function or file."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        parts = case.get("classname", "").split("::")[0].split(".")
        classes = []
        # pytest writes a test function's classname as the module path (tests.test_x) or with its class after it
        while parts and not parts[-1].startswith("test_"):
            classes.insert(0, parts.pop())
        if parts:
            key = "::".join(["/".join(parts) + ".py", *classes, case.get("name", "")])
            seconds[key] = seconds.get(key, 0.0) + float(case.get("time") or 0.0)
    return seconds


def log_durations(log: Path) -> tuple[dict[str, float], list[str]]:
    """``(seconds of each case that ran, cases started but never ended)`` of one test-times log (JSON lines that
    tests/conftest.py appends under ``DRES_TEST_TIMES``): the second names the test a process was in when it was
    cut."""
    seconds, started = {}, {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if "started" in entry:
            started[entry["test"]] = True
        else:
            started.pop(entry["test"], None)
            if not entry["skipped"]:
                seconds[entry["test"]] = entry["seconds"]
    return seconds, list(started)


# a line of pytest -v: the test's node id, then its outcome once it has ended
VERBOSE_TEST_LINE = re.compile(r"^(tests/\S+\.py::\S+) ?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)?")


def cut_test_of(verbose_log: Path) -> list[str]:
    """The test a suite process was in when it was cut, from its ``pytest -v`` log (``testsNAME-K.log``), as a
    list of one; none when the process ended (pytest's summary line) or had started no test. For the processes
    that wrote neither a JUnit report nor a test-times log."""
    running = None
    for line in verbose_log.read_text(errors="replace").splitlines():
        if line.startswith("=") and re.search(r" in [\d.]+s", line):
            return []
        m = VERBOSE_TEST_LINE.match(line)
        if m:
            running = None if m.group(2) else m.group(1)
    return [running] if running else []


def cut_logs(records: Path, extension: bool) -> list[Path]:
    """The ``pytest -v`` logs of the suite processes under ``records`` that were cut in a test (:func:`cut_test_of`)
    and left no report and no times log (before tests/conftest.py logged times)."""
    logs = []
    for log in records.glob("**/tests_csrc*.log" if extension else "**/tests*.log"):
        if log.name.startswith("tests_csrc") != extension:
            continue
        rest = log.name[len("tests"):-len(".log")]  # "-9", "_csrc-3"
        left_nothing = not any((log.parent / f"{kind}{rest}{suffix}").exists()
                               for kind, suffix in (("junit", ".xml"), ("times", ".jsonl")))
        if left_nothing and cut_test_of(log):
            logs.append(log)
    return logs


def report_cases(report: Path) -> tuple[dict[str, float], list[str]]:
    """``(seconds of each case that ran, the case its process was cut in, if any)`` of a JUnit report, a
    test-times log or the ``pytest -v`` log of a process that left neither."""
    if report.suffix == ".jsonl":
        return log_durations(report)
    if report.suffix == ".log":
        return {}, cut_test_of(report)
    return report_durations(report), []


def record_of(report: Path) -> tuple[str, str]:
    """``(date, folder)`` of the record a report belongs to: the nearest folder named ``<card>-<date>-<what>``."""
    for folder in report.parents:
        m = RECORD_DATE.match(folder.name)
        if m:
            return m.group(1), str(folder)
    return "", str(report.parent)


def newest_durations(reports: list[Path], by: str = "file") -> dict[str, float]:
    """Per test file (or function, or case: :func:`rolled_up`), its seconds in the newest record (by the date in
    its name) whose reports ran any of its tests. A record's reports add up (a suite split over processes writes
    one report each), a case that several of them ran counted once, at its longest (the extension's suite once
    ran test_csrc.py at the head of every process)."""
    by_record: dict[tuple[str, str], dict[str, float]] = {}
    cut: dict[tuple[str, str], tuple[set, int]] = {}  # per record: the cases its cut processes were in, its reports
    for report in reports:
        record = record_of(report)
        cases = by_record.setdefault(record, {})
        seconds, unfinished = report_cases(report)
        for case, secs in seconds.items():
            cases[case] = max(cases.get(case, 0.0), secs)
        held, n = cut.get(record, (set(), 0))
        cut[record] = (held | set(unfinished), n + 1)
    for record, (held, n) in cut.items():
        # a case that held its process until the cut weighs a process's share of the record at least
        share = sum(by_record[record].values()) / n
        for case in held - set(by_record[record]):
            by_record[record][case] = share
    durations: dict[str, float] = {}
    for record in sorted(by_record, reverse=True):
        for key, secs in rolled_up(by_record[record], by).items():
            durations.setdefault(key, secs)
    return durations


def rolled_up(cases: dict[str, float], by: str) -> dict[str, float]:
    """Case seconds (``file::test_f[a]``) added up by ``by``: "case" (as they are), "function" or "file"."""
    seconds: dict[str, float] = {}
    for case, secs in cases.items():
        key = case if by == "case" else case.split("::")[0] if by == "file" else case.split("[")[0]
        seconds[key] = seconds.get(key, 0.0) + secs
    return seconds


def test_functions(source: str) -> list[str]:
    """The test functions pytest collects from a test file's ``source``, in order: ``test_f`` at module level
    and ``TestC::test_f`` in its ``Test`` classes."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found += [f"{node.name}::{f.name}" for f in node.body
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test")]
    return found


def split_heavy_files(files: list[str], sources: dict[str, str], durations: dict[str, float],
                      function_durations: dict[str, float], procs: int) -> tuple[list[str], dict[str, float]]:
    """``(units, their durations)``: ``files`` in order, each file heavier than half a group's share of the known
    total replaced by its test functions (``file::function``), each weighed by ``function_durations`` or by the
    median of the file's weighed functions."""
    share = sum(durations.get(f, 0.0) for f in files) / procs
    units, weights = [], dict(durations)
    for f in files:
        functions = [f"{f}::{name}" for name in test_functions(sources[f])] if durations.get(f, 0.0) > share / 2 else []
        known = sorted(function_durations[u] for u in functions if u in function_durations)
        if len(functions) < 2 or not known:
            units.append(f)
            continue
        for u in functions:
            weights[u] = function_durations.get(u, known[len(known) // 2])
        units += functions
    return units, weights


def split_heavy_functions(units: list[str], weights: dict[str, float], case_durations: dict[str, float], procs: int,
                          cases_of: Callable[[str], list[str]]) -> tuple[list[str], dict[str, float]]:
    """``(units, their weights)`` with each test function heavier than half a group's share replaced by its
    parametrisations (``file::test_f[case]``, as ``cases_of`` collects them; one case alone or none collected keeps
    the function whole), each weighed by ``case_durations`` or by the median of the function's weighed cases, or
    else the function's weight shared out: six compiled cases of one function no longer run in one process."""
    share = sum(weights.get(u, 0.0) for u in units) / procs
    out, out_weights = [], dict(weights)
    for unit in units:
        cases = cases_of(unit) if "::" in unit and weights.get(unit, 0.0) > share / 2 else []
        if len(cases) < 2:
            out.append(unit)
            continue
        known = sorted(case_durations[c] for c in cases if c in case_durations)
        fallback = known[len(known) // 2] if known else weights[unit] / len(cases)
        for c in cases:
            out_weights[c] = case_durations.get(c, fallback)
        out += cases
    return out, out_weights


def collected_cases(paths: dict[str, str], unit: str) -> list[str]:
    """The node ids (``tests/test_x.py::test_f[case]``) pytest collects for the test function ``unit``
    (``tests/test_x.py::test_f``), its file as ``paths`` names it; none when the collection fails."""
    file, _, function = unit.partition("::")
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          f"{paths[file]}::{function}"], capture_output=True, text=True)
    ids = [line.partition("::")[2] for line in run.stdout.splitlines() if "::" in line]
    # the groups go to pytest through a shell's word splitting: an id with a space keeps its function whole
    if run.returncode != 0 or any(any(c.isspace() for c in i) for i in ids):
        return []
    return [f"{file}::{i}" for i in ids]  # pytest prints one node id a line; the unit's file named as the unit names it


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
    p.add_argument("--extension", action="store_true",
                   help="weigh by the reports of the suite with the CUDA C++ extension built (**/junit_csrc*.xml)")
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
    # each suite by its own reports: with the extension built, its tests (test_csrc.py's) run instead of skipping
    reports = sorted([r for pattern in ("**/junit*.xml", "**/times*.jsonl") for r in Path(args.records).glob(pattern)
                      if r.name.startswith(("junit_csrc", "times_csrc")) == args.extension]
                     + cut_logs(Path(args.records), args.extension))
    units, weights = split_heavy_files(list(paths), {f: Path(p).read_text() for f, p in paths.items()},
                                       newest_durations(reports), newest_durations(reports, by="function"),
                                       args.procs)
    units, weights = split_heavy_functions(units, weights, newest_durations(reports, by="case"), args.procs,
                                           lambda unit: collected_cases(paths, unit))
    for secs, group in split(units, weights, args.procs):
        # a unit is a file or file::function; the file part named as --tests gave it
        named = [paths[file] + sep + rest for file, sep, rest in (u.partition("::") for u in group)]
        print((f"{secs:.0f}s " if args.show else "") + " ".join(named))
    return 0


if __name__ == "__main__":
    sys.exit(main())
