"""The prompts the demo and the TTFT benchmark send: a deterministic passkey document of an exact
token length (`passkey_prompt`), and the token-id prompts `sglang.bench_serving` draws itself
(`random_ids_prompts`), so both clients of a benchmark send the same ids; and the warm-up request
of the demo and bench-verify (`WARMUP_PROMPT`).
"""

from __future__ import annotations

from lynx_sglang.errors import LynxError

# A short request that warms a fresh cluster up (and opens Lynx's transport session).
WARMUP_PROMPT = "The capital of France is"


class PromptError(LynxError):
    pass


def passkey_prompt(tokenizer, prompt_tokens: int) -> list[int]:
    """A deterministic passkey document of exactly `prompt_tokens` tokens ending in a question."""
    question = tokenizer.encode(" Question: what is the value of key k17? Answer:",
                                add_special_tokens=False)
    body_len = prompt_tokens - len(question)
    if body_len < 16:
        raise PromptError(f"--prompt-tokens must be at least {len(question) + 16}")
    lines, ids = [], []
    i = 0
    while len(ids) < body_len:
        lines.append(" ".join(f"Item {j}: the value of key k{j} is {j * 37 % 101}."
                              for j in range(i, i + 50)))
        i += 50
        ids = tokenizer.encode(" ".join(lines), add_special_tokens=False)
    return ids[:body_len] + question


def random_ids_prompts(vocab_size: int, prompt_tokens: int, max_new_tokens: int, requests: int,
                       seed: int) -> list[list[int]]:
    """The prompts `sglang.bench_serving --dataset-name random-ids --tokenize-prompt
    --random-range-ratio 1 --seed SEED` sends (SGLang 0.5.23, sample_random_requests with
    random_sample=False): runs of consecutive token ids from a random offset. bench_serving seeds
    numpy, draws the input and output lengths (fixed here, but the draws advance the generator),
    then one offset per request. The benchmark checks the copy: both clients must get the same
    texts.
    """
    import numpy as np

    rng_state = np.random.get_state()
    try:
        np.random.seed(seed)
        np.random.randint(prompt_tokens, prompt_tokens + 1, size=requests)
        np.random.randint(max_new_tokens, max_new_tokens + 1, size=requests)
        offsets = np.random.randint(0, vocab_size, size=requests)
    finally:
        np.random.set_state(rng_state)
    return [[int((offsets[i] + i + j) % vocab_size) for j in range(prompt_tokens)]
            for i in range(requests)]
