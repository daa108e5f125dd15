"""The transport secret's file, read safely: what `--lynx-secret-file` names is checked before a
byte of it is read (`read_secret_file`), and said unsafe when others could read or replace it.

Called by `config.LynxConfig.load_secret` (the servers, which refuse an unsafe file unless
--lynx-insecure) and `lynx-sglang doctor` (which reports the same verdict).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from .errors import LynxConfigError

# A secret file holding the secret as text: hex digits and at most one trailing newline. Random
# binary secrets are read as they are: 16 random bytes are all hex digits with odds 1e-17.
_HEX_SECRET = re.compile(rb"([0-9A-Fa-f]+)(?:\r?\n)?")


@dataclass(frozen=True)
class SecretFile:
    secret: bytes
    hex: bool  # the file held the secret as hex digits
    # Why the file is not safe to trust, with the fix (a symbolic link, or access beyond its
    # owner), or None.
    unsafe: str | None


# The largest secret file read: a secret is tens of bytes; more is a wrong path, never read whole.
MAX_SECRET_FILE_BYTES = 4096


def read_secret_file(path: str, where: str) -> SecretFile:
    """The secret in file `path`: its bytes as they are (no whitespace stripped: that refused or
    changed binary secrets), or the bytes its hex digits spell when it holds only those and at
    most one trailing newline.

    Checked before a byte is read (`lstat`, then `fstat` of what was opened, without blocking):
    only a regular file of at most `MAX_SECRET_FILE_BYTES` is read (a device such as /dev/zero
    would exhaust memory, a FIFO would hang the start-up: refused with a clear error, always).
    Says what makes the file unsafe, for the caller to refuse unless --lynx-insecure: a symbolic
    link (whoever may change the link picks the secret), a directory on its path reached through
    a symbolic link, a parent directory others may write to (they could swap the file), any
    permission for the file's group or others, or an owner other than this user (or root). Errors
    start with `where` (the flag that named the file)."""
    try:
        link = os.readlink(path) if stat.S_ISLNK(os.lstat(path).st_mode) else None
        # O_NOFOLLOW for a file that was not a link: what is checked is the file read, not one a
        # link was swapped in for meanwhile; O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
                     | (0 if link is not None else os.O_NOFOLLOW))
    except OSError as exc:
        raise LynxConfigError(f"{where}: cannot read {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LynxConfigError(f"{where}: {path} is {_file_kind(st.st_mode)}, not a regular "
                                  "file: give a file holding the secret (e.g. `head -c 32 "
                                  "/dev/urandom > lynx.key; chmod 600 lynx.key`)")
        if st.st_size > MAX_SECRET_FILE_BYTES:
            raise LynxConfigError(f"{where}: {path} is {st.st_size} B, more than a secret "
                                  f"({MAX_SECRET_FILE_BYTES} B at most): is it the right file?")
        data = b""
        while len(data) <= MAX_SECRET_FILE_BYTES:  # a file that grew meanwhile: still bounded
            more = os.read(fd, MAX_SECRET_FILE_BYTES + 1 - len(data))
            if not more:
                break
            data += more
    except OSError as exc:
        raise LynxConfigError(f"{where}: cannot read {path}: {exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise LynxConfigError(f"{where}: {path} holds more than {MAX_SECRET_FILE_BYTES} B: is it "
                              "the right file?")
    unsafe = _unsafe_secret_file(path, link, st)
    text = _HEX_SECRET.fullmatch(data)
    if text is None:
        return SecretFile(data, False, unsafe)
    digits = text.group(1)
    if len(digits) % 2:
        raise LynxConfigError(f"{where}: {path} holds {len(digits)} hex digits, an odd number: "
                              "write whole bytes (e.g. `openssl rand -hex 32`)")
    return SecretFile(bytes.fromhex(digits.decode("ascii")), True, unsafe)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "of another kind"


def _unsafe_secret_file(path: str, link: str | None, st: os.stat_result) -> str | None:
    """Why secret file `path` (the `fstat` of what was opened: `st`; `link`: where it points if
    it is a symbolic link) is not safe to trust, with the fix; None if it is."""
    mode = stat.S_IMODE(st.st_mode)
    if link is not None:
        return (f"{path} is a symbolic link (to {link}): give the file itself, readable by its "
                "owner only (chmod 600)")
    if mode & 0o077:
        return f"{path} has mode {mode:04o}: its group or others may access it; `chmod 600 {path}`"
    if st.st_uid not in (os.geteuid(), 0):
        return (f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or "
                f"root: its owner picks the secret; `chown {os.geteuid()} {path}`")
    parent = os.path.dirname(os.path.abspath(path))
    real = os.path.realpath(parent)
    if real != parent:
        return (f"{path}'s directory {parent} is reached through a symbolic link (it is {real}): "
                "whoever may change the link picks the secret; give the real path")
    pst = os.stat(parent)
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
        return (f"{path}'s directory {parent} has mode {stat.S_IMODE(pst.st_mode):04o}: others "
                "may replace the file; keep the secret in a directory only its owner may write")
    return None
