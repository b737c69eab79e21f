"""Every code block of README.md and docs/*.md runs, so none goes stale (md_blocks.py says how a
block is marked). Blocks of one document run in order, in one scratch directory that looks like
the repository root: its entries link to the source tree, `build` to the build directory and
`.venv/bin/python` to the interpreter below, so a block writes what a reader would type.

- cpp: the program CMake built from the block (tests/docs/CMakeLists.txt) runs and exits 0; the
  test first checks that it was built from the block's current text.
- python: run as a script by $MOED_DOCS_PYTHON, else the repository's .venv/bin/python, else
  /usr/bin/python3 with PYTHONPATH=$MOED_BUILD_DIR/python.
- sh / bash: run by bash -e.
- text starting with `$ `: each command runs and its standard output is compared with the lines
  under it in a stable form: numbers read as `#`, runs of blanks as one, blank lines dropped; a
  line `...` stands for any lines, `...` inside a line for any text.
- text marked <!-- check: paths -->: the first word of each unindented line is a path that exists.

Environment: MOED_BUILD_DIR (the build directory: bin/moed, python/), MOED_DOCS_CPP_DIR (the
built C++ blocks; default MOED_BUILD_DIR/tests/docs/cpp), MOED_DOCS_PYTHON, MOED_DOCS_ONLY (a
comma-separated list of documents to run, e.g. README.md).

    MOED_BUILD_DIR=build /usr/bin/python3 -m pytest -q tests/docs/test_code_blocks.py
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import md_blocks  # noqa: E402

ROOT = md_blocks.ROOT
BUILD = os.path.abspath(os.environ.get("MOED_BUILD_DIR", os.path.join(ROOT, "build")))
CPP_DIR = os.path.abspath(os.environ.get("MOED_DOCS_CPP_DIR",
                                          os.path.join(BUILD, "tests", "docs", "cpp")))
# Seconds a block may take: a bound against a hang, not a speed check. benchmarks.md's longest
# block takes about 40 s on a quiet 2-core machine and took over 120 s beside CI's other jobs.
TIMEOUT = 400

_only = [p.strip() for p in os.environ.get("MOED_DOCS_ONLY", "").split(",") if p.strip()]
DOCS = [d for d in md_blocks.doc_files() if not _only or d in _only]


def python_command():
    """(argv prefix, extra environment) of the interpreter that runs python blocks."""
    if os.environ.get("MOED_DOCS_PYTHON"):
        return [os.environ["MOED_DOCS_PYTHON"]], {}
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    if os.path.exists(venv):
        return [venv], {}
    return ["/usr/bin/python3"], {"PYTHONPATH": os.path.join(BUILD, "python")}


def environment(python=False):
    """The blocks' environment; python blocks also get the interpreter's (shell blocks reach it
    through the scratch directory's .venv/bin/python)."""
    env = dict(os.environ)
    if python:
        env.update(python_command()[1])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # As root OpenMPI refuses to start unless told (docs/multihost.md says so; CTest sets the same).
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    return env


def make_scratch():
    """A directory that looks like the repository root (see the module docstring)."""
    d = tempfile.mkdtemp(prefix="moed-docs-")
    for entry in os.listdir(ROOT):
        if entry in ("build", ".venv", ".git") or entry.startswith("build-"):
            continue
        os.symlink(os.path.join(ROOT, entry), os.path.join(d, entry))
    os.symlink(BUILD, os.path.join(d, "build"))
    argv, extra = python_command()
    os.makedirs(os.path.join(d, ".venv", "bin"))
    shim = os.path.join(d, ".venv", "bin", "python")
    with open(shim, "w") as f:
        exports = "".join(f"export {k}='{v}'${{{k}:+:${k}}}\n" for k, v in extra.items())
        f.write(f"#!/bin/sh\n{exports}exec {' '.join(argv)} \"$@\"\n")
    os.chmod(shim, 0o755)
    return d


def run(argv, cwd, what, python=False):
    try:
        p = subprocess.run(argv, cwd=cwd, env=environment(python), capture_output=True,
                           text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running after {TIMEOUT} s")
    if p.returncode != 0:
        pytest.fail(f"{what}: exit status {p.returncode}\n--- stdout ---\n{p.stdout[-4000:]}"
                    f"\n--- stderr ---\n{p.stderr[-4000:]}")
    return p.stdout


# ---- transcripts ----

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def stable(line):
    return re.sub(r"\s+", " ", _NUMBER.sub("#", line)).strip()


def transcript_matches(expected, actual):
    """expected / actual: output lines. True when they agree in the stable form."""
    exp = [stable(x) for x in expected if x.strip()]
    act = [stable(x) for x in actual if x.strip()]
    parts = []
    for x in exp:
        if x == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*".join(re.escape(s) for s in x.split("...")) + r"\n")
    return re.fullmatch("".join(parts), "".join(a + "\n" for a in act)) is not None


def parse_transcript(text):
    """[(command, expected output lines)] of a text block whose commands start with `$ `."""
    steps = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    return steps


# ---- the tests ----

def _blocks(path):
    return md_blocks.parse(path)


def test_every_block_has_a_language():
    for path in DOCS:
        for b in _blocks(path):
            assert b.lang, f"{b.where}: a fence without a language (```text for output or prose)"
            assert b.lang in md_blocks.RUN_LANGS | {"text"} or b.directive == "not run", (
                f"{b.where}: ```{b.lang} blocks are not run; mark it <!-- not run: why -->")
            if b.directive == "not run":
                assert b.argument, f"{b.where}: say why the block is not run and where it is tested"


@pytest.fixture(scope="module")
def scratch():
    """The scratch directory of a document (made on first use, removed at the end)."""
    dirs = {}

    def get(path):
        if path not in dirs:
            dirs[path] = make_scratch()
        return dirs[path]

    yield get
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)


def _cases():
    cases = []
    for path in DOCS:
        for b in _blocks(path):
            runs = b.lang in md_blocks.RUN_LANGS or (b.lang == "text" and (
                b.text.startswith("$ ") or b.directive == "check"))
            if runs and b.directive != "not run":
                cases.append(pytest.param(b, id=f"{b.path}:{b.line}:{b.lang}"))
    return cases


@pytest.mark.parametrize("block", _cases())
def test_block(block, scratch):
    cwd = scratch(block.path)
    what = f"{block.where} ({block.lang} block)"
    if block.lang == "cpp":
        exe = os.path.join(CPP_DIR, block.name)
        source = os.path.join(CPP_DIR, block.name + ".cc")
        if not os.path.exists(source) or open(source).read() != md_blocks.cpp_source(block):
            pytest.fail(f"{what}: {source} is not this block's text; rebuild (cmake --build) so "
                        f"tests/docs/CMakeLists.txt extracts it again")
        assert os.path.exists(exe), f"{what}: {exe} was not built"
        run([exe], cwd, what)
    elif block.lang == "python":
        script = os.path.join(cwd, f"{block.name}.py")
        with open(script, "w") as f:
            f.write(block.text)
        argv, _ = python_command()
        run(argv + [script], cwd, what, python=True)
    elif block.lang in ("sh", "bash"):
        run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd, what)
    elif block.directive == "check":
        assert block.argument == "paths", f"{what}: unknown check {block.argument!r}"
        for line in block.text.splitlines():
            if line and not line[0].isspace():
                path = line.split()[0]
                assert os.path.exists(os.path.join(ROOT, path)), f"{what}: {path} does not exist"
    else:
        for command, expected in parse_transcript(block.text):
            out = run(["bash", "-e", "-o", "pipefail", "-c", command], cwd, f"{what}: $ {command}")
            assert transcript_matches(expected, out.splitlines()), (
                f"{what}: `{command}` printed something else (compared with numbers as #):\n"
                f"--- the document ---\n" + "\n".join(expected) + "\n--- now ---\n" + out)
