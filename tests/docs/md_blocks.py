"""The fenced code blocks of README.md and docs/*.md, for tests/docs/test_code_blocks.py (which
runs them) and tests/docs/CMakeLists.txt (which builds the C++ ones against the library).

A block's language is the first word after the fence: cpp, python, sh / bash (run), text (not
run, unless its first line starts with `$ `: then it is a transcript, each `$ command` run and
its output compared). An HTML comment on the line right above a fence says more:
    <!-- not run: REASON -->   the block is not run; the reason says where the same is tested
    <!-- check: paths -->      a text block whose lines name paths of the tree: each must exist

    python3 tests/docs/md_blocks.py list                      # every block: file:line lang
    python3 tests/docs/md_blocks.py extract-cpp --out DIR     # DIR/<name>.cc; prints the names
"""
import argparse
import dataclasses
import glob
import os
import re
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^\s`]*)\s*(.*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*(not run|check)\s*:\s*(.*?)\s*-->\s*$")
RUN_LANGS = {"cpp", "python", "sh", "bash"}


@dataclasses.dataclass
class Block:
    path: str          # relative to the repository root, e.g. "docs/python.md"
    line: int          # line of the opening fence (1-based)
    lang: str          # "" when the fence has none
    text: str          # the block's lines, the fence's indentation removed
    directive: Optional[str] = None  # "not run", "check"
    argument: str = ""               # the directive's text
    index: int = 0                   # 1-based among the file's blocks of the same language

    @property
    def name(self) -> str:
        """A file-system name: README.md's 2nd cpp block is readme_cpp2, docs/design.md's
        first is docs_design_cpp1."""
        stem = os.path.splitext(self.path)[0].lower().replace("/", "_").replace("-", "_")
        return f"{stem}_{self.lang}{self.index}"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: str = ROOT) -> List[str]:
    """README.md and docs/*.md, relative to root."""
    docs = glob.glob(os.path.join(root, "docs", "*.md"))
    files = ["README.md"] + sorted(os.path.relpath(p, root) for p in docs)
    return [f for f in files if os.path.exists(os.path.join(root, f))]


def parse(path: str, root: str = ROOT) -> List[Block]:
    with open(os.path.join(root, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, counts = [], {}
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and lines[i].strip().strip(fence[0]) == ""):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        if i >= len(lines):
            raise ValueError(f"{path}:{start + 1}: a fence that is never closed")
        i += 1
        directive = argument = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        d = _DIRECTIVE.match(lines[j]) if j >= 0 else None
        if d:
            directive, argument = d.group(1), d.group(2)
        counts[lang] = counts.get(lang, 0) + 1
        blocks.append(Block(path, start + 1, lang, "\n".join(body).rstrip("\n") + "\n", directive,
                            argument or "", counts[lang]))
    return blocks


def all_blocks(root: str = ROOT) -> List[Block]:
    return [b for f in doc_files(root) for b in parse(f, root)]


def cpp_source(block: Block) -> str:
    """The translation unit built for a cpp block (what CMake compiles and the test checks)."""
    return f"// {block.where} (written by tests/docs/md_blocks.py: edit the document)\n" + block.text


def extract_cpp(out_dir: str, root: str = ROOT) -> List[str]:
    """Writes each runnable cpp block to out_dir/<name>.cc (only when its text changed, so an
    unchanged block is not rebuilt) and returns the names."""
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for b in all_blocks(root):
        if b.lang != "cpp" or b.directive == "not run":
            continue
        path = os.path.join(out_dir, b.name + ".cc")
        text = cpp_source(b)
        old = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                old = f.read()
        if old != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        names.append(b.name)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["list", "extract-cpp"])
    p.add_argument("--root", default=ROOT)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.command == "list":
        for b in all_blocks(a.root):
            note = f"  [{b.directive}: {b.argument}]" if b.directive else ""
            print(f"{b.where}  {b.lang or '(none)'}  {b.name}{note}")
        return 0
    if not a.out:
        p.error("extract-cpp needs --out DIR")
    for name in extract_cpp(a.out, a.root):
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
