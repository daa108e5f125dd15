"""The load tools: `lynx-sglang load` (`run`: concurrent, partly abandoned requests, outputs checked;
its request mix `mix`) and `lynx-sglang bench-load` (`bench`: Poisson arrivals; its figures
`stats`)."""
