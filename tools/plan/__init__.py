"""`lynx-sglang plan`: predicted TTFT, time per output token and SLO goodput of mooncake, Lynx
exact and Lynx int8 for a PD deployment this box cannot hold, from the codec's byte fractions,
the link, per-stage costs measured on this box and a queueing model of the prefill and the link.

`model` is the queueing model (pure Python: no SGLang, no torch), `box` reads this box's stage
costs from the stored results, `validate` runs the model with each stored run's parameters and
compares it with what the run measured, `cli` is the subcommand (registered in `tools/cli.py`).
"""
