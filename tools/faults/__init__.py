"""`lynx-sglang faults`: the fault matrix's subcommand (`run`), its cells (`cells`) and the runner
that injects them into a PD cluster (`matrix`)."""
