"""The reference docs cite code that exists: every code name in backticks in docs/architecture.md
(a class, `Class.member`, `module.name`, a dotted module path, a private helper, a file path)
resolves to this project's source, or, for SGLang's names, to the installed SGLang. A rename that
leaves the docs behind fails here instead of misleading the next reader.

Read from the source with `ast`, never imported: the docs name runtime modules that need SGLang."""

from __future__ import annotations

import ast
import importlib.util
import re
import warnings
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lynx_kernels": ROOT / "kernels", "lynx_transport": ROOT / "transport",
            "lynx_sglang": ROOT / "lynx_sglang", "lynx_tools": ROOT / "tools"}
DOCS = [ROOT / "docs" / "architecture.md"]
PATH_RE = re.compile(r"[\w.-]*(/[\w.*<>-]*)*(\.(py|md|sh|toml|txt)|/)")
DOTTED_RE = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(.*\))?")


class Index:
    """What a set of source files defines: classes with their members, and each module's
    top-level names."""

    def __init__(self, files: list[Path]):
        self.classes: dict[str, set[str]] = defaultdict(set)
        self.module_names: dict[str, set[str]] = defaultdict(set)  # basename -> top-level names
        self.names: set[str] = set()
        for path in files:
            try:
                with warnings.catch_warnings():  # SGLang's invalid escapes in strings
                    warnings.simplefilter("ignore")
                    tree = ast.parse(path.read_text(errors="replace"))
            except SyntaxError:
                continue
            top = self.module_names[path.stem]
            for node in tree.body:
                top |= _defined(node)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    members = self.classes[node.name]
                    for item in node.body:
                        members |= _defined(item)
                    for sub in ast.walk(node):  # self.x = ... in the methods
                        if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                                and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                            members.add(sub.attr)
                    self.names |= {node.name} | members
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.names.add(node.name)
            self.names |= top


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


def _first_party_files() -> list[Path]:
    return [p for folder in PACKAGES.values() for p in folder.rglob("*.py")]


@cache
def ours() -> Index:
    return Index(_first_party_files())


@cache
def _sglang_sources() -> dict[Path, str]:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed: its names cannot be checked")
    return {p: p.read_text(errors="replace")
            for p in Path(spec.submodule_search_locations[0]).rglob("*.py")}


@cache
def sglang_class(name: str) -> Index:
    """The SGLang files that define class `name` (parsing only those: SGLang has ~2,000)."""
    pattern = re.compile(rf"^\s*class {re.escape(name)}\b", re.M)
    return Index([p for p, text in _sglang_sources().items() if pattern.search(text)])


def _module_file(dotted: str) -> tuple[Path | None, list[str]]:
    """The first-party file of the longest module prefix of `dotted`, and the rest of it."""
    parts = dotted.split(".")
    folder = PACKAGES.get(parts[0])
    if folder is None:
        return None, parts
    for n in range(len(parts), 0, -1):
        base = folder.joinpath(*parts[1:n])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[n:]
    return None, parts


def unresolved(token: str) -> str | None:
    """Why `token` names nothing, or None when it resolves (or is not a code name)."""
    if "/" in token or token.endswith(".py"):
        if not PATH_RE.fullmatch(token) or "*" in token or "<" in token:
            return None
        name = token.rstrip("/")
        roots = [ROOT, ROOT / "lynx_sglang", *PACKAGES.values()]
        if any((r / name).exists() for r in roots):
            return None
        if "/" not in name and any(p.name == name for p in ROOT.rglob(name)
                                   if ".venv" not in p.parts and ".git" not in p.parts):
            return None
        return f"no file {token}"
    match = DOTTED_RE.fullmatch(token)
    if match:
        dotted = match[1]
        head, *rest = dotted.split(".")
        if head in PACKAGES:
            path, left = _module_file(dotted)
            if path is None:
                return f"no module {dotted}"
            if left and left[0] not in Index([path]).names:
                return f"{path.relative_to(ROOT)} defines no {left[0]}"
            return None
        if head[0].isupper():
            member = rest[0]
            for index in (ours(), sglang_class(head)):
                if head in index.classes:
                    return None if member in index.classes[head] else f"{head} has no {member}"
            return f"no class {head}"
        if head in ours().module_names:  # `module.name`, e.g. prefill._DestinationWorker
            return None if rest[0] in ours().module_names[head] else f"module {head} has no {rest[0]}"
        return None  # an attribute of some object (`req.lynx_spec`): not checkable here
    if re.fullmatch(r"_?[A-Z][a-z]\w*|_\w+", token):  # a class, or a private helper
        if token in ours().names or token in sglang_class(token).classes:
            return None
        return f"nothing named {token}"
    return None


def cited(doc: Path) -> list[str]:
    return sorted(set(re.findall(r"`([^`\n]+)`", doc.read_text())))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_code_names_exist(doc):
    bad = [f"`{t}`: {why}" for t in cited(doc) if (why := unresolved(t))]
    assert not bad, f"{doc.name} cites names that do not exist:\n" + "\n".join(bad)


def test_the_check_can_fail():
    assert unresolved("PrefillSender.no_such_member") == "PrefillSender has no no_such_member"
    assert unresolved("NoSuchClass.member") == "no class NoSuchClass"
    assert unresolved("lynx_sglang.no_such_module") == "lynx_sglang/__init__.py defines no no_such_module"
    assert unresolved("lynx_sglang.backend.decode.applier.NoSuchName") == (
        "lynx_sglang/backend/decode/applier.py defines no NoSuchName")
    assert unresolved("backend/no_such_file.py") == "no file backend/no_such_file.py"
    assert unresolved("_no_such_helper") == "nothing named _no_such_helper"
    assert unresolved("LynxConfig") is None and unresolved("lynx_sglang/config.py") is None
