"""The sampled-output reference shared by conftest (single server) and
test_pd_lynx_sampling (Lynx PD): one prompt answered many times at a fixed temperature."""

from __future__ import annotations

import dataclasses

from lynx_tools.client import generate


@dataclasses.dataclass(frozen=True)
class SamplingCase:
    """Many temperature-sampled answers of the single server to one prompt, for distribution
    checks (each answer is the tuple of its output ids)."""

    prompt: str
    temperature: float
    max_new_tokens: int
    samples: list[tuple[int, ...]]


SAMPLING_PROMPT = "Once upon a time, in a small village by the sea,"
SAMPLING_TEMPERATURE = 1.0
SAMPLING_NEW_TOKENS = 3
SAMPLING_N = 160


def sample_many(url: str, n: int, seed0: int, threads: int = 8) -> list[tuple[int, ...]]:
    """`n` sampled answers to SAMPLING_PROMPT (seeds seed0..seed0+n-1), `threads` in flight."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, ...]:
        return tuple(generate(url, text=SAMPLING_PROMPT, max_new_tokens=SAMPLING_NEW_TOKENS,
                              sampling={"temperature": SAMPLING_TEMPERATURE,
                                        "sampling_seed": seed0 + i}).output_ids)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(n)))
