"""The docs say what the code does, and render as written.

README.md and docs/*.md are parsed with a CommonMark parser (markdown-it-py): every fence
closes, no heading is swallowed by one, every link and every path named in them exists.
docs/rules.md is checked against the rule ids the code and the tests cite and against the
modules and tests it names; docs/configuration.md against the config structs; docs/api.md
against the routes the server has; docs/operations.md against the CLI's commands.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

from supervisor.cli import COMMANDS
from supervisor.config import Config, GuardConfig, ModelConfig, SupervisorConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
CODE_ROOMS = ("supervisor", "worker", "shared", "modelfiles")
SOURCES = [p for room in (*CODE_ROOMS, "scripts", "tests") for p in sorted((ROOT / room).rglob("*.py"))]

README_SECTIONS = ["What it promises", "Set up", "A short tour", "A real model", "Where next"]
README_MAX_LINES = 250

# The rules as the project adopted them; a row of docs/rules.md may be added, never lost.
ADOPTED_RULES = (
    [f"T{i}" for i in range(1, 7)] + [f"C{i}" for i in range(1, 15)] + ["U1", "U2"]
    + [f"P{i}" for i in range(1, 11)] + [f"A{i}" for i in range(1, 6)] + [f"W{i}" for i in range(1, 7)]
    + ["G1", "G2", "G3"] + [f"H{i}" for i in range(1, 7)] + [f"H5.{i}" for i in range(1, 8)] + ["H5.1a"]
    + ["M1", "M2", "M3"] + [f"D{i}" for i in range(1, 7)] + ["S1", "S2"]
)
NOT_BUILT = "not yet built"
# A cited rule id: a chapter letter and a number (H200 and A100 are cards, not rules) ...
RULE_ID = re.compile(r"(?<![\w.])([TCUPAWGHMDS][0-9]{1,2}(?:\.[0-9]+[a-z]?)?)(?![\w])")
# ... or the chapter and number that open a test's name after `test_` (test_p6_step2_...).
TEST_RULE_ID = re.compile(r"_([tcupawghmds][0-9]{1,2})(?=_)")
NOT_RULES = {"U32"}  # a safetensors dtype (modelfiles/modelgen.py)

# A path into the repository, as the docs write one: `scripts/x.py`, tests/README.md, a page in docs/.
REPO_PATH = re.compile(r"(?<![\w/.~$-])((?:supervisor|worker|shared|modelfiles|scripts|tests|docs|\.ci)"
                       r"/[\w./*-]*)")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
MODULE_REF = re.compile(r"`((?:supervisor|worker|shared|modelfiles)/[\w/]+\.py)`")

_md = MarkdownIt("commonmark").enable("table")


def tokens(page: Path) -> list[Token]:
    return _md.parse(page.read_text())


def inline_text(token: Token) -> str:
    return "".join(child.content for child in token.children or [] if child.type in ("text", "code_inline"))


def slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def headings(page: Path) -> list[tuple[int, str]]:
    toks = tokens(page)
    return [(int(t.tag[1]), inline_text(toks[i + 1])) for i, t in enumerate(toks) if t.type == "heading_open"]


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _level, text in headings(page):
        base = slug(text)
        seen[base if base not in seen else f"{base}-{seen[base]}"] = 0
        seen[base] = seen.get(base, 0) + 1
    return set(seen)


def walk(toks: list[Token]):
    for token in toks:
        yield token
        yield from walk(token.children or [])


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# -- rendering ----------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_fence_is_closed(page):
    """An unclosed fence runs to the end of the page and renders the rest as code."""
    lines = page.read_text().splitlines()
    for token in tokens(page):
        if token.type == "fence":
            start, end = token.map
            closing = lines[end - 1].strip() if end - 1 > start and end - 1 < len(lines) else ""
            assert closing.startswith(token.markup) and set(closing) <= set(token.markup[0]), (
                f"{page_id(page)}:{start + 1}: the {token.markup}{token.info} fence opened here never closes")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_heading_is_swallowed_by_a_fence(page):
    for token in tokens(page):
        if token.type == "fence":
            swallowed = [line for line in token.content.splitlines() if re.match(r"#{2,6} \S", line)]
            assert not swallowed, f"{page_id(page)}:{token.map[0] + 1}: a heading inside a fence: {swallowed}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_each_page_has_one_title_first(page):
    levels = [level for level, _text in headings(page)]
    assert levels and levels[0] == 1 and levels.count(1) == 1, f"{page_id(page)}: headings {headings(page)}"


def test_readme_has_its_sections_and_fits_in_ten_minutes():
    sections = [text for level, text in headings(ROOT / "README.md") if level == 2]
    assert sections == README_SECTIONS
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


# -- links and paths ------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_and_anchor_exists(page):
    for token in walk(tokens(page)):
        target = token.attrGet("href") if token.type == "link_open" else token.attrGet("src")
        if not isinstance(target, str) or re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        assert where.exists(), f"{page_id(page)}: link to {target}: no such file"
        if anchor and where.suffix == ".md":
            assert anchor in anchors(where), f"{page_id(page)}: link to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_repository_path_named_exists(page):
    for token in walk(tokens(page)):
        if token.type in ("code_inline", "fence", "code_block"):
            for path in REPO_PATH.findall(token.content):
                path = path.rstrip(".")
                assert any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists(), (
                    f"{page_id(page)}: names {path}, which does not exist")


def test_code_names_only_docs_that_exist():
    for source in [*SOURCES, ROOT / "tests" / "README.md"]:
        for name in re.findall(r"docs/[\w.-]+\.md", source.read_text()):
            assert (ROOT / name).exists(), f"{source.relative_to(ROOT)} names {name}, which does not exist"


def test_nothing_points_at_the_design_or_spec_files_outside_the_repository():
    gone = ("DESIGN", "SPEC")  # their .md files live outside the repository
    pattern = re.compile(r"\b(?:%s)\.md\b" % "|".join(gone))
    for path in [*SOURCES, *PAGES, ROOT / "tests" / "README.md", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]:
        hits = pattern.findall(path.read_text())
        assert not hits, f"{path.relative_to(ROOT)} points at {hits}: use docs/architecture.md or docs/rules.md"


# -- the rules ------------------------------------------------------------------------------


def rule_rows() -> dict[str, str]:
    """docs/rules.md's rows by id: `| ID | the rule | module | tests |`."""
    rows = {}
    for line in (DOCS / "rules.md").read_text().splitlines():
        match = re.match(r"\| ([A-Z][0-9]+(?:\.[0-9]+[a-z]?)?) \|", line)
        if match:
            assert match[1] not in rows, f"rules.md: {match[1]} has two rows"
            rows[match[1]] = line
    return rows


def cited_ids(text: str, tests: bool = False) -> set[str]:
    ids = set(RULE_ID.findall(text)) - NOT_RULES
    if tests:
        names = re.findall(r"def (test_\w+)", text)
        ids |= {found.upper() for name in names for found in TEST_RULE_ID.findall("_" + name[5:])}
    return ids


def code_citing(rule: str) -> list[str]:
    return [str(p.relative_to(ROOT)) for room in CODE_ROOMS for p in sorted((ROOT / room).rglob("*.py"))
            if rule in cited_ids(p.read_text())]


def test_every_adopted_rule_has_a_row():
    missing = [rule for rule in ADOPTED_RULES if rule not in rule_rows()]
    assert not missing, f"docs/rules.md lacks rows for {missing}"


def test_every_rule_id_cited_in_code_or_tests_has_a_row():
    rows = rule_rows()
    for source in SOURCES:
        unknown = cited_ids(source.read_text(), tests=source.name.startswith("test_")) - set(rows)
        assert not unknown, f"{source.relative_to(ROOT)} cites {sorted(unknown)}, which docs/rules.md lacks"


@pytest.mark.parametrize("rule", sorted(rule_rows()))
def test_a_rule_row_names_modules_and_tests_that_exist(rule):
    row = rule_rows()[rule]
    module_column = row.split(" | ")[2]
    if module_column.strip() == NOT_BUILT:
        citing = code_citing(rule)
        assert not citing, f"{rule} says '{NOT_BUILT}' but {citing} cite it: fill its module and tests"
        return
    modules, tests = MODULE_REF.findall(row), TEST_REF.findall(row)
    assert modules and tests, f"{rule}: a row names its module(s) and test(s), or says '{NOT_BUILT}'"
    for module in modules:
        assert (ROOT / module).is_file(), f"{rule}: {module} does not exist"
    for path, name in tests:
        assert (ROOT / path).is_file(), f"{rule}: {path} does not exist"
        assert re.search(rf"^(?:async )?def {name}\(", (ROOT / path).read_text(), re.M), (
            f"{rule}: {path} has no test {name}")


# -- configuration, routes, commands ----------------------------------------------------------


def documented_keys(section: str) -> set[str]:
    text = (DOCS / "configuration.md").read_text()
    body = text.split(f"## `{section}`\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", body, re.M))


@pytest.mark.parametrize("section, struct", [("[guard]", GuardConfig), ("[supervisor]", SupervisorConfig),
                                             ("[[models]]", ModelConfig)])
def test_configuration_documents_exactly_the_config_keys(section, struct):
    fields = {field.name for field in msgspec.structs.fields(struct)}
    assert documented_keys(section) == fields, (
        f"docs/configuration.md {section}: undocumented {sorted(fields - documented_keys(section))}, "
        f"not in the config {sorted(documented_keys(section) - fields)}")


def test_configuration_sections_are_the_config_file_tables():
    assert {field.name for field in msgspec.structs.fields(Config)} == {"guard", "supervisor", "models"}


def server_routes() -> set[str]:
    """The paths the front door serves, as built for a server with the default config."""
    from supervisor.http.app import FrontDoor

    door = FrontDoor(SimpleNamespace(config=Config(), add_event_hook=lambda hook: None))
    return {re.sub(r"\{[^}]*\}", "{}", route.path) for route in door.routes()}


def test_api_lists_every_route_the_server_has():
    text = (DOCS / "api.md").read_text().split("## Every route\n", 1)[1].split("\n## ", 1)[0]
    documented = {re.sub(r"\{[^}]*\}", "{}", path) for path in re.findall(r"^\| [A-Z]+ \| `([^`]+)` \|", text, re.M)}
    assert documented == server_routes(), (f"undocumented {sorted(server_routes() - documented)}, "
                                           f"not served {sorted(documented - server_routes())}")


def test_operations_lists_every_command():
    text = (DOCS / "operations.md").read_text()
    documented = set(re.findall(r"^\| `([\w-]+)` \|", text.split("## Commands\n", 1)[1].split("\n## ", 1)[0],
                                re.M))
    assert documented == set(COMMANDS)
