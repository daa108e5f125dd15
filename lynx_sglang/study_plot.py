"""The Anchor study's figure: agreement and KL against Anchor bytes, one point per KV variant.

Called by `lynx_sglang.anchor_study` with the summary dict it writes to JSON; writes one PNG.
"""

from __future__ import annotations

from pathlib import Path


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in summary["variants"] if s["bytes_ratio"]["2048"] < 0.999]
    refs = [s for s in summary["variants"] if s["bytes_ratio"]["2048"] >= 0.999]
    fig, (ax_a, ax_k) = plt.subplots(1, 2, figsize=(15, 7.5))
    for ax, key, scale in ((ax_a, "agreement", 100.0), (ax_k, "kl", 1.0)):
        for s in rows:
            iv = s[key]
            x = s["bytes_ratio"]["2048"]
            color = ("tab:gray" if s["spec"]["kind"] == "minmax" else
                     "tab:red" if s["name"] == summary["baseline"] else
                     "tab:green" if s["meets_goal"] else "tab:blue")
            ax.errorbar(x, iv["mean"] * scale,
                        yerr=[[(iv["mean"] - iv["lo"]) * scale], [(iv["hi"] - iv["mean"]) * scale]],
                        fmt="o", color=color, capsize=3, ms=5)
            ax.annotate(s["name"], (x, iv["mean"] * scale), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        for s in refs:
            ax.axhline(s[key]["mean"] * scale, color="tab:purple", ls=":", lw=1)
            ax.annotate(f"{s['name']} (bytes 1.0)", (0.0, s[key]["mean"] * scale), fontsize=7,
                        xycoords=("axes fraction", "data"), xytext=(4, 3), textcoords="offset points",
                        color="tab:purple")
        ax.axvline(summary["bytes_budget"], color="k", ls="--", lw=1)
        ax.set_xlabel("Anchor bytes / BF16 KV bytes (2k-token prompt)")
        ax.grid(alpha=0.3)
    if summary["goal_agreement"] is not None:
        ax_a.axhline(summary["goal_agreement"] * 100, color="tab:green", ls="--", lw=1)
        ax_a.annotate("goal: half the naive disagreement", (0.0, summary["goal_agreement"] * 100),
                      xycoords=("axes fraction", "data"), xytext=(4, -10),
                      textcoords="offset points", fontsize=7, color="tab:green")
    ax_a.set_ylabel("top-1 agreement with exact decoding, % (teacher-forced; 95% CI over prompts)")
    ax_k.set_ylabel("mean KL(exact || variant), nats (95% CI over prompts)")
    ax_k.set_yscale("log")
    fig.suptitle(f"SmolLM2-135M, {summary['prompts']} prompts, {summary['positions']} positions; "
                 "red = naive Anchor, green = meets the goal, gray = plain min-max INT-b (KIVI-style)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
