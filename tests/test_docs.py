"""The docs a newcomer reads: the README's stage map matches the rule files, and every relative link
in README.md, config/README.md and docs/ leads to a file (and heading) that exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "config" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def rules_by_file() -> dict[str, set[str]]:
    """rules/<file>.smk -> the rules it defines (`rule x:` and `use rule y as x`)."""
    definition = re.compile(r"^\s*(?:rule (\w+):|use rule \w+ as (\w+))", re.M)
    return {f"rules/{p.name}": {a or b for a, b in definition.findall(p.read_text())}
            for p in sorted((REPO / "rules").glob("*.smk"))}


def stage_map() -> list[tuple[str, str]]:
    """(rule file, rule) for every rule the README's stage map names, a blank file cell repeating the last."""
    section = REPO.joinpath("README.md").read_text().split("## How the stages fit together")[1].split("\n## ")[0]
    pairs, rule_file = [], None
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")] if row.startswith("| ") else []
        if len(cells) != 3 or cells[0] == "rule file":
            continue
        rule_file = cells[0].strip("`") or rule_file
        pairs += [(rule_file, rule) for rule in re.findall(r"`(\w+)` →", cells[1])]
    return pairs


def test_the_readme_stage_map_names_every_rule_in_its_file():
    defined = rules_by_file()
    mapped = stage_map()
    misplaced = [(f, rule) for f, rule in mapped if rule not in defined.get(f, set())]
    assert mapped and not misplaced, f"the README's stage map names rules not defined in that file: {misplaced}"
    every_rule = {rule for rules in defined.values() for rule in rules} - {"all"}
    missing = every_rule - {rule for _, rule in mapped}
    assert not missing, f"rules missing from the README's stage map: {sorted(missing)}"


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.M)}


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            broken.append(target)
    return broken


def test_every_relative_link_of_the_docs_resolves():
    broken = {doc.relative_to(REPO).as_posix(): links for doc in DOCS if (links := broken_links(doc))}
    assert len(DOCS) > 3 and not broken, broken


def test_a_broken_link_or_heading_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## The target's own answers (regeneration)\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#the-targets-own-answers-regeneration) [no heading](a.md#nowhere) "
                   "[no file](c.md) [web](https://example.org/x#y) [here](#top)\n# Top\n")
    assert broken_links(doc) == ["a.md#nowhere", "c.md"]
