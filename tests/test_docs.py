"""The README stays one screen's worth and every relative link in it and in docs/ resolves.
Reads markdown only: no jax."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def _relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # a link written inside a code span is not a link
    return [t for t in LINK.findall(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, https:, mailto:


def test_readme_is_at_most_250_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines (at most 250); move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_link_check_sees_links(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](b.md) ![i](img/x.png) [w](https://x.org) `[c](d.md)`\n"
                    "```\n[e](f.md)\n```\n[g](#h)\n")
    assert _relative_links(page) == ["b.md", "img/x.png", "#h"]
    assert _slug("What `make test` costs, and why") == "what-make-test-costs-and-why"


def test_the_memory_rule_and_time_terms_are_stated_as_plans_state_them():
    """The one memory rule (plans print it, plan.json carries it) is the glossary's and
    docs/predict.md's word for word; the glossary names the time terms in their order."""
    from jaxdist.plan_words import TIME_TERMS
    from jaxdist.plan_words import MEMORY_RULE

    def flat(page):
        return " ".join((ROOT / "docs" / page).read_text().replace(">", " ").split())

    for page in ("glossary.md", "predict.md"):
        assert MEMORY_RULE in flat(page), page
    glossary = flat("glossary.md")
    where = [glossary.index(term, glossary.index("**Time terms**"))
             for term in TIME_TERMS]
    assert where == sorted(where)
