"""Fingerprints of the SGLang Lynx depends on: for every name in `hook_table.followed()`, its
signature and a hash of its source, per supported SGLang release (`releases/<version>.json`).

`identify()` fingerprints the installed SGLang and names the supported release it matches, or,
for an unknown one, what differs from the nearest supported release; `check_release` (the Lynx KV
manager, in a scheduler process where SGLang's modules are imported already) refuses an unknown
release with that list unless `--lynx-allow-unknown-sglang`. `record()` writes the file of the
installed release (`lynx-sglang doctor --hooks --record-release`, when a release is added).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import logging
import pkgutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..errors import UnsupportedSGLangError
from .hook_table import followed

logger = logging.getLogger(__name__)

RELEASES_DIR = Path(__file__).with_name("releases")
MISSING = "missing"


@dataclass(frozen=True)
class Fingerprint:
    signature: str  # inspect.signature, or MISSING when the name does not resolve
    source: str  # sha256 of the dedented source, first 16 hex digits; "" when missing

    def to_json(self) -> dict:
        return {"signature": self.signature, "source": self.source}


@dataclass(frozen=True)
class Identity:
    """What the installed SGLang is, by its fingerprints."""

    installed: str  # the package's version string (reported, never compared)
    release: str | None  # the supported release whose fingerprints all match, or None
    nearest: str  # the supported release with the fewest differences
    changed: tuple[str, ...]  # names whose fingerprint differs from `nearest`'s ("" if release)
    missing: tuple[str, ...]  # those of `changed` the installed SGLang does not have at all

    @property
    def known(self) -> bool:
        return self.release is not None


def resolve(name: str) -> object | None:
    """The SGLang object at dotted `name` (attributes of classes resolved through their MRO, as
    a hook sees them), unwrapped from hook wrappers; None if it does not exist."""
    try:
        obj = pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError):
        return None
    obj = getattr(obj, "__func__", obj)  # a classmethod, bound: its function, hooked or not
    return inspect.unwrap(obj) if callable(obj) else obj


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(unknown)"


def signature(name: str) -> str:
    """The signature of the SGLang object at `name` as `fingerprint` records it (no source read)."""
    obj = resolve(name)
    return MISSING if obj is None else _signature(obj)


def fingerprint(name: str) -> Fingerprint:
    obj = resolve(name)
    if obj is None:
        return Fingerprint(MISSING, "")
    signature = _signature(obj)
    try:
        source = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        source = ""
    return Fingerprint(signature, hashlib.sha256(source.encode()).hexdigest()[:16])


def installed() -> dict[str, Fingerprint]:
    """Fingerprints of every followed name in the installed SGLang (imports its modules)."""
    return {name: fingerprint(name) for name in followed()}


def known_releases() -> dict[str, dict[str, Fingerprint]]:
    out = {}
    for path in sorted(RELEASES_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        out[data["sglang"]] = {n: Fingerprint(**f) for n, f in data["fingerprints"].items()}
    return out


def installed_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def identify(found: dict[str, Fingerprint] | None = None) -> Identity:
    found = installed() if found is None else found
    releases = known_releases()
    diffs = {version: tuple(n for n in followed() if prints.get(n) != found.get(n))
             for version, prints in releases.items()}
    nearest = min(diffs, key=lambda v: (len(diffs[v]), v))
    release = nearest if not diffs[nearest] else None
    missing = tuple(n for n in diffs[nearest] if found[n].signature == MISSING)
    return Identity(installed_version(), release, nearest, diffs[nearest], missing)


def describe_changes(identity: Identity, found: dict[str, Fingerprint] | None = None,
                     limit: int = 12) -> str:
    """The changed names, one per line: signature or body changed, or missing."""
    found = installed() if found is None else found
    ref = known_releases()[identity.nearest]
    lines = []
    for name in identity.changed[:limit]:
        now, then = found[name], ref.get(name)
        if now.signature == MISSING:
            what = "missing"
        elif then is None or then.signature != now.signature:
            what = f"signature {then.signature if then else '?'} -> {now.signature}"
        else:
            what = "body changed"
        lines.append(f"  {name}: {what}")
    if len(identity.changed) > limit:
        lines.append(f"  ... and {len(identity.changed) - limit} more")
    return "\n".join(lines)


def check_release(allow_unknown: bool) -> Identity:
    """Refuse an SGLang release Lynx has no fingerprints for (naming what differs from the
    nearest supported one), unless `allow_unknown`; then warn and go on (the start-up hook
    check still has to pass)."""
    found = installed()
    identity = identify(found)
    if identity.known:
        logger.info("lynx: SGLang %s matches the fingerprints of supported release %s",
                    identity.installed, identity.release)
        return identity
    supported = ", ".join(known_releases())
    message = (f"SGLang {identity.installed} is not a release Lynx supports ({supported}): "
               f"{len(identity.changed)} of the SGLang functions Lynx hooks, subclasses or "
               f"copies differ from {identity.nearest}'s:\n"
               + describe_changes(identity, found))
    if identity.missing or not allow_unknown:
        raise UnsupportedSGLangError(
            message + "\nInstall a supported release (`pip install 'lynx-sglang[sglang]'`), or "
            "pass --lynx-allow-unknown-sglang to run it anyway after the start-up hook check "
            "(never with a missing function)")
    logger.warning("lynx: %s\nrunning anyway (--lynx-allow-unknown-sglang)", message)
    return identity


def record(path: Path | None = None) -> Path:
    """Write the installed release's fingerprints (for adding a supported release)."""
    version = installed_version()
    path = path or RELEASES_DIR / f"{version}.json"
    prints = {n: f.to_json() for n, f in installed().items()}
    path.write_text(json.dumps({"sglang": version, "fingerprints": prints}, indent=1,
                               sort_keys=True) + "\n")
    return path
