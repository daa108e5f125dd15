"""The PD cluster variants the demo and the benchmarks compare, by name: a KV transfer backend
plus the extra flags every server of the pair gets, and the SGLang scheduler they run. One table
(`VARIANTS`) for every tool; add a variant here to measure it, and `--variants` picks by name
(`NAME@no-overlap`: that variant without SGLang's overlap scheduler, `without_overlap`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lynx_sglang.errors import LynxError
from lynx_sglang.names import IDLE_MAX_WAIT_ENV, IDLE_WAIT_ENV

# The warm-up also opens the prefill -> decode transport session, whose set-up counts against the
# Lynx connect timeout; on a loaded machine the first attempt can run out of it. Not measured.
WARMUP_ATTEMPTS = 2


@dataclass(frozen=True)
class Variant:
    """One PD cluster configuration (set the same `--lynx-*` values on prefill and decode).
    `exact`: its KV reaches the decode bit-identical to the prefill's, so its greedy outputs must
    agree with every other exact variant's; lossy ones are only scored against them."""

    name: str
    transfer_backend: str
    server_args: tuple[str, ...] = ()
    description: str = ""
    exact: bool = True
    # Environment of every server of the pair (name, value).
    env: tuple[tuple[str, str], ...] = ()
    # Lynx tcp data connections in TLS (certificates made per cluster: `ClusterSpec.tls`).
    tls: bool = False
    # SGLang's overlap scheduler (its default) on both servers; False: --disable-overlap-schedule.
    overlap_schedule: bool = True


VARIANTS: tuple[Variant, ...] = (
    Variant("mooncake", "mooncake_tcp", (), "SGLang's Mooncake over TCP, full KV (the baseline)"),
    Variant("mooncake-nospin", "mooncake_tcp", (),
            "Mooncake over TCP whose schedulers wait in SGLang's idle path as Lynx's do (not "
            "SGLang's default): on one box its decode no longer spins on a core while the "
            "prefill computes", env=((IDLE_WAIT_ENV, "1"),)),
    Variant("lynx", "lynx", ("--lynx-target", "exact"),
            "Lynx speculative (default flags), Residual = INT8 low bits + coded corrections "
            "(bit-identical KV)"),
    Variant("lynx-a3", "lynx", ("--lynx-target", "exact", "--lynx-anchor-bits", "3"),
            "Lynx speculative, exact Residual, a 3-bit Anchor for every request: it lands "
            "sooner, its speculation is rolled back more often"),
    Variant("lynx-adaptive", "lynx", ("--lynx-target", "exact", "--lynx-anchor-width",
                                      "adaptive"),
            "Lynx speculative, exact Residual, the Anchor's width (3 or 4 bits) picked per "
            "request by the prefill from its measured link and forward"),
    Variant("lynx-tls", "lynx", ("--lynx-target", "exact"),
            "Lynx speculative, exact Residual, its tcp data connections in TLS 1.3", tls=True),
    Variant("lynx-after-forward", "lynx", ("--lynx-target", "exact", "--no-lynx-layer-stream"),
            "Lynx speculative, exact Residual, sent after the prefill forward instead of layer "
            "by layer during it"),
    Variant("lynx-poll2ms", "lynx", ("--lynx-target", "exact"),
            "Lynx speculative, exact, whose idle schedulers wake every 2 ms at the latest (as "
            "before 2026-12-02) instead of sleeping until input or transfer progress",
            env=((IDLE_MAX_WAIT_ENV, "0.002"),)),
    Variant("lynx-spec32", "lynx", ("--lynx-target", "exact", "--lynx-spec-max-tokens", "32"),
            "Lynx speculative, exact Residual, at most 32 speculative tokens per request (the "
            "default before 2026-12-07, now 128): on a slow link it stops speculating sooner"),
    Variant("lynx-link-order", "lynx", ("--lynx-target", "exact", "--lynx-link-order"),
            "Lynx speculative, exact Residual, a late Residual before newer requests' Anchors on "
            "the link they share (issue 59's link order, off by default)"),
    Variant("lynx-nospec", "lynx", ("--lynx-target", "exact", "--no-lynx-speculate"),
            "Lynx non-speculative, exact Residual: decoding waits for the Residual"),
    Variant("lynx-int8", "lynx", ("--lynx-target", "int8"),
            "Lynx speculative (default flags), Residual = low 4 bits of the INT8 code (INT8 KV)",
            exact=False),
    Variant("lynx-int8-nospec", "lynx", ("--lynx-target", "int8", "--no-lynx-speculate"),
            "Lynx non-speculative, INT8 KV: decoding waits for Anchor + Residual (≈ INT8 bytes)",
            exact=False),
    Variant("lynx-int8-a3", "lynx", ("--lynx-target", "int8", "--lynx-anchor-bits", "3"),
            "Lynx speculative, 3-bit Anchor (rotated, sink/recent protected), Residual = low 5 "
            "bits of the INT8 code: a smaller Anchor, more rollbacks", exact=False),
    Variant("int4-anchor", "lynx", ("--no-lynx-residual", "--no-lynx-speculate"),
            "Anchor only, no Residual (4-bit KV, lossy): the TTFT floor Lynx aims at",
            exact=False),
)


class VariantError(LynxError):
    pass


# `--variants lynx@no-overlap`: a variant of the table with --disable-overlap-schedule, so that one
# run can compare the two schedulers side by side.
NO_OVERLAP_SUFFIX = "@no-overlap"
# Why an operator would turn SGLang's default scheduler off (the tools' --disable-overlap-schedule).
DISABLE_OVERLAP_HELP = (
    "pass SGLang's --disable-overlap-schedule to every server (default: SGLang's overlap "
    "scheduler, what a deployment runs). With it each step's results are processed before the "
    "next step launches (on a Lynx prefill, a forward's rooms are handed over before the next "
    "forward instead of after it): for comparing with runs made that way (before 2026-12-06)")


def without_overlap(variant: Variant, rename: bool = True) -> Variant:
    """`variant` on SGLang's non-overlap scheduler; `rename`: as `NAME@no-overlap`, so that it can
    run beside the overlap one."""
    return replace(variant, overlap_schedule=False,
                   name=variant.name + NO_OVERLAP_SUFFIX if rename else variant.name,
                   description=variant.description + "; --disable-overlap-schedule")


def scheduler_note(variants: list[Variant]) -> str:
    """The schedulers the variants run, for a tool's configuration line (a reader comparing
    numbers across runs must know)."""
    on = [v for v in variants if v.overlap_schedule]
    off = [v.name for v in variants if not v.overlap_schedule]
    parts = []
    if on:
        parts.append(f"SGLang's overlap scheduler for {[v.name for v in on]}")
    if off:
        parts.append(f"--disable-overlap-schedule for {off}")
    return "scheduler: " + ", ".join(parts)


def variant_names(names: str) -> list[str]:
    """The names in a comma-separated `--variants` list, in that order."""
    return [n.strip() for n in names.split(",") if n.strip()]


def select_variants(names: str) -> list[Variant]:
    """The variants named in a comma-separated list, in that order (`NAME@no-overlap`: that
    variant without the overlap scheduler)."""
    by_name = {v.name: v for v in (*VARIANTS, *map(without_overlap, VARIANTS))}
    chosen = variant_names(names)
    unknown = [n for n in chosen if n not in by_name]
    if unknown or not chosen:
        raise VariantError(f"--variants: unknown {unknown}; choose from "
                           f"{[v.name for v in VARIANTS]}, each also as NAME{NO_OVERLAP_SUFFIX}")
    return [by_name[n] for n in chosen]
