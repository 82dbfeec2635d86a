"""tests/split_tests.py: the GPU suite split over pytest processes by the durations of earlier reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import split_tests


def _report(path: Path, cases: list[tuple[str, float, bool]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = "".join(f'<testcase classname="{c}" name="t{i}" time="{t}">{"<skipped/>" if skipped else ""}</testcase>'
                   for i, (c, t, skipped) in enumerate(cases))
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return path


def test_durations_come_from_the_newest_record_its_reports_added_and_a_repeated_case_once(tmp_path):
    old = _report(tmp_path / "h100-2026-11-26-gpu-suite" / "junit.xml",
                  [("tests.test_a", 50.0, False), ("tests.test_b", 7.0, False), ("tests.test_c", 9.0, False)])
    new = [_report(tmp_path / "h100-2026-11-27-suite" / "t1" / "junit.xml",
                   [("tests.test_a", 10.0, False), ("tests.test_a.TestGroup", 5.0, False), ("tests.test_b", 99.0, True)]),
           _report(tmp_path / "h100-2026-11-27-suite" / "t2" / "junit.xml", [("tests.test_a", 1.0, False)])]
    # skipped tests do not count
    assert split_tests.rolled_up(split_tests.report_durations(new[0]), "file") == {"tests/test_a.py": 15.0}
    # test_a from the newest record, its two reports added, but its case t0, which both ran (as every process of the
    # extension's suite once ran test_csrc.py), counted once at its longest; test_b's skipped run is not one, so the
    # older record holds
    assert split_tests.newest_durations([old, *new]) == {"tests/test_a.py": 15.0, "tests/test_b.py": 7.0,
                                                         "tests/test_c.py": 9.0}
    new.append(_report(tmp_path / "h100-2026-11-27-suite" / "t3" / "junit.xml", [("tests.test_a", 2.0, False)] * 3))
    assert split_tests.newest_durations([old, *new], by="case")["tests/test_a.py::t2"] == 2.0


def test_groups_balance_the_heaviest_files_first_and_keep_every_file_once():
    files = [f"tests/test_{n}.py" for n in "abcdefg"]
    durations = {"tests/test_a.py": 300, "tests/test_b.py": 200, "tests/test_c.py": 150, "tests/test_d.py": 100,
                 "tests/test_e.py": 50}
    groups = split_tests.split(files, durations, 3)
    # f and g have no report: each weighs the known files' median, 150, and they land in different groups
    assert [secs for secs, _ in groups] == [400, 350, 350]
    assert sorted(f for _, g in groups for f in g) == files
    assert groups[0][1] == ["tests/test_a.py", "tests/test_d.py"] and all(g == sorted(g) for _, g in groups)
    assert not any({"tests/test_f.py", "tests/test_g.py"} <= set(g) for _, g in groups)
    assert len(split_tests.split(files[:2], durations, 5)) == 2  # never an empty group


def test_main_prints_one_group_a_line_and_rejects_bad_arguments(tmp_path, capsys):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("test_x.py", "test_y.py", "helpers.py"):
        (tests / name).write_text("")
    _report(tmp_path / "records" / "h100-2026-11-27-suite" / "junit.xml", [("tests.test_y", 3.0, False)])
    # the extension's suite weighs its own groups only (--extension), and the plain suite's reports nothing there
    _report(tmp_path / "records" / "h100-2026-11-27-suite" / "csrc" / "junit_csrc-0.xml",
            [("tests.test_x", 50.0, False), ("tests.test_y", 40.0, False)])
    assert split_tests.main(["--procs", "2", "--tests", str(tests), "--records", str(tmp_path / "records"),
                             "--show"]) == 0
    # test_x has no report: it weighs what test_y does
    assert capsys.readouterr().out.splitlines() == [f"3s {tests / 'test_x.py'}", f"3s {tests / 'test_y.py'}"]
    assert split_tests.main(["--procs", "2", "--tests", str(tests), "--records", str(tmp_path / "records"),
                             "--show", "--extension"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"50s {tests / 'test_x.py'}", f"40s {tests / 'test_y.py'}"]
    with pytest.raises(SystemExit):
        split_tests.main(["--procs", "0"])
    with pytest.raises(SystemExit):
        split_tests.main(["--procs", "2", "--tests", str(tmp_path / "missing")])


def test_a_heavy_file_is_split_into_its_test_functions_each_run_once(tmp_path, capsys):
    source = ("import pytest\n\ndef helper():\n    pass\n\n@pytest.mark.parametrize('n', [1, 2])\ndef test_slow(n):\n"
              "    pass\n\ndef test_new():\n    pass\n\nclass TestGroup:\n    def test_inner(self):\n        pass\n\n"
              "    def helper(self):\n        pass\n\nclass Other:\n    def test_not_collected(self):\n        pass\n")
    assert split_tests.test_functions(source) == ["test_slow", "test_new", "TestGroup::test_inner"]
    report = _report(tmp_path / "records" / "h100-2026-11-27-suite" / "junit.xml",
                     [("tests.test_heavy", 40.0, False), ("tests.test_heavy", 50.0, False),
                      ("tests.test_heavy.TestGroup", 10.0, False), ("tests.test_light", 20.0, False)])
    # pytest's names carry the parametrisation: the report written above names them t0, t1, ...; as pytest does:
    report.write_text(report.read_text().replace('name="t0"', 'name="test_slow[1]"')
                      .replace('name="t1"', 'name="test_slow[2]"').replace('name="t2"', 'name="test_inner"'))
    assert split_tests.rolled_up(split_tests.report_durations(report), "function") == {
        "tests/test_heavy.py::test_slow": 90.0, "tests/test_heavy.py::TestGroup::test_inner": 10.0,
        "tests/test_light.py::t3": 20.0}
    files = ["tests/test_heavy.py", "tests/test_light.py"]
    units, weights = split_tests.split_heavy_files(
        files, {"tests/test_heavy.py": source, "tests/test_light.py": "def test_a():\n    pass\n"},
        split_tests.newest_durations([report]), split_tests.newest_durations([report], by="function"), 2)
    # test_heavy (100 s) is above half a group's share (60 s): its functions, test_new (no report) weighing the
    # median of the others; test_light stays whole
    assert units == ["tests/test_heavy.py::test_slow", "tests/test_heavy.py::test_new",
                     "tests/test_heavy.py::TestGroup::test_inner", "tests/test_light.py"]
    assert [weights[u] for u in units] == [90.0, 90.0, 10.0, 20.0]
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_heavy.py").write_text(source)
    (tests / "test_light.py").write_text("def test_a():\n    pass\n")
    assert split_tests.main(["--procs", "2", "--tests", str(tests), "--records", str(tmp_path / "records")]) == 0
    groups = [line.split() for line in capsys.readouterr().out.splitlines()]
    # and test_slow (90 s) is still above half a share: its two cases apart
    assert sorted(u for g in groups for u in g) == sorted(
        [f"{tests / 'test_heavy.py'}::{f}" for f in ("test_slow[1]", "test_slow[2]", "test_new", "TestGroup::test_inner")]
        + [str(tests / "test_light.py")])


def test_a_heavy_function_is_split_into_its_cases_as_pytest_collects_them(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_heavy.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('mode', ['a', 'b'])\n@pytest.mark.parametrize('dtype', ['x', 'y'])\n"
        "def test_slow(mode, dtype):\n    pass\n\n@pytest.mark.parametrize('n', ['one two'])\ndef test_spaced(n):\n"
        "    pass\n")
    paths = {"tests/test_heavy.py": str(tests / "test_heavy.py")}
    cases = split_tests.collected_cases(paths, "tests/test_heavy.py::test_slow")
    assert cases == [f"tests/test_heavy.py::test_slow[{d}-{m}]" for d in "xy" for m in "ab"]
    # an id with a space would be split by the shell that runs the groups; an unknown function collects nothing
    assert split_tests.collected_cases(paths, "tests/test_heavy.py::test_spaced") == []
    assert split_tests.collected_cases(paths, "tests/test_heavy.py::test_missing") == []
    units = ["tests/test_heavy.py::test_slow", "tests/test_light.py"]
    weights = {"tests/test_heavy.py::test_slow": 300.0, "tests/test_light.py": 100.0}
    # two cases ran before; the two others (a new case, one the last suite never reached) weigh their median
    case_durations = {cases[0]: 60.0, cases[1]: 100.0}
    split_units, split_weights = split_tests.split_heavy_functions(
        units, weights, case_durations, 2, lambda unit: split_tests.collected_cases(paths, unit))
    assert split_units == [*cases, "tests/test_light.py"]
    assert [split_weights[u] for u in split_units] == [60.0, 100.0, 100.0, 100.0, 100.0]
    # below half a group's share a function stays whole, and no collection runs for it
    light_heavy = {**weights, "tests/test_light.py": 700.0}
    assert split_tests.split_heavy_functions(units, light_heavy, case_durations, 1, lambda unit: 1 / 0)[0] == units
    # nothing known of its cases: the function's weight shared out
    assert split_tests.split_heavy_functions(units, weights, {}, 2, lambda unit: cases)[1][cases[0]] == 75.0


def test_times_logs_weigh_a_cut_process_and_the_test_it_was_in(tmp_path):
    record = tmp_path / "h200-2026-11-29-suite"
    record.mkdir()
    lines = [{"test": "tests/test_a.py::test_f[x]", "started": 1.0},
             {"test": "tests/test_a.py::test_f[x]", "seconds": 30.0, "skipped": False},
             {"test": "tests/test_a.py::test_skip", "started": 31.0},
             {"test": "tests/test_a.py::test_skip", "seconds": 0.1, "skipped": True},
             {"test": "tests/test_b.py::test_slow[dyn]", "started": 32.0}]  # the process was cut in this test
    (record / "times-0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert split_tests.log_durations(record / "times-0.jsonl") == ({"tests/test_a.py::test_f[x]": 30.0},
                                                                   ["tests/test_b.py::test_slow[dyn]"])
    # a finished process's JUnit report beside it: the record's share is (30 + 50) / 2 reports, the cut test's weight
    _report(record / "junit-1.xml", [("tests.test_c", 50.0, False)])
    reports = [record / "times-0.jsonl", record / "junit-1.xml"]
    assert split_tests.newest_durations(reports, by="case") == {
        "tests/test_a.py::test_f[x]": 30.0, "tests/test_c.py::t0": 50.0, "tests/test_b.py::test_slow[dyn]": 40.0}
    assert split_tests.newest_durations(reports) == {"tests/test_a.py": 30.0, "tests/test_c.py": 50.0,
                                                     "tests/test_b.py": 40.0}


def test_conftest_logs_each_test_as_it_starts_and_ends(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(Path(__file__).with_name("conftest.py").read_text())
    (tests / "test_toy.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\n@pytest.mark.skip\ndef test_skipped():\n"
                                       "    pass\n")
    log = tmp_path / "times.jsonl"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)], cwd=tmp_path,
                         env={**os.environ, "DRES_TEST_TIMES": str(log)}, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    seconds, unfinished = split_tests.log_durations(log)
    assert list(seconds) == ["tests/test_toy.py::test_ok"] and unfinished == []  # the skipped test weighs nothing
    assert len(log.read_text().splitlines()) == 4


def test_a_cut_process_without_times_names_its_test_from_its_verbose_log(tmp_path):
    record = tmp_path / "h200-2026-11-29-suite" / "tests"
    record.mkdir(parents=True)
    cut = ("collecting ... collected 3 items\n\ntests/test_a.py::test_f[x] PASSED [ 33%]\n"
           "tests/test_b.py::test_slow[dyn] \nTimeout (0:01:40)!\nThread 0x1 (most recent call first):\n")
    (record / "tests-0.log").write_text(cut)
    (record / "tests-1.log").write_text(cut.replace("tests/test_b.py::test_slow[dyn] \n", "tests/test_b.py::test_slow[dyn] "
                                                    "FAILED [ 66%]\n") + "===== 1 failed, 1 passed in 3.21s =====\n")
    _report(record / "junit-2.xml", [("tests.test_c", 50.0, False)])
    (record / "tests-2.log").write_text(cut)  # its process wrote a report: the report counts, not the log
    assert split_tests.cut_test_of(record / "tests-0.log") == ["tests/test_b.py::test_slow[dyn]"]
    assert split_tests.cut_test_of(record / "tests-1.log") == []  # it ended: pytest's summary line
    assert split_tests.cut_logs(tmp_path, extension=False) == [record / "tests-0.log"]
    assert split_tests.cut_logs(tmp_path, extension=True) == []
    # the cut test weighs the record's share: 50 s over its two reports (the report and the cut log)
    reports = [record / "junit-2.xml", *split_tests.cut_logs(tmp_path, extension=False)]
    assert split_tests.newest_durations(reports, by="case") == {"tests/test_c.py::t0": 50.0,
                                                                "tests/test_b.py::test_slow[dyn]": 25.0}
