"""The test suite's own layout (tests/README.md): whole-workflow runs apart, in tests/e2e/ with the
`e2e` marker the fast loop leaves out; builders shared by test files in helper modules."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def marks(path: Path) -> set[str]:
    """The marker names of a module's `pytestmark`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute) and n.attr != "mark"}
    return set()


def test_no_test_module_imports_another():
    found = {f"{p.relative_to(TESTS)} imports {name}" for p in sorted(TESTS.rglob("*.py"))
             for name in imported_modules(p) if name.startswith("test_")}
    assert not found, found


def test_every_e2e_module_is_marked_e2e():
    modules = sorted((TESTS / "e2e").glob("test_*.py"))
    assert modules
    assert [p.name for p in modules if "e2e" not in marks(p)] == []
