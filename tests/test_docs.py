"""Every relative link and image of README.md and docs/*.md resolves: the file exists (from the page's own
directory, as GitHub resolves it) and an anchor names a heading of the target page (GitHub's slugs)."""
import os
import re

import pytest

from helpers import ROOT

PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img [^>]*src=\"([^\"]+)\"")


def slugs(path: str) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    repeats numbered -1, -2, ..."""
    seen, out, fenced = {}, set(), False
    for line in open(path, encoding="utf-8"):
        fenced ^= line.startswith("```")
        match = None if fenced else re.match(r"#{1,6} (.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: str) -> list:
    """(line number, target) of every link and image outside code blocks and code spans."""
    out, fenced = [], False
    for n, line in enumerate(open(os.path.join(ROOT, page), encoding="utf-8"), 1):
        fenced ^= line.startswith("```")
        if not fenced:
            out += [(n, a or b) for a, b in LINK.findall(re.sub(r"`[^`]*`", "", line))]
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_image_resolves(page):
    broken = []
    for n, target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
            os.path.join(ROOT, page)
        if not os.path.exists(resolved):
            broken.append(f"{page}:{n}: {target} (no file {os.path.relpath(resolved, ROOT)})")
        elif anchor and resolved.endswith(".md") and anchor not in slugs(resolved):
            broken.append(f"{page}:{n}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_checker_sees_links_images_and_anchors():
    """The patterns above on lines of each kind (a checker that matches nothing would pass every page)."""
    line = 'see [a](docs/x.md#b-c) and ![img](../r.png) <img src="p.png"> `[not](code.md)`'
    assert [a or b for a, b in LINK.findall(re.sub(r"`[^`]*`", "", line))] == ["docs/x.md#b-c", "../r.png", "p.png"]
    assert len(links("README.md")) > 20
