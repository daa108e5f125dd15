"""Which SGLang options Lynx refuses (with the reason); which SGLang release it runs on is
`upstream.fingerprints`'s.

Called by the plugin when a server is started with `--disaggregation-transfer-backend lynx`
(`check_server_options`, on the parsed command line, before SGLang resolves it) and by the Lynx KV
manager at start-up (`check_anchor_safety`; the KV pool itself is checked by
`backend.pool.KVPoolView.from_sglang_pool`), so a server that cannot run Lynx correctly stops at
once with a message that names the option instead of failing mid-request.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from .errors import UnsupportedSGLangError
from .upstream import adapter as upstream_adapter


@dataclass(frozen=True)
class Refusal:
    option: str
    reason: str


def _anchor_safety_refusals(ns) -> list[Refusal]:
    """The options under which Anchor-precision KV could outlive speculation (be reused as a
    prefix or offloaded before it is refined)."""
    def get(name, default=None):
        return getattr(ns, name, default)

    out = []
    if get("disaggregation_decode_enable_radix_cache"):
        out.append(Refusal("--disaggregation-decode-enable-radix-cache",
                           "Anchor-precision KV must never enter the decode prefix cache"))
    if get("enable_hierarchical_cache") and get("disaggregation_mode") == "decode":
        out.append(Refusal("--enable-hierarchical-cache on decode",
                           "Anchor-precision KV must never be offloaded before refinement"))
    if get("disaggregation_decode_enable_offload_kvcache"):
        out.append(Refusal("--disaggregation-decode-enable-offload-kvcache",
                           "Anchor-precision KV must never be offloaded before refinement"))
    return out


def check_anchor_safety(server_args) -> None:
    """At KV-manager start-up, whatever launched the server (a programmatic launch never passes
    the command-line check): refuse what would let Anchor-precision KV be reused."""
    refusals = _anchor_safety_refusals(server_args)
    if refusals:
        raise UnsupportedSGLangError(
            "--disaggregation-transfer-backend lynx cannot run with: "
            + "; ".join(f"{r.option} ({r.reason})" for r in refusals))


def _refusals(ns: argparse.Namespace) -> list[Refusal]:
    def get(name, default=None):
        return getattr(ns, name, default)

    out = []
    if (get("pp_size") or 1) > 1:
        out.append(Refusal("--pp-size > 1", "KV is encoded per layer of one pipeline stage only"))
    if (get("attn_cp_size") or 1) > 1 or (get("dcp_size") or 1) > 1:
        out.append(Refusal("--attn-cp-size/--dcp-size > 1",
                           "context-parallel KV relayout is not implemented"))
    # Both spellings: SGLang resolves the deprecated --dp-size N --enable-dp-attention into
    # --attn-dp-size N only after this check.
    if get("enable_dp_attention") or (get("attn_dp_size") or 1) > 1:
        out.append(Refusal("--enable-dp-attention/--attn-dp-size > 1",
                           "under DP attention every forward runs on all attention-DP ranks "
                           "together (SGLang's MLP sync), but Lynx's verification forward runs on "
                           "one rank alone, and Lynx's per-DP-rank routing is untested; run "
                           "without DP attention, or use --disaggregation-transfer-backend "
                           "mooncake"))
    if get("speculative_algorithm"):
        out.append(Refusal("--speculative-algorithm",
                           "draft-model KV pools are not encoded; SGLang's own speculative "
                           "decoding cannot be combined with Lynx yet"))
    kv_dtype = get("kv_cache_dtype", "auto")
    if kv_dtype not in (None, "auto", "bfloat16", "bf16", "float16", "fp16", "float32"):
        out.append(Refusal(f"--kv-cache-dtype {kv_dtype}",
                           "Lynx quantizes a bf16/fp16/fp32 KV pool itself; an fp8/fp4 pool "
                           "would be quantized twice"))
    out += _anchor_safety_refusals(ns)
    if get("enable_hisparse"):
        out.append(Refusal("--enable-hisparse", "host-resident KV destinations are not supported"))
    if get("disaggregation_enable_kv_checksum"):
        out.append(Refusal("--disaggregation-enable-kv-checksum",
                           "the checksum covers prefill's KV bytes; with --lynx-target int8 the "
                           "decode holds the INT8 reconstruction, which differs by design"))
    if get("enable_pd_role_switch"):
        out.append(Refusal("--enable-pd-role-switch", "the Lynx manager has no role-switch teardown"))
    host_receive = get("disaggregation_decode_host_receive_threshold")
    if host_receive is not None and host_receive != upstream_adapter.launch().host_receive_off:
        # Which value disables it differs between releases (`upstream.adapter`).
        out.append(Refusal(f"--disaggregation-decode-host-receive-threshold {host_receive}",
                           "decode host KV buffering is not supported"))
    if get("disaggregation_decode_allocation_policy", "early") != "early":
        out.append(Refusal("--disaggregation-decode-allocation-policy",
                           "only the default 'early' policy is supported"))
    if os.environ.get("SGLANG_RUST_SERVER", "").lower() in ("true", "1", "yes", "y"):
        # SGLang's own parsing of that variable (EnvBool).
        out.append(Refusal("SGLANG_RUST_SERVER=1",
                           "SGLang's Rust bootstrap registry drops the rank key each prefill "
                           "registers, so decodes would refuse every prefill (docs/operators.md, "
                           "\"Which prefill is which\")"))
    return out


def check_server_options(ns: argparse.Namespace) -> None:
    refusals = _refusals(ns)
    if refusals:
        lines = "\n".join(f"  {r.option}: {r.reason}" for r in refusals)
        raise UnsupportedSGLangError(
            "--disaggregation-transfer-backend lynx does not support these options yet:\n" + lines
        )
