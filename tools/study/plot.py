"""The Anchor study's figure: agreement and KL of every KV variant, against Anchor bytes.

Left: top-1 agreement vs bytes / BF16 bytes at 2k tokens (points numbered, 95% CIs over prompts),
with the byte budget and the goal (half the naive Anchor's disagreement). Middle: each variant's
agreement minus the naive Anchor's (paired bootstrap CI). Right: mean KL(exact || variant), log
scale. Called by `lynx_tools.study.anchor_study` with the summary dict it writes to JSON; also
`python -m lynx_tools.study.plot RESULT.json OUT.png` redraws from a result file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _color(s: dict, baseline: str | None) -> str:
    if s["name"] == baseline:
        return "tab:red"
    if s["spec"]["kind"] == "minmax":
        return "tab:gray"
    if s["spec"]["kind"] in ("bf16", "identity"):
        return "tab:purple"
    return "tab:green" if s["meets_goal"] else "tab:blue"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = summary["baseline"]
    rows = sorted(summary["variants"], key=lambda s: s["agreement"]["mean"])
    fig, (ax_s, ax_d, ax_k) = plt.subplots(
        1, 3, figsize=(18, 8), gridspec_kw={"width_ratios": [1.3, 1, 1]})

    refs = 0
    for i, s in enumerate(rows):
        x, iv = s["bytes_ratio"]["2048"], s["agreement"]
        if x >= 0.999:
            ax_s.axhline(iv["mean"] * 100, color="tab:purple", ls=":", lw=1)
            # References often share a line (100%): their labels go side by side.
            ax_s.annotate(f"{i} {s['name']} (bytes 1.0)", (0.01 + 0.3 * refs, iv["mean"] * 100),
                          fontsize=8,
                          xycoords=("axes fraction", "data"), xytext=(0, 3),
                          textcoords="offset points", color="tab:purple")
            refs += 1
            continue
        ax_s.errorbar(x, iv["mean"] * 100, yerr=[[(iv["mean"] - iv["lo"]) * 100],
                                                [(iv["hi"] - iv["mean"]) * 100]],
                      fmt="o", color=_color(s, base), capsize=3, ms=5, alpha=0.8)
        ax_s.annotate(str(i), (x, iv["mean"] * 100), fontsize=8, xytext=(4, 2),
                      textcoords="offset points")
    ax_s.axvline(summary["bytes_budget"], color="k", ls="--", lw=1)
    if summary["goal_agreement"] is not None:
        ax_s.axhline(summary["goal_agreement"] * 100, color="tab:green", ls="--", lw=1)
        ax_s.annotate("goal: half the naive disagreement", (0.01, summary["goal_agreement"] * 100),
                      xycoords=("axes fraction", "data"), xytext=(0, -11),
                      textcoords="offset points", fontsize=8, color="tab:green")
    ax_s.set_xlabel("Anchor bytes / BF16 KV bytes (2k-token prompt); dashed: budget 0.30")
    ax_s.set_ylabel("top-1 agreement with exact decoding, % (teacher-forced, 95% CI)")
    ax_s.grid(alpha=0.3)

    labels = [f"{i} {s['name']} ({s['bytes_ratio']['2048']:.3f})" for i, s in enumerate(rows)]
    ys = list(range(len(rows)))
    for y, s in zip(ys, rows, strict=True):
        d = s["agreement_diff"]
        if d is not None:
            ax_d.errorbar(d["mean"] * 100, y, xerr=[[(d["mean"] - d["lo"]) * 100],
                                                   [(d["hi"] - d["mean"]) * 100]],
                          fmt="o", color=_color(s, base), capsize=3, ms=5)
        k = s["kl"]
        if k["mean"] > 0:
            ax_k.errorbar(k["mean"], y, xerr=[[k["mean"] - max(k["lo"], 1e-12)], [k["hi"] - k["mean"]]],
                          fmt="o", color=_color(s, base), capsize=3, ms=5)
    ax_d.axvline(0, color="tab:red", lw=1)
    if summary["goal_agreement"] is not None:
        naive = next(s for s in rows if s["name"] == base)["agreement"]["mean"]
        ax_d.axvline((summary["goal_agreement"] - naive) * 100, color="tab:green", ls="--", lw=1)
    ax_d.set_yticks(ys, labels, fontsize=8)
    ax_d.set_xlabel("agreement − naive Anchor, percentage points (paired bootstrap 95% CI)")
    ax_d.grid(alpha=0.3)
    ax_k.set_yticks(ys, [s["name"] for s in rows], fontsize=8)
    ax_k.set_xscale("log")
    ax_k.set_xlabel("mean KL(exact || variant), nats (95% CI; zero not drawn)")
    ax_k.grid(alpha=0.3)
    fig.suptitle(f"Decoding over approximate prefix KV vs exact, SmolLM2-135M fp32: {summary['prompts']} "
                 f"prompts, {summary['positions']} positions. red: naive Anchor, green: meets the goal, "
                 "blue: other Anchor, gray: min-max INT-b (KIVI-style), purple: references", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m lynx_tools.study.plot RESULT.json OUT.png", file=sys.stderr)
        return 2
    plot(json.loads(Path(argv[0]).read_text())["summary"], Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
