"""Lynx's hooks in SGLang's `HookRegistry`: registering them (`register`), and checking before a
server serves that every one it registered in this process resolved and is in place
(`verify_applied`) — SGLang's `apply_hooks` only logs a hook it could not apply, and a decode
speculating without its rollback hooks would serve wrong tokens. `statuses` is what `lynx-sglang
doctor` prints: each hook's target, whether it resolves and its signature against the release's.

How an applied hook is recognized is SGLang's registry's own layout (0.5.21-0.5.23): each hook
wraps the function before it in a wrapper whose closure holds the hook (`hook`) and the wrapped
function (`__wrapped__`); the chain is walked from the attribute the target names.

Called by `lynx_sglang.plugin` (register, and verify in the launcher after applying the backend's
hooks) and by the Lynx KV manager at scheduler start-up (verify).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UnsupportedSGLangError
from .fingerprints import MISSING, Fingerprint, known_releases
from .fingerprints import signature as fingerprint_signature
from .hook_table import HOOKS, Hook

# Where Lynx's adapters live: registrations of other plugins are not Lynx's to check.
_OURS = "lynx_sglang."


def register(hook: Hook, adapter: Callable) -> None:
    """Register `adapter` at `hook`'s target with `hook`'s kind (applied by SGLang's
    `apply_hooks`, which `load_plugins` calls after every plugin's `register`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(hook.target, adapter, HookType[hook.kind])


def apply() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()


def _applied_hooks(target: str) -> list[Callable]:
    """The hook callables in the wrapper chain now at `target` (outermost first)."""
    obj_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(obj_path)
    fn = owner.__dict__.get(attr) if isinstance(owner, type) else None
    fn = getattr(owner, attr) if fn is None else fn
    fn = getattr(fn, "__func__", fn)  # classmethod / staticmethod
    out = []
    for _ in range(64):  # a chain is as long as the hooks on one target
        cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()),
                         getattr(fn, "__closure__", None) or (), strict=False))
        if "hook" in cells:
            out.append(cells["hook"].cell_contents)
        nxt = getattr(fn, "__wrapped__", None)
        if nxt is None:
            break
        fn = nxt
    return out


def registered_by_lynx() -> list[tuple[str, str, Callable]]:
    """(target, kind name, adapter) of every hook Lynx registered in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [(target, kind.name, hook) for target, rows in HookRegistry._hooks.items()
            for kind, hook, _ in rows if getattr(hook, "__module__", "").startswith(_OURS)]


def verify_applied() -> None:
    """Raise one `UnsupportedSGLangError` naming every hook Lynx registered in this process
    whose target does not resolve, has a signature no supported release has (its adapter reads
    the arguments by that signature; this holds under `--lynx-allow-unknown-sglang` too), or that
    is not in place there; a server must not run half-hooked."""
    releases = known_releases().values()
    problems = []
    for target, kind, adapter in registered_by_lynx():
        name = getattr(adapter, "__qualname__", repr(adapter))
        try:
            applied = _applied_hooks(target)
        except (ImportError, AttributeError, ValueError) as exc:
            problems.append(f"{target} ({kind} {name}): does not resolve ({exc})")
            continue
        signature = fingerprint_signature(target)
        expected = {r[target].signature for r in releases if target in r}
        if signature not in expected:
            problems.append(f"{target} ({kind} {name}): signature {signature}, which no "
                            f"supported release has ({' or '.join(sorted(expected)) or 'none'})")
        if not any(h is adapter for h in applied):
            problems.append(f"{target} ({kind} {name}): registered but not applied (SGLang's "
                            "log says why: 'Failed to apply hooks to ...')")
    if problems:
        raise UnsupportedSGLangError(
            "Lynx's hooks are not all in place in this SGLang; refusing to serve half-hooked:\n  "
            + "\n  ".join(problems))


@dataclass(frozen=True)
class HookStatus:
    hook: Hook
    resolves: bool
    signature: str  # the installed one, or MISSING
    expected: tuple[str, ...]  # the signatures of the supported releases that have it

    @property
    def ok(self) -> bool:
        return self.resolves and self.signature in self.expected


def statuses(found: dict[str, Fingerprint]) -> list[HookStatus]:
    """Each hook of the table against the installed SGLang's fingerprints (`found`,
    `fingerprints.installed()`)."""
    releases = known_releases().values()
    out = []
    for hook in HOOKS:
        now = found[hook.target]
        expected = tuple(sorted({r[hook.target].signature for r in releases
                                 if hook.target in r}))
        out.append(HookStatus(hook, now.signature != MISSING, now.signature, expected))
    return out

