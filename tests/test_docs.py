"""README.md and docs/*.md stay true (docs/design.md, "Docs that stay true").

- Every fenced example whose info string is `python runnable` runs, as a script from the repository
  root, in its own process (OMP_NUM_THREADS=1, examples/ on the path, a time limit).
- Every repository path named exists, every `python -m X` imports, every dotted `gradsched.x` in
  backticks resolves, every `--flag` of gradsched.train / gradsched.dryrun exists, every relative
  link (and its #anchor) resolves, every SyncOptions field is in the options table, and the README
  stays a short landing page.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import os
import re
import runpy
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220
EXAMPLE_TIMEOUT_S = 180

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")  # inline code may wrap onto the next line
# a repository path: starts with one of the repository's top-level folders (not inside a longer name)
REPO_PATH = re.compile(r"(?<![\w./-])((?:gradsched|passes|tests|benchmarks|examples|docs|\.ci)/[\w./*-]*[\w/*])")
TEST_FILE = re.compile(r"(?<![\w./-])(test_\w+\.py)\b")
MODULE = re.compile(r"(?:^|\s)-m\s+([A-Za-z_][\w.]*)")
DOTTED = re.compile(r"(?<![\w.])(gradsched(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
ENTRY_POINTS = ("gradsched.train", "gradsched.dryrun")
NOT_NAMES = {"gradsched.manifest"}  # a checkpoint's file, not a module


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def fences(text: str):
    """(info string, body, line number of the opening fence) of each fenced block."""
    for m in FENCE.finditer(text):
        yield m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 1


def without_fences(text: str) -> str:
    """The text with each fenced block blanked (its line count kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def inline_code(text: str):
    """(line number, content) of each inline code span outside the fenced blocks."""
    text = without_fences(text)
    for m in INLINE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " ")


def runnable_examples():
    out = []
    for doc in DOCS:
        for info, body, line in fences(doc.read_text()):
            if info.split() == ["python", "runnable"]:
                out.append(pytest.param(body, id=f"{rel(doc)}:{line}"))
    return out


RUNNABLE = runnable_examples()


def test_there_are_runnable_examples():
    assert len(RUNNABLE) >= 2, "README.md's examples are marked ```python runnable"


@pytest.mark.parametrize("code", RUNNABLE)
def test_runnable_example_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "examples"), os.environ.get("PYTHONPATH")) if p)}
    # a session of its own, so a timeout ends the example's rank processes too
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the example ran over {EXAMPLE_TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"the example exited with {proc.returncode}:\n{out[-4000:]}"


def test_readme_is_a_short_landing_page():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_every_repository_path_named_exists():
    missing = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for path in REPO_PATH.findall(line):
                if not any(ROOT.glob(path.rstrip("/"))):
                    missing.append(f"{rel(doc)}:{n}: {path}")
            for name in TEST_FILE.findall(line):
                if not (ROOT / "tests" / name).exists():
                    missing.append(f"{rel(doc)}:{n}: tests/{name}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_module_run_with_python_m_imports():
    missing = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for module in MODULE.findall(line):
                if importlib.util.find_spec(module) is None:
                    missing.append(f"{rel(doc)}:{n}: python -m {module}")
    assert not missing, "modules the docs run that do not exist:\n" + "\n".join(missing)


def resolves(dotted: str) -> bool:
    """A module, or an attribute reached from the longest importable module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_gradsched_name_resolves():
    missing = []
    for doc in DOCS:
        for n, span in inline_code(doc.read_text()):
            for name in DOTTED.findall(span):
                if name not in NOT_NAMES and not resolves(name):
                    missing.append(f"{rel(doc)}:{n}: {name}")
    assert not missing, "gradsched names in the docs that do not exist:\n" + "\n".join(missing)


def entry_point_flags(module: str) -> set[str]:
    """The flags `python -m module --help` lists."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [module, "--help"]
    try:  # runpy warns when the module was imported before (by the dotted-name check): harmless here
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = argv
    return set(FLAG.findall(out.getvalue()))


def named_flags(doc: Path) -> dict[str, list[tuple[int, str]]]:
    """Flags given to each entry point: on a command line after `-m <entry point>` (in a fence, continuation
    lines joined, or in inline code), and in inline code inside a section whose heading names
    `python -m <entry point>`."""
    text, found = doc.read_text(), {m: [] for m in ENTRY_POINTS}
    for _, body, start in fences(text):
        for n, line in enumerate(re.sub(r"\\\n", " ", body).splitlines(), start + 1):
            for module in ENTRY_POINTS:
                m = re.search(rf"-m\s+{re.escape(module)}\b(.*)", line)
                if m:
                    found[module] += [(n, f) for f in FLAG.findall(m.group(1).split("#")[0])]
    headings = [(n, line) for n, line in enumerate(without_fences(text).splitlines(), 1) if line.startswith("#")]
    for n, span in inline_code(text):
        for module in ENTRY_POINTS:  # a command line in inline code
            m = re.search(rf"-m\s+{re.escape(module)}\b(.*)", span)
            if m:
                found[module] += [(n, f) for f in FLAG.findall(m.group(1))]
        heading = next((h for hn, h in reversed(headings) if hn <= n), "")
        section = next((m for m in ENTRY_POINTS if f"python -m {m}" in heading), None)
        if section:
            found[section] += [(n, f) for f in FLAG.findall(span)]
    return found


def test_every_flag_given_to_an_entry_point_exists():
    flags = {m: entry_point_flags(m) for m in ENTRY_POINTS}
    wrong = [f"{rel(doc)}:{n}: python -m {module} {flag}"
             for doc in DOCS for module, named in named_flags(doc).items()
             for n, flag in named if flag not in flags[module]]
    assert not wrong, "flags the entry points do not have:\n" + "\n".join(wrong)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen, out = {}, set()
    for line in without_fences(doc.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for n, line in enumerate(without_fences(doc.read_text()).splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (doc.parent / path).resolve() if path else doc
                if not dest.exists():
                    broken.append(f"{rel(doc)}:{n}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{rel(doc)}:{n}: {target} (no such heading)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_the_options_table_lists_every_option():
    from gradsched.options import SyncOptions
    text = (ROOT / "docs" / "parallelism.md").read_text()
    table = text[text.index("## Options"):].split("\n\n")[2]
    named = {name for row in table.splitlines()[2:] for name in INLINE.findall(row.split("|")[1])}
    fields = {f.name for f in dataclasses.fields(SyncOptions)}
    assert named == fields, f"not in docs/parallelism.md's table: {sorted(fields - named)}; " \
                            f"not options: {sorted(named - fields)}"


def test_the_tested_combinations_table_lists_the_option_matrix_rows():
    import test_option_matrix as matrix
    text = (ROOT / "docs" / "parallelism.md").read_text()
    table = text[text.index("## Tested combinations"):].split("| case |")[1].split("\n\n")[0]
    rows = [[c.strip() for c in row.split("|")[1:4]] for row in table.splitlines()[2:] if row.startswith("|")]
    assert [r[0] for r in rows] == [*matrix.CASES, *matrix.INDUCTOR]
    from gradsched.training.pipeline_schedule import resolve_schedule
    names = {"gpipe": "GPipe", "1f1b": "1F1B", "zb1p": "ZB-H1 (`zb1p`)", "zbv": "ZB-V (`zbv`)",
             "interleaved_1f1b": "interleaved 1F1B", "dualpipev": "DualPipeV (`dualpipev`)"}
    for (name, layout, schedule), job in zip(rows, [*matrix.CASES.values(), *matrix.INDUCTOR.values()]):
        m = job.options.get("microbatches", 1)
        ran = names[resolve_schedule(job.schedule, job.pp, m)] if job.pp > 1 else "-"
        assert (layout, schedule) == (f"{job.pp} x {job.dp} x {job.cp}", f"{ran}, {m}"), name
