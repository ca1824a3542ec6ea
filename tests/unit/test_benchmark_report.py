"""benchmarks/report.py: the README's generated tables are current with benchmarks/results/*.json,
and rewriting them leaves the hand-written text around them byte for byte (no model is loaded)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "benchmarks" / "README.md"


def _load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_report", ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


report = _load_report()


def _with_bodies(text: str, body: str) -> str:
    """``text`` with every generated region's body replaced by ``body``."""
    parts, pos = [], 0
    for region in report.find_regions(text):
        parts += [text[pos : region.start], body]
        pos = region.end
    return "".join([*parts, text[pos:]])


def test_committed_readme_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main(["--check"]) == 0, capsys.readouterr()
    assert [r.name for r in report.find_regions(README.read_text())] == list(report.RENDERERS)


def test_rewrite_keeps_text_outside_markers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # hand edits outside the regions, right against the markers, odd whitespace included
    edited = (
        README.read_text()
        .replace("<!-- generated: ttft -->\n", "Hand-written,  trailing spaces  \n<!-- generated: ttft -->\n")
        .replace("<!-- /generated -->\n", "<!-- /generated -->\n\t(kept)\n", 1)
        .replace("## Agent capacity\n", "## Agent capacity, renamed by hand\n")
    )
    edited += "\nA last paragraph without a final newline"
    readme = tmp_path / "README.md"
    readme.write_text(_with_bodies(edited, "stale\n"))

    assert report.main(["--check", "--readme", str(readme)]) == 1
    assert "ttft, ttft-zen5" in capsys.readouterr().out  # names the regions out of date
    assert report.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == edited
    assert report.main(["--check", "--readme", str(readme)]) == 0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("generated: capacity -->", "generated: no-such-table -->"), "no-such-table"),
        (lambda t: t.replace("<!-- generated: fanout -->\n", ""), "unexpected or malformed marker"),
        (lambda t: t.replace("<!-- generated: fanout -->", "<!--generated: fanout-->"), "malformed"),
        (lambda t: t.replace("<!-- /generated -->\n", "", 1), "unexpected or malformed marker"),
        (lambda t: _drop_region(t, "fanout"), "missing from the README: fanout"),
    ],
)
def test_markers_and_renderers_must_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[str], str], message: str
) -> None:
    readme = tmp_path / "README.md"
    original = edit(README.read_text())
    readme.write_text(original)
    assert report.main(["--readme", str(readme)]) == 2
    assert message in capsys.readouterr().err
    assert readme.read_text() == original  # nothing written


def _drop_region(text: str, name: str) -> str:
    region = next(r for r in report.find_regions(text) if r.name == name)
    start = text.rindex("<!--", 0, region.start)
    end = region.end + len("<!-- /generated -->\n")
    return text[:start] + text[end:]
