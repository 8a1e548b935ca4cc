"""The documentation's own checks (no torch, well under a second): README.md at most 12,000 bytes and each
docs/*.md at most 25,000 (``wc -c``); every relative link in README.md and docs/ (history included) resolves to a
file and, for ``#anchor``, to a heading of it; no internal issue numbers or the article's old nickname in them or
in CHANGELOG.md; and CI's extraction of the README's test command (``.ci/run --print-command``) finds it."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED = [README, *sorted((ROOT / "docs").rglob("*.md"))]
WORDED = [*LINKED, ROOT / "CHANGELOG.md"]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w/-])#\d+\b", re.I)  # "issue 55", "#57"; owner/repo#123 is fine


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(path: Path) -> str:
    """The file without fenced code blocks and inline code (a link or word there is not documentation's)."""
    return CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))


def _anchors(path: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_sizes():
    assert len(README.read_bytes()) <= 12_000, f"README.md is {len(README.read_bytes())} bytes (at most 12,000)"
    for doc in DOCS:
        assert len(doc.read_bytes()) <= 25_000, f"{_rel(doc)} is {len(doc.read_bytes())} bytes (at most 25,000)"


@pytest.mark.parametrize("path", LINKED, ids=_rel)
def test_relative_links_resolve(path):
    bad = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert not bad, f"{_rel(path)}: " + "; ".join(bad)


@pytest.mark.parametrize("path", WORDED, ids=_rel)
def test_no_issue_numbers_or_nickname(path):
    text = path.read_text(encoding="utf-8")
    found = ISSUE.findall(text) + re.findall(r"\bthe seed\b", text, re.I)
    assert not found, f"{_rel(path)}: {found} (name the article, Meta's \"Towards Free Normalization\")"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ci_finds_the_readme_test_command():
    out = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-command"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    command = out.stdout.strip()
    assert "pytest" in command and "\n" not in command, command
    assert f"```\n{command}\n```" in README.read_text(encoding="utf-8")
