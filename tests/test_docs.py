"""The README and the pages of ``docs/`` stay true to the tree they describe.

- Every relative link resolves to a file or folder of the repository, and a ``#anchor`` to a
  heading of its page (GitHub's slugs).
- Every repository path quoted in backticks (``nnh_data/...``, ``nnh_train/...``,
  ``examples/...``, ``tools/...``, ``tests/...``, ``docs/...``) exists, and every dotted name
  (``nnh_data.workers.batch_buffers.BUFFERS``) imports. A file that does not exist yet (planned
  work) is written without its package prefix: ``cache/policy.py``.
- Every python block marked runnable runs: the line before its fence is ``<!-- runnable -->``
  (an HTML comment, invisible on GitHub). Each runs in its own interpreter, in a fresh
  temporary folder, with the repository on ``PYTHONPATH``: it creates what it reads (synthetic
  shards) and finishes in seconds on a CPU.
- The README stays short (at most 200 lines), every page of ``docs/`` is linked from it, and
  ``docs/architecture.md`` names every folder and flat module of both packages.

    python -m pytest tests/test_docs.py -p no:cacheprovider
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

PAGES = sorted([ROOT / "README.md", ROOT / "tests" / "README.md", *(ROOT / "docs").glob("*.md")])
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^(```+|~~~+)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"(?:nnh_data|nnh_train|examples|tools|tests|docs)/[\w./-]*")
DOTTED = re.compile(r"(?:nnh_data|nnh_train)(?:\.[A-Za-z_]\w*)+")


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split(text: str) -> tuple[list[str], list[tuple[int, str]]]:
    """The page's prose lines (fenced blocks blanked, so line numbers hold) and its runnable
    python blocks as (line of the fence, code)."""
    prose, blocks, fence, code, runnable, start = [], [], None, [], False, 0
    lines = text.splitlines()
    for i, line in enumerate(lines):
        opened = FENCE.match(line.strip())
        if fence is None and opened:
            fence, code, start = opened.group(1), [], i + 1
            runnable = line.strip() == "```python" and i > 0 and lines[i - 1].strip() == RUNNABLE
            prose.append("")
        elif fence is not None and line.strip() == fence:
            if runnable:
                blocks.append((start, "\n".join(code) + "\n"))
            fence = None
            prose.append("")
        elif fence is not None:
            code.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert fence is None, "a fenced block is not closed"
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in split(path.read_text())[0]:
        if match := re.match(r"#{1,6}\s+(.*)", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def without_code_spans(line: str) -> str:
    return CODE_SPAN.sub("", line)


def runnable_blocks() -> list:
    return [pytest.param(page, code, id=f"{name(page)}:{line}")
            for page in PAGES for line, code in split(page.read_text())[1]]  # fmt: skip


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_links_resolve(page: Path) -> None:
    broken = []
    for number, line in enumerate(split(page.read_text())[0], 1):
        for target in LINK.findall(without_code_spans(line)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"line {number}: {target} (no {path})")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"line {number}: {target} (no heading #{anchor} in {name(path)})")
    assert broken == [], f"{name(page)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_quoted_paths_and_names_exist(page: Path) -> None:
    missing = []
    for number, line in enumerate(split(page.read_text())[0], 1):
        for span in CODE_SPAN.findall(line):
            span = span.strip()
            if REPO_PATH.fullmatch(span) and not (ROOT / span).exists():
                missing.append(f"line {number}: {span}")
            elif DOTTED.fullmatch(span) and not imports(span):
                missing.append(f"line {number}: {span} (does not import)")
    assert missing == [], f"{name(page)} quotes what is not in the tree:\n" + "\n".join(missing)


def imports(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute of one (``module.name.attr``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                value = getattr(value, attribute)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("page", "code"), runnable_blocks())
def test_runnable_block_runs(page: Path, code: str, tmp_path: Path) -> None:
    (tmp_path / "block.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT"):  # fmt: skip
        env.pop(variable, None)
    done = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=150)  # fmt: skip
    assert done.returncode == 0, f"{name(page)}:\n{code}\n--- stderr:\n{done.stderr[-4000:]}"


def test_runnable_blocks_are_found() -> None:
    """The marker is spelt right: the README's two loops, and the pages' blocks, are run."""
    found = {name(page): len(split(page.read_text())[1]) for page in PAGES}
    assert found["README.md"] == 2
    assert sum(found.values()) >= 10


def test_readme_is_short_and_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = {target.partition("#")[0] for target in LINK.findall(readme)}
    unlinked = [name(p) for p in sorted((ROOT / "docs").glob("*.md")) if name(p) not in linked]
    assert unlinked == [], f"pages the README does not link: {unlinked}"


def test_architecture_names_every_folder_and_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    parts = [f"nnh_data/{p.name}/" for p in (ROOT / "nnh_data").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()]  # fmt: skip
    parts += [name(p) for package in ("nnh_data", "nnh_train")
              for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"]  # fmt: skip
    unnamed = sorted(part for part in parts if f"`{part}" not in text)
    assert unnamed == [], f"docs/architecture.md does not name: {unnamed}"
