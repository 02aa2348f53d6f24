"""The rooms stack one way: no import cycle between or inside subpackages, function-local imports included."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src"
PACKAGE = SRC / "hyperjax"

# the floors, lowest first; a room imports only from floors below it (or from itself)
FLOORS = [
    {"errors", "files"},
    {"topology", "shard"},
    {"config", "emulate"},
    {"models"},
    {"mpmd"},
    {"cost"},
    {"resolver", "offload"},
    {"search", "train"},
    {"hf", "rl"},
    {"cli"},
    {"__main__"},
]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = modules()


def imports(name: str, path: Path) -> set[str]:
    """Every hyperjax module ``name`` imports, anywhere in the file (inside functions too)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("hyperjax") and target != name:
                found.add(target)
    return found


GRAPH = {name: imports(name, path) for name, path in MODULES.items()}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hyperjax"


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_imports_inside_functions():
    assert "hyperjax.cli.launching" in GRAPH["hyperjax.cli.train"]
    assert GRAPH["hyperjax.cost.estimate"] >= {"hyperjax.config", "hyperjax.cost.stage"}


def test_no_module_import_cycle():
    assert cycle(GRAPH) is None, " -> ".join(cycle(GRAPH))


def test_no_cycle_between_rooms():
    rooms: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        if room(module) != "hyperjax":
            rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    assert cycle(rooms) is None, " -> ".join(cycle(rooms))


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if room(m) != "hyperjax"))
def test_rooms_import_only_downward(module):
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    here = floor[room(module)]
    upward = sorted(t for t in GRAPH[module] if room(t) != room(module) and floor.get(room(t), -1) >= here)
    assert not upward, f"{module} (floor {here}) imports {upward} from its own floor or above"


def test_every_room_has_a_floor():
    assert {room(m) for m in GRAPH} - {"hyperjax"} == set().union(*FLOORS)
