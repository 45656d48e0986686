"""The dependency rules of docs/ARCHITECTURE.md hold: every import of the source tree (at module
level and inside functions) is walked with `ast`, and the section lists exactly the modules
the rules allow across packages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("groupforge", "store", "curation", "training", "pipelines")

CURATION_MAY_IMPORT = {  # the training modules curation imports, each for a reason ARCHITECTURE gives
    "training.ray_cluster", "training.advantages",
}


def imports_of(package: str) -> dict[str, set[str]]:
    """{module: the modules of the other packages it imports}, module-level and function-level."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[module] = {n for n in names if n.split(".")[0] in PACKAGES and n.split(".")[0] != package}
    return found


def _allowed(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def test_the_store_imports_no_other_package():
    wrong = {module: names for module, names in imports_of("store").items() if names}
    assert not wrong, f"store imports curation, training, pipelines or groupforge: {wrong}"


def test_training_imports_only_the_store():
    wrong = {module: sorted(n for n in names if n.split(".")[0] != "store")
             for module, names in imports_of("training").items()}
    wrong = {module: names for module, names in wrong.items() if names}
    assert not wrong, f"training imports curation, pipelines or groupforge: {wrong}"


def test_curation_imports_only_the_store_and_the_training_modules_the_rules_name():
    wrong = {module: sorted(n for n in names if n.split(".")[0] != "store" and not _allowed(n, CURATION_MAY_IMPORT))
             for module, names in imports_of("curation").items()}
    wrong = {module: names for module, names in wrong.items() if names}
    assert not wrong, f"curation imports modules the dependency rules do not allow: {wrong}"


def test_architecture_lists_the_rules_the_tests_check():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("### Dependency rules"):].split("\n### ", 1)[0]
    named = set(re.findall(r"`(training(?:\.[a-z_]+)+)(?:\.\*)?`", section))
    assert CURATION_MAY_IMPORT <= named, f"not in ARCHITECTURE's dependency rules: {CURATION_MAY_IMPORT - named}"
    used = set().union(*imports_of("curation").values())
    for allowed in CURATION_MAY_IMPORT:  # each allowance is in use: the list does not go stale
        assert any(_allowed(n, {allowed}) for n in used), f"{allowed}: allowed, but curation does not import it"


def test_the_store_has_no_import_circle_hidden_in_a_function():
    """No module of store/ imports another of them inside a function: the store's
    modules are layered (ARCHITECTURE's list, from the bottom up), not tied in a circle."""
    hidden = []
    for path in sorted((REPO / "store").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "store":
                    hidden.append(f"{path.name}:{node.lineno} {node.module}")
    assert not hidden, f"function-local imports between store modules: {hidden}"


SAMPLE_PATH_LAYERS = ("pipelines", "curation", "store", "training")


def test_follow_one_sample_names_real_calls_in_layer_order():
    """ARCHITECTURE's "Follow one sample": every file and call it names exists, it names at most
    20 files, and its rows enter the packages in the order of the layers, each once."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Follow one sample"):].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert rows, "no rows in Follow one sample"
    named = set(re.findall(r"`([a-z_/]+\.py)`", section))
    assert len(named) <= 20, f"Follow one sample names {len(named)} files"
    for path in named:
        assert (REPO / path).is_file(), f"Follow one sample names {path}, which does not exist"
    packages = []
    for _, file_cell, call_cell, _ in rows:
        path = re.search(r"`([a-z_/]+\.py)`", file_cell).group(1)
        tree = ast.parse((REPO / path).read_text())
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        defined |= {f"{cls.name}.{node.name}" for cls in tree.body if isinstance(cls, ast.ClassDef)
                    for node in cls.body if isinstance(node, ast.FunctionDef)}
        for call in re.findall(r"`([A-Za-z_.]+)`", call_cell):
            assert call in defined, f"{path} defines no {call} (Follow one sample)"
        package = path.split("/")[0]
        if not packages or packages[-1] != package:
            packages.append(package)
    assert packages == list(SAMPLE_PATH_LAYERS), f"Follow one sample enters the packages as {packages}"
