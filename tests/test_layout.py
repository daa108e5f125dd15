"""The package boundaries, checked on the source: what SGLang loads never imports a tool, the codec
and the transport never import SGLang (and the transport never needs torch), the backend's prefill
and decode sides never import each other, and no first-party module imports itself back through
others. Imports inside functions count too: a lazy import is still a dependency (one under `if
TYPE_CHECKING:` is not: it never runs). And no runtime
module rebinds a module-level name (`global`): a process's state lives on its
`runtime.LynxRuntime`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lynx_kernels": ROOT / "kernels", "lynx_transport": ROOT / "transport",
            "lynx_sglang": ROOT / "lynx_sglang", "lynx_tools": ROOT / "tools"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


MODULES = _modules()


def _executed_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:`, which never run: an import there
    names a type for the reader and the checker, it loads nothing."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names of everything `name` imports when it runs (first-party resolved to
    modules)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _executed_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            # `from pkg import mod` imports a module when `pkg.mod` is one.
            found |= {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES}
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _first_party(name: str) -> set[str]:
    """`name`'s first-party imports, without its own ancestor packages (Python imports those
    before any submodule anyway, so `from . import x` inside a package is no cycle)."""
    return {n for n in GRAPH[name] if n in MODULES and not name.startswith(n + ".")}


def _is_tool(name: str) -> bool:
    return name == "lynx_tools" or name.startswith("lynx_tools.")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("lynx_sglang")
                                        and not _is_tool(n)))
def test_runtime_never_imports_a_tool(name):
    assert not [m for m in GRAPH[name] if _is_tool(m)], f"{name} imports a tool module"


@pytest.mark.parametrize("name", sorted(n for n in MODULES
                                        if n.split(".")[0] in ("lynx_kernels", "lynx_transport")))
def test_codec_and_transport_stay_engine_free(name):
    bad = [m for m in GRAPH[name] if m.split(".")[0] in ("sglang", "lynx_sglang")]
    if name.startswith("lynx_transport"):
        bad += [m for m in GRAPH[name] if m.split(".")[0] in ("torch", "lynx_kernels")]
    assert not bad, f"{name} imports {bad}"


def _backend_side(name: str) -> str | None:
    """The peer a backend module serves: its folder, `backend/prefill/` or `backend/decode/`;
    None for the parts both use beside them (the identity handshake, plans, staging, the codec's
    streams) and the SGLang-facing classes above both (`backend.manager`, `backend.conn`)."""
    parts = name.split(".")
    if parts[:2] == ["lynx_sglang", "backend"] and len(parts) > 2 and parts[2] in ("prefill",
                                                                                    "decode"):
        return parts[2]
    return None


def _reachable(name: str) -> set[str]:
    """Every first-party module `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for m in _first_party(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _backend_side(n)))
def test_prefill_and_decode_never_import_each_other(name):
    side = _backend_side(name)
    other = sorted(m for m in _reachable(name) if _backend_side(m) not in (None, side))
    assert not other, f"{name} ({side} side) imports the other side: {other}"


def test_no_first_party_import_cycle():
    # Tarjan's strongly connected components over the first-party import graph.
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in _first_party(v):
            if w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("lynx_sglang")))
def test_runtime_holds_no_mutable_module_state(name):
    """A `global` statement rebinds a module-level name: state that belongs on the process's
    `runtime.LynxRuntime` (or an object it holds, e.g. its `recorder.Recorder`)."""
    tree = ast.parse(MODULES[name].read_text())
    found = [f"line {node.lineno}: global {', '.join(node.names)}"
             for node in ast.walk(tree) if isinstance(node, ast.Global)]
    assert not found, f"{name} rebinds module-level names: {found}"


def test_no_test_imports_from_a_conftest():
    """`from conftest import X` resolves to whichever conftest.py pytest put first on sys.path:
    a module run alone finds its own folder's, the full run finds another folder's (CI of
    363ca05 failed so). Shared test values live in a named helper module."""
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if "conftest" in names:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"import from conftest: {offenders}"


def test_only_the_upstream_room_imports_sglang():
    """Every SGLang dependency of the runtime is in `lynx_sglang.upstream` (issue 57): no other
    runtime module imports SGLang, and none names an SGLang module in a string (a hook target, a
    `sys.modules` probe): those are the room's too."""
    def names_sglang(node: ast.AST) -> bool:  # type-only imports too
        return ((isinstance(node, ast.Import)
                 and any(a.name.split(".")[0] == "sglang" for a in node.names))
                or (isinstance(node, ast.ImportFrom) and not node.level
                    and (node.module or "").split(".")[0] == "sglang"))

    importers = sorted(n for n, path in MODULES.items() if n.startswith("lynx_sglang")
                       and not n.startswith("lynx_sglang.upstream")
                       and any(names_sglang(node) for node in ast.walk(ast.parse(path.read_text()))))
    assert not importers, f"{importers} import SGLang: reach it through lynx_sglang.upstream"
    named = []
    for name, path in MODULES.items():
        if not name.startswith("lynx_sglang") or name.startswith("lynx_sglang.upstream"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith("sglang.")):
                named.append(f"{name}:{node.lineno} {node.value!r}")
    assert not named, f"SGLang module names outside lynx_sglang.upstream: {named}"


def test_no_private_attribute_of_another_object_outside_the_upstream_room():
    """`obj._name` on anything but `self`/`cls` (or `super()`, an overridden method listed in
    `hook_table.SUBCLASSED`) is a read of someone's internals: outside `lynx_sglang.upstream` that
    would be SGLang's (the room's accessors are the only way in) or another Lynx class's (ask it
    through its interface)."""
    found = []
    for name, path in MODULES.items():
        if not name.startswith("lynx_sglang") or name.startswith("lynx_sglang.upstream"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and not (isinstance(node.value, ast.Call)
                             and getattr(node.value.func, "id", None) == "super")):
                found.append(f"{name}:{node.lineno} .{node.attr}")
    assert not found, f"private attributes read outside lynx_sglang.upstream: {found}"
