"""The suite's guard (tests/workspace_guard.py): a test that changes the folder the working
copy's params.yaml names, or the checkout's outputs, fails by name, and so does the run."""

from __future__ import annotations

from pathlib import Path

import pytest

GUARD = ["-p", "tests.workspace_guard", "-p", "no:cacheprovider"]


def checkout_with_photos(root: Path) -> Path:
    """A checkout whose params.yaml names photos outside it, by an absolute path."""
    photos = root.parent / f"{root.name}-photos"
    for label in ("cat", "dog"):
        (photos / label).mkdir(parents=True)
        (photos / label / "1.jpg").write_bytes(label.encode())
    (root / "params.yaml").write_text(f"ingest:\n  source_dir: {photos}\n")
    (root / "reports").mkdir()
    (root / "reports" / "ingest.json").write_text("{}")
    return photos


def test_a_test_that_empties_the_users_photos_fails_by_name(pytester: pytest.Pytester) -> None:
    photos = checkout_with_photos(pytester.path)
    pytester.makepyfile(
        test_inner=f"""
        import shutil
        from pathlib import Path

        PHOTOS = Path({str(photos)!r})

        def test_reads():
            assert (PHOTOS / "cat" / "1.jpg").read_bytes() == b"cat"

        def test_empties():
            shutil.rmtree(PHOTOS / "cat")
            (PHOTOS / "circle").mkdir()

        def test_after():
            pass
        """
    )
    result = pytester.runpytest_inprocess(*GUARD)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_inner.py::test_empties changed the user's data or the checkout's outputs*",
            f"*gone: {photos}/cat/1.jpg*",
            f"*new: {photos}/circle/*",
        ]
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_write_into_the_checkouts_outputs_fails_the_test(pytester: pytest.Pytester) -> None:
    checkout_with_photos(pytester.path)
    reports = pytester.path / "reports"
    pytester.makepyfile(
        test_inner=f"""
        from pathlib import Path

        def test_overwrites_a_report():
            Path({str(reports)!r}, "ingest.json").write_text('{{"records": 0}}')
        """
    )
    result = pytester.runpytest_inprocess(*GUARD)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"*changed: {reports}/ingest.json*"])


def test_a_session_fixtures_write_fails_the_run(pytester: pytest.Pytester) -> None:
    """A session fixture's teardown runs in the last test's: that test fails, and the run's
    end compares contents and fails naming it and what changed."""
    checkout_with_photos(pytester.path)
    pytester.makeconftest(
        f"""
        import pytest
        from pathlib import Path

        @pytest.fixture(scope="session", autouse=True)
        def leaves_a_model():
            yield
            Path({str(pytester.path)!r}, "models").mkdir()
            Path({str(pytester.path)!r}, "models", "model.keras").write_bytes(b"x")
        """
    )
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess(*GUARD)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*the test run changed the user's data or the checkout's outputs"
            " (test_inner.py::test_nothing)*",
            "*new: */models/model.keras*",
        ]
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_tests_that_leave_everything_pass(pytester: pytest.Pytester) -> None:
    photos = checkout_with_photos(pytester.path)
    pytester.makepyfile(
        test_inner=f"""
        from pathlib import Path

        def test_reads_and_writes_its_own_folder(tmp_path):
            assert len(list(Path({str(photos)!r}).rglob("*.jpg"))) == 2
            (tmp_path / "out.txt").write_text("mine")
        """
    )
    result = pytester.runpytest_inprocess(*GUARD)
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_the_guard_runs_beside_conftests_of_sub_folders(pytester: pytest.Pytester) -> None:
    """pluggy keeps plugins in sets: an unhashable guard broke every test under a folder
    with a conftest of its own (tests/e2e), an internal error of the whole run."""
    checkout_with_photos(pytester.path)
    pytester.mkpydir("sub")
    pytester.makeconftest("")
    (pytester.path / "sub" / "conftest.py").write_text("import pytest\n")
    (pytester.path / "sub" / "test_inner.py").write_text("def test_nothing():\n    pass\n")
    (pytester.path / "test_top.py").write_text("def test_top():\n    pass\n")
    result = pytester.runpytest_inprocess(*GUARD)
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
