"""`lynx-sglang plan`: predicted TTFT, time per output token and SLO goodput of mooncake, Lynx
exact and Lynx int8 for a PD deployment this box cannot hold, from the codec's byte fractions,
the link, per-stage costs measured on this box and a queueing model of the prefill and the link.

`model` is the queueing model (pure Python: no SGLang, no torch), `shared_cpu` its event-by-event
simulation where the servers share this box's 2 cores, `box` reads this box's stage costs and CPU
demands from the stored results, `stored` the stored results themselves (bench-load's send times
rebuilt from its seed), `validate` runs the model with each stored run's parameters and compares
it with what the run measured, `cli` is the subcommand (registered in `tools/cli.py`).
"""
