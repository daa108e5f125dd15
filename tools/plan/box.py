"""This box's per-stage costs, read from the stored results (never measured here): what `plan`'s
validation feeds the model beside each run's own link and forward, and the source of the codec and
verification figures it states for a GPU where none was measured there.

- fixed cost (send -> first token beyond forward and wire): mooncake-nospin's requests at 1 and 5
  Gbit/s (the stream-policy runs), TTFT - send-to-prefill-done - BF16 wire time;
- decode step per forward token: mooncake-nospin's time per token ÷ its forward per prompt token
  in every single-request bench-ttft run since 2026-12-06 (this box's speed drifts 3x within an
  hour, so a run's decode step is taken from its own forward, as the runs' ratios are; both
  alone, so at full speed);
- CPU demands (`CpuDemand`, the cores each activity keeps busy), from the role CPU seconds of one
  bench-load run (`CPU_CALIBRATION_RUN`, unpinned; its passes' latencies are not used): the
  forward's, prefill CPU ÷ the pass's forwards at the calibration speed in the passes without
  BF16 transfers; mooncake's sender, the prefill CPU left in its passes ÷ their BF16 wire time;
  the decode's, decode CPU ÷ Σ output tokens × time per output token in its lowest-rate passes
  that do not speculate (one request decoding at a time);
- codec: results/bench_kv_path's newest A/B file, the current build's prefill (encode after the
  forward) and decode (apply) per BF16 byte, exact and int8;
- verification in decode steps per speculated positions: results/bench_verify (newer wins);
- speculation's acceptance: results/anchor_study's default Anchor (the share of prompts that
  kept all 32 tokens, the mean kept by the others).

Also the measured variants' names -> the modelled variants (`ALIASES`). Callers:
`tools.plan.validate`, `tools.plan.cli` (the verification and acceptance costs a GPU prediction
borrows).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from .model import (
    INT4_ANCHOR,
    LYNX,
    LYNX_INT8,
    LYNX_INT8_NOSPEC,
    MOONCAKE,
    CpuDemand,
    DecodeStep,
    SharedCpu,
    StageCosts,
    Variant,
)
from .stored import BASELINES, LoadRun, read_load, read_ttft

FIXED_COST_RUNS = ("bench_ttft/bench_ttft_1gbit_stream_policy_2026-12-07.json",
                   "bench_ttft/bench_ttft_5gbit_stream_policy_2026-12-07.json")
# The anchor study's row with the serving default (4 bits, group 64, rotation, 4 sink + 16 recent).
DEFAULT_ANCHOR_ROW = "rot+sink4+r16"
SMOLLM2_BF16_BYTES_PER_TOKEN = 23040
# The bench-load run whose role CPU seconds give the CPU demands: unpinned, every variant at
# both rates, CPU seconds per pass recorded (the other runs validate them).
CPU_CALIBRATION_RUN = "bench_load/bench_load_R1_four_variants_2026-12-07.json"

# Measured variant name -> the modelled variant and, where its name fixes it, its cap.
ALIASES: dict[str, tuple[Variant, int | None]] = {
    "mooncake-nospin": (MOONCAKE, None),
    "lynx": (LYNX, None),
    "lynx@no-overlap": (LYNX, None),
    "lynx-int8": (LYNX_INT8, None),
    "lynx-spec128": (LYNX, 128),
    "lynx-int8-spec128": (LYNX_INT8, 128),
    "lynx-int8-nospec": (LYNX_INT8_NOSPEC, None),
    "int4-anchor": (INT4_ANCHOR, None),
}


@dataclass(frozen=True)
class BoxCosts:
    fixed_s: float
    decode_steps_per_forward_token: float  # decode step ÷ (forward ÷ prompt tokens)
    encode_exact_s_per_byte: float
    encode_int8_s_per_byte: float
    apply_exact_s_per_byte: float
    apply_int8_s_per_byte: float
    verify_steps: tuple[tuple[int, float], ...]
    spec_hold_share: float
    spec_break_mean: float
    cpu_demand: CpuDemand
    sources: dict[str, str]

    def stage_costs(self, spec_cap: int = 128) -> StageCosts:
        return StageCosts(self.fixed_s, self.encode_exact_s_per_byte, self.encode_int8_s_per_byte,
                          self.apply_exact_s_per_byte, self.apply_int8_s_per_byte,
                          self.verify_steps, self.spec_hold_share, self.spec_break_mean,
                          spec_cap=spec_cap)

    def decode_step(self, forward_s: float, tokens: int) -> DecodeStep:
        """From a forward at full speed (`SharedCpu.forward_alone_rate` x a measured one)."""
        return DecodeStep(self.decode_steps_per_forward_token * forward_s / tokens)

    def shared_cpu(self, cpus: int, role_cpus: dict[str, list[int]]) -> SharedCpu:
        """A run's processors as its JSON records them (its CPUs, --pin-roles' split)."""
        if not role_cpus:
            return SharedCpu(self.cpu_demand, cpus)
        return SharedCpu(self.cpu_demand, cpus, True, len(role_cpus["prefill"]),
                         len(role_cpus["decode"]))


def _fixed_cost(results: Path) -> float:
    costs = []
    for rel in FIXED_COST_RUNS:
        for run in read_ttft(results / rel):
            base = next(run.variants[n] for n in BASELINES if n in run.variants)
            for r in base.requests:
                wire = r.prompt_tokens * SMOLLM2_BF16_BYTES_PER_TOKEN * 8 / run.link_bps
                costs.append(r.ttft_s - r.prefill_done_s - wire)
    return statistics.median(costs)


def _decode_ratio(results: Path, demand: CpuDemand) -> float:
    ratios = []
    for path in sorted((results / "bench_ttft").glob("bench_ttft_*2026-12-0[67]*.json")):
        for run in read_ttft(path):
            base = run.variants.get("mooncake-nospin")
            tpot = base and base.medians.get("lynx_client.tpot_s")
            if tpot and run.forward_s and not run.role_cpus:
                alone = SharedCpu(demand, run.cpus).forward_alone_rate()
                ratios.append(tpot / (run.forward_s * alone / run.prompt_tokens))
    return statistics.median(ratios)


@dataclass(frozen=True)
class PassCpu:
    """One bench-load pass's role CPU seconds beside what the model says it asked for: its
    forwards at full speed, its BF16 wire time, its requests' decoding (Σ outputs x TPOT)."""

    variant: str
    rate: float
    prefill_cpu_s: float
    decode_cpu_s: float
    forwards_s: float
    bf16_wire_s: float
    decoding_s: float


def pass_cpu(run: LoadRun) -> list[PassCpu]:
    """The passes of an unpinned run that recorded their CPU seconds."""
    if run.pinned:
        raise ValueError(f"{run.path}: pinned, its forwards' speed alone needs the demand")
    out = []
    for p in run.passes:
        if not p.cpu_s:
            continue
        tokens = sum(p.input_lens)
        decoding = sum(n * t for n, t in zip(p.output_lens, p.tpots_s, strict=True) if t)
        out.append(PassCpu(p.variant, p.rate, p.cpu_s["prefill"], p.cpu_s["decode"],
                           run.forward_s * tokens / run.prompt_tokens,
                           tokens * SMOLLM2_BF16_BYTES_PER_TOKEN * 8 / run.link_bps, decoding))
    return out


def cpu_demand_of(run: LoadRun) -> CpuDemand:
    """The demands one run's CPU seconds give (module docstring)."""
    passes = pass_cpu(run)
    bf16 = [p for p in passes if ALIASES[p.variant][0].target is None]
    forward = statistics.median(p.prefill_cpu_s / p.forwards_s for p in passes if p not in bf16)
    sender = statistics.median((p.prefill_cpu_s - forward * p.forwards_s) / p.bf16_wire_s
                               for p in bf16)
    steady = [p for p in passes if not ALIASES[p.variant][0].speculative]
    low = min(p.rate for p in steady)
    decode = statistics.median(p.decode_cpu_s / p.decoding_s for p in steady if p.rate == low)
    return CpuDemand(forward, decode, sender)


def _newest_codec_run(results: Path) -> Path:
    return max((results / "bench_kv_path").glob("ab_codec_*.json"),
               key=lambda p: json.loads(p.read_text())["when"])


def _codec(results: Path) -> dict[str, float]:
    doc = json.loads(_newest_codec_run(results).read_text())
    nbytes = doc["tokens"] * SMOLLM2_BF16_BYTES_PER_TOKEN
    return {k: v["this_s"] / nbytes for k, v in doc["paths"].items()}


def _verify(results: Path) -> tuple[tuple[int, float], ...]:
    steps: dict[int, float] = {}
    for path in sorted((results / "bench_verify").glob("bench_verify_*.json"),
                       key=lambda p: p.stem.split("_")[-1]):
        for depth in json.loads(path.read_text())["depths"]:
            steps[depth["positions"]] = depth["verify_in_steps_median"]
    return tuple(sorted(steps.items()))


def _acceptance(results: Path) -> tuple[float, float]:
    doc = json.loads((results / "anchor_study" / "anchor_study.json").read_text())
    kept = [(p["variants"][DEFAULT_ANCHOR_ROW]["accepted"], p["variants"][DEFAULT_ANCHOR_ROW]
             ["positions"]) for p in doc["per_prompt"]]
    held = [a for a, n in kept if a == n]
    broke = [a for a, n in kept if a < n]
    return len(held) / len(kept), statistics.fmean(broke) if broke else 0.0


def read_box_costs(results: Path) -> BoxCosts:
    results = Path(results)
    codec = _codec(results)
    hold, broke = _acceptance(results)
    demand = cpu_demand_of(read_load(results / CPU_CALIBRATION_RUN))
    return BoxCosts(
        _fixed_cost(results), _decode_ratio(results, demand),
        codec["exact_prefill"], codec["int8_prefill"], codec["exact_decode"],
        codec["int8_decode"], _verify(results), hold, broke, demand,
        {"fixed_s": ", ".join(FIXED_COST_RUNS),
         "decode_steps_per_forward_token": "bench_ttft/*2026-12-0[67]*.json mooncake-nospin",
         "codec": str(_newest_codec_run(results).relative_to(results)),
         "verify_steps": "bench_verify/*.json",
         "acceptance": f"anchor_study/anchor_study.json {DEFAULT_ANCHOR_ROW}",
         "cpu_demand": f"{CPU_CALIBRATION_RUN} (role CPU seconds per pass)"})
