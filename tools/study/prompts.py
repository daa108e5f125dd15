"""Deterministic long-context prompts for the Anchor quality study (`lynx_tools.study.anchor_study`).

Three families, all wrapped in the model's chat template:
  passkey     a five-digit pass key hidden at a given depth in repeated filler sentences;
  kv          a JSON object of random UUID pairs, asked for the value of the key at a given depth;
  continue    the head of a long natural text found on any Debian machine (licenses under
              /usr/share/common-licenses, modules of Python's standard library), to be continued.
Everything is derived from the prompt index, the prompt set and the tokenizer, so two runs (and
the test) build the same token ids. Prompt set s > 0 is a disjoint replication: other needles, other
depth order, the next text files in the candidate list. The source files actually used are recorded
on each `StudyPrompt`.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from lynx_sglang.errors import LynxError

PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                  "There and back again. ")
# Long prose/code every Debian system with python3 has (each > 2.2k tokens); prompt set s uses the
# s-th run of them.
TEXT_CANDIDATES = (
    "/usr/share/common-licenses/GPL-3",
    "{stdlib}/argparse.py",
    "/usr/share/common-licenses/Apache-2.0",
    "{stdlib}/heapq.py",
    "/usr/share/common-licenses/MPL-2.0",
    "{stdlib}/textwrap.py",
    "/usr/share/common-licenses/GFDL-1.3",
    "{stdlib}/difflib.py",
    "/usr/share/common-licenses/LGPL-2.1",
    "{stdlib}/tarfile.py",
    "{stdlib}/inspect.py",
    "{stdlib}/pydoc.py",
    "/usr/share/common-licenses/GPL-2",
    "{stdlib}/typing.py",
    "/usr/share/common-licenses/MPL-1.1",
    "{stdlib}/doctest.py",
    "/usr/share/common-licenses/GFDL-1.2",
    "{stdlib}/subprocess.py",
    "{stdlib}/threading.py",
    "{stdlib}/dataclasses.py",
    "{stdlib}/configparser.py",
    "{stdlib}/pickle.py",
    "{stdlib}/zipfile.py",
)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


class PromptError(LynxError):
    pass


@dataclass(frozen=True)
class StudyPrompt:
    """One prompt: its token ids (chat template applied) and what it asks."""

    name: str
    family: str  # "passkey" | "kv" | "continue"
    depth: float | None  # where the needle sits (0..1), retrieval families only
    source: str | None  # file the text came from, "continue" only
    answer: str | None  # the needle's value, retrieval families only
    input_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def _chat_ids(tokenizer, user_text: str) -> list[int]:
    enc = tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                        add_generation_prompt=True, return_tensors="pt")
    return enc["input_ids"][0].tolist()


def _fit(tokenizer, build, units: int, target: int) -> tuple[list[int], int]:
    """Scale the number of repeated units so the chat prompt has about `target` tokens.

    `build(n)` returns the user text with n units; two proportional corrections land within a unit.
    """
    for _ in range(3):
        ids = _chat_ids(tokenizer, build(units))
        if abs(len(ids) - target) <= 40:
            break
        per_unit = len(ids) / max(units, 1)
        units = max(1, units + round((target - len(ids)) / per_unit))
    return _chat_ids(tokenizer, build(units)), units


SET_SEED_STRIDE = 100_000


def _passkey(tokenizer, index: int, depth: float, target: int, prompt_set: int) -> StudyPrompt:
    key = random.Random(1000 + index + SET_SEED_STRIDE * prompt_set).randint(10000, 99999)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "

    def build(n: int) -> str:
        at = round(n * depth)
        body = PASSKEY_FILLER * at + needle + PASSKEY_FILLER * (n - at)
        return ("There is an important piece of information hidden inside a lot of irrelevant "
                "text. Find it and memorize it.\n\n" + body +
                "\n\nWhat is the pass key? Answer with the pass key, then say where in the text "
                "it appeared.")

    ids, _ = _fit(tokenizer, build, target // 25, target)
    return StudyPrompt(f"passkey-{index}-d{depth:g}" + _set_tag(prompt_set), "passkey", depth,
                       None, str(key), tuple(ids))


def _uuid(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _kv(tokenizer, index: int, depth: float, target: int, prompt_set: int) -> StudyPrompt:
    rng = random.Random(2000 + index + SET_SEED_STRIDE * prompt_set)
    pairs = [(_uuid(rng), _uuid(rng)) for _ in range(400)]

    def build(n: int) -> str:
        query = pairs[min(n - 1, round((n - 1) * depth))][0]
        return ("Extract the value corresponding to the specified key in the JSON object below."
                "\n\nJSON data:\n" + json.dumps(dict(pairs[:n]), indent=1) +
                f'\n\nKey: "{query}"\nCorresponding value:')

    ids, n = _fit(tokenizer, build, target // 50, target)
    if n > len(pairs):
        raise PromptError(f"kv prompt {index}: needs {n} pairs for {target} tokens")
    answer = pairs[min(n - 1, round((n - 1) * depth))][1]
    return StudyPrompt(f"kv-{index}-d{depth:g}" + _set_tag(prompt_set), "kv", depth, None, answer,
                       tuple(ids))


def _set_tag(prompt_set: int) -> str:
    return f"-s{prompt_set}" if prompt_set else ""


def _continue(tokenizer, index: int, path: Path, target: int, prompt_set: int) -> StudyPrompt:
    head = "Continue the following text exactly where it stops.\n\n"
    text = path.read_text(encoding="utf-8", errors="replace")
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    overhead = len(_chat_ids(tokenizer, head))
    budget = target - overhead
    if len(text_ids) < budget:
        raise PromptError(f"{path} has {len(text_ids)} tokens, fewer than the {budget} needed")
    ids = _chat_ids(tokenizer, head + tokenizer.decode(text_ids[:budget]))
    return StudyPrompt(f"continue-{index}-{path.name}" + _set_tag(prompt_set), "continue", None,
                       str(path), None, tuple(ids))


def text_sources(count: int, skip: int = 0) -> list[Path]:
    """Candidate text files present on this machine: `count` of them after the first `skip`."""
    stdlib = sysconfig.get_paths()["stdlib"]
    found = [Path(p.format(stdlib=stdlib)) for p in TEXT_CANDIDATES]
    found = [p for p in found if p.is_file()]
    if len(found) < skip + count:
        raise PromptError(f"need {skip + count} long text files, found only {[str(p) for p in found]}")
    return found[skip:skip + count]


def target_lengths(count: int, min_tokens: int, max_tokens: int, prompt_set: int = 0) -> list[int]:
    """`count` lengths spread evenly over [min_tokens, max_tokens], interleaved so every family
    gets short and long prompts (a different interleaving per prompt set)."""
    if count == 1:
        return [min_tokens]
    even = [round(min_tokens + i * (max_tokens - min_tokens) / (count - 1)) for i in range(count)]
    order = sorted(range(count), key=lambda i: ((i + prompt_set) * 7) % count)
    return [even[i] for i in order]


def build_prompts(tokenizer, count: int, min_tokens: int = 1000, max_tokens: int = 2200,
                  prompt_set: int = 0) -> list[StudyPrompt]:
    """`count` prompts: 5 in 18 passkey, 5 in 18 kv, the rest text continuation (at least one of
    each family from three prompts up)."""
    if count < 1 or prompt_set < 0:
        raise PromptError(f"need count >= 1 and prompt_set >= 0, got {count}, {prompt_set}")
    if not 64 <= min_tokens <= max_tokens:
        raise PromptError(f"need 64 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    n_pass = max(1, round(count * 5 / 18)) if count >= 2 else 0
    n_kv = max(1, round(count * 5 / 18)) if count >= 3 else 0
    n_text = count - n_pass - n_kv
    lengths = iter(target_lengths(count, min_tokens, max_tokens, prompt_set))
    s = prompt_set
    prompts = [_passkey(tokenizer, i, DEPTHS[(i + 3 * s) % len(DEPTHS)], next(lengths), s)
               for i in range(n_pass)]
    prompts += [_kv(tokenizer, i, DEPTHS[(i + 2 + 3 * s) % len(DEPTHS)], next(lengths), s)
                for i in range(n_kv)]
    prompts += [_continue(tokenizer, i, path, next(lengths), s)
                for i, path in enumerate(text_sources(n_text, skip=s * n_text))]
    return prompts
