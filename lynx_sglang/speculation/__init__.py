"""Speculative decoding on the Anchor inside SGLang's PD decode scheduler.

    controller  SpecController: park, verify, roll back, abort (one per decode scheduler)
    state       SpecState and friends: per-request bookkeeping, who may speculate
    verify      the verification forward, acceptance, rollback (SGLang internals)
    acceptance  the acceptance rules (greedy, speculative sampling), pure torch
    penalties   penalties, logit bias, min_new_tokens: transformed exact and draft rows, the
                penalty state a verified request resumes with
    record      what one verification leaves: trace record, counters, metric, SPEC_RECORD line
    hooks       the SGLang hook adapters, forwarding to the controller of the process's runtime
    stream      the opt-in stream of speculative tokens and rollbacks (ZMQ PUB) and its client

The decode applier (`lynx_sglang.backend.decode.applier`) produces each request's Residual outcome;
the controller consumes it through the applier's `Transfers` interface.
"""
