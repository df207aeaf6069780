"""Every link between the project's own documents points at a file that exists, and every `#anchor` at a
heading of that file (GitHub's anchors), so that moving a section cannot leave a dead link behind."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "cluster" / "README.md", ROOT / "dashboards" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]  # fmt: skip
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated one numbered (-1, -2...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.match(line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not inside code blocks
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("doc", [d for d in DOCS if d.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_internal_link_and_anchor_resolves(doc):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert broken == []


def test_the_anchor_rule():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
        f.write("# The demo: a real LLM on a laptop, SmolLM2-135M-Instruct\n## `make demo-tiny`\n## Data\n## Data\n")
    assert anchors(Path(f.name)) == {"the-demo-a-real-llm-on-a-laptop-smollm2-135m-instruct", "make-demo-tiny",
                                     "data", "data-1"}  # fmt: skip
