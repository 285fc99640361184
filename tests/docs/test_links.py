"""The documentation stands alone: every relative link and every repository path named in a Markdown file
exists, and no file of the repository points outside it (the team's notes, tools kept elsewhere)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache", "build", "dist", ".eggs",
             ".cache"}  # gitignored scratch: dclint's node_modules, the compose test's podman storage
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yml", ".yaml", ".json", ".toml", ".txt", ".cpp", ".h", ".c", ".ini",
                 ".cfg", ".example", ".j2", ".jinja"}
TOP_DIRS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in SKIP_DIRS)

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(?:\./)?(?:%s)/[\w./-]*$" % "|".join(map(re.escape, TOP_DIRS)))
# Built from parts so this file does not match itself.
OUTSIDE = [re.compile(p) for p in (r"DESIGN" r"\.md", r"\.\./" r"shared\b", r"physlimits" r"\.py", r"/work" r"/")]


def _files(suffixes: set[str] | None = None) -> list[Path]:
    """The repository's files: tracked, or new and not ignored (scratch such as .venv, the podman storage or a
    local tools folder listed in .git/info/exclude is not the repository's)."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    found = []
    for name in filter(None, names):
        path = ROOT / name
        if path.is_file() and (suffixes is None or path.suffix in suffixes or path.name in ("Makefile", "Dockerfile")):
            found.append(path)
    return found


def _markdown() -> list[Path]:
    return [p for p in _files({".md"})]


def _exists(target: str, md: Path) -> bool:
    target = target.split("#", 1)[0].rstrip("/")
    if not target:
        return True
    return (md.parent / target).exists() or (ROOT / target.lstrip("./")).exists()


def broken_links(md: Path) -> list[str]:
    """Relative links of ``md`` whose target does not exist (http(s), mailto and #anchors are not checked)."""
    bad = []
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not _exists(target, md):
            bad.append(target)
    return bad


def _generated(word: str) -> bool:
    """A path git ignores (a build step writes it, e.g. the wheelhouse's pinned lists): named, not shipped."""
    if not (ROOT / ".git").exists():
        return False
    return subprocess.run(["git", "check-ignore", "-q", word], cwd=ROOT).returncode == 0


def missing_paths(md: Path) -> list[str]:
    """Repository paths named in code spans of ``md`` (``services/...``, ``docs/...``) that do not exist,
    relative to the repository root or to the file's own folder, and are not build outputs."""
    bad = []
    for span in CODE_SPAN.findall(md.read_text(encoding="utf-8")):
        for word in span.split():
            word = word.rstrip(".,;:)")
            if REPO_PATH.match(word) and not any(c in word for c in "*{<") and not _exists(word, md) \
                    and not _generated(word):
                bad.append(word)
    return bad


def test_markdown_files_found():
    names = {p.relative_to(ROOT).as_posix() for p in _markdown()}
    assert {"README.md", "docs/benchmarks.md", "docs/design.md", "docs/architecture.md"} <= names


def test_every_relative_link_exists():
    bad = {p.relative_to(ROOT).as_posix(): broken_links(p) for p in _markdown()}
    assert {k: v for k, v in bad.items() if v} == {}


def test_every_named_repository_path_exists():
    bad = {p.relative_to(ROOT).as_posix(): missing_paths(p) for p in _markdown()}
    assert {k: v for k, v in bad.items() if v} == {}


def _recorded_rows(path: Path) -> bool:
    """Raw measurement rows under docs/results keep what the run recorded (its argv holds the recording
    machine's paths); they are data, not references."""
    rel = path.relative_to(ROOT)
    return rel.parts[:2] == ("docs", "results") and path.suffix != ".md"


def test_no_file_points_outside_the_repository():
    offenders = []
    for path in _files(TEXT_SUFFIXES):
        if _recorded_rows(path):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for pattern in OUTSIDE:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert offenders == []


def test_the_checker_catches_a_broken_link_and_a_missing_path(tmp_path):
    md = tmp_path / "page.md"
    md.write_text("[gone](nowhere.md) [ok](page.md) [web](https://example.com) "
                  "`services/engine/no_such_file.py` `services/engine/config.py`\n")
    assert broken_links(md) == ["nowhere.md"]
    assert missing_paths(md) == ["services/engine/no_such_file.py"]
