"""The house's plan holds: every import in cullama/ and cli/ runs down its layers (the README's map, "Development"),
no module imports a sibling part or a part above it, and no two modules import each other, directly or round about
(imports inside functions included: a circle is a circle whenever it closes)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What each part may import beside its own modules: the README's map, bottom up (test_the_readme_map_is_this_one).
BELOW = {"common": set(), "kernels_cu": set(), "model": {"common"}, "text": {"common"},
         "runtime": {"model", "common", "kernels_cu"}}
BELOW["generation"] = {"runtime", "text"} | BELOW["runtime"]
BELOW["llama"] = BELOW["bench"] = {"generation"} | BELOW["generation"]
BELOW["server"] = {"llama"} | BELOW["llama"]
BELOW["replicas"] = {"server"} | BELOW["server"]
BELOW["cli"] = {"server", "bench", "replicas"} | BELOW["server"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] in ("cli", "kernels_cu"):
        parts = ["cullama", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    files = [*(REPO / "cullama").rglob("*.py"), *(REPO / "cli").rglob("*.py"), REPO / "kernels_cu" / "__init__.py"]
    return {module_name(p): p for p in files}


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, list[str]]]:
    """(module imported, line, names) of every cullama import in the module, the package __init__ of a
    `from package import name` counted only where name is not a module of its own."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("cullama"):
                continue
            plain = [a.name for a in node.names if f"{target}.{a.name}" not in known]
            found += [(f"{target}.{a.name}", node.lineno, []) for a in node.names if f"{target}.{a.name}" in known]
            if plain:
                found.append((target, node.lineno, plain))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno, []) for a in node.names if a.name.startswith("cullama")]
    return found


def part(name: str) -> str | None:
    """The part a module belongs to ('runtime', 'llama', ...); None for the package root."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def graph() -> dict[str, list[tuple[str, int, list[str]]]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_import_runs_down_the_layers():
    wrong = []
    for name, edges in graph().items():
        for target, line, names in edges:
            here, there = part(name), part(target)
            if there is None:  # the package root: only its version (it imports nothing until a public name is used)
                if names != ["__version__"]:
                    wrong.append(f"{name}:{line} imports {names} from the package root (import them from their home)")
            elif here != there and there not in BELOW[here]:
                wrong.append(f"{name}:{line} imports {target}: {there} is not below {here}")
    assert not wrong, "\n".join(wrong)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other():
    edges = {name: {target for target, _, _ in found if target != name} for name, found in graph().items()}
    # a package's __init__ is imported on the way to any of its modules: only its own imports are edges
    assert circles(edges) == []


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(edges, expected):
    assert circles(edges) == expected


def test_the_layer_check_sees_an_import_up(tmp_path):
    """A model module importing the runtime is seen as that (the check is not vacuous)."""
    fake = tmp_path / "cullama" / "model"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from ..runtime import plan\n")
    (edge,) = imports("cullama.model.bad", fake / "bad.py", {"cullama.runtime.plan"})
    assert edge[0] == "cullama.runtime.plan" and part(edge[0]) not in BELOW["model"]


def readme_map() -> dict[str, set[str]]:
    """The README's map: part -> the parts its "imports" column names ("X, Y and below": X, Y and what they may
    import)."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("| folder | its job | imports |"):].split("\n\n")[0].splitlines()[2:]
    found = {}
    for row in table:
        folder, _, imports_ = (cell.strip() for cell in row.strip("|").split("|"))
        name = folder.split("`")[1].rstrip("/").removeprefix("cullama/").removesuffix(".py")
        said = imports_.replace("nothing of cullama's", "").replace("nothing", "")
        if said == "all of the above":
            found[name] = set().union(*found.values(), found)
            continue
        below = said.endswith(" and below")  # "runtime, text and below": each named part and what it may import
        parts = set()
        for item in said.removesuffix(" and below").split(","):
            item = item.strip().removesuffix(".py")
            if item:
                parts |= {item} | (found[item] if below else set())
        found[name] = parts
    return found


def test_the_readme_map_is_this_one():
    assert readme_map() == BELOW
