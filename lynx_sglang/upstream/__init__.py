"""Lynx's one room for SGLang's internals: what Lynx reaches into, by logical name, and what the
installed SGLang release has of it.

- `hook_table`: every SGLang function Lynx hooks (a logical name, the dotted target, the hook
  kind), every SGLang method Lynx's subclasses override, whose logic Lynx copies or that it calls
  without hooking: the whole face Lynx depends on.
- `hook_check`: registers Lynx's hooks in SGLang's `HookRegistry` and checks, before a server
  serves, that every one resolved and was applied (SGLang's registry only logs a failure: a
  half-hooked server would serve wrong tokens); the per-hook status `lynx-sglang doctor` prints.
- `fingerprints`: the signature and a hash of the source of everything in the table, per
  supported release (`releases/*.json`): the installed SGLang is identified by them, an unknown
  one refused with what changed unless `--lynx-allow-unknown-sglang`.
- `adapter`: what Lynx does differently per supported release where SGLang's internals moved or
  changed shape (the backend classes' bases, helpers one release lacks, request layouts), each
  picked by feature detection, never by the version string.
- `kv_transfer`: SGLang's transfer-backend interface as the backend's classes meet it: their
  base classes, SGLang's enums and records, accessors for the Mooncake manager's private state.
- `backend_registry`: `lynx` as one of SGLang's transfer backends (the CLI choice, the
  `TransferBackend` member, `get_kv_class`'s answer).
- `scheduler_api`: what the speculation controller calls in SGLang's scheduler without hooking
  it (abort, release, the decode batch, the verification's EXTEND forward, the sampler's softmax
  and logprobs, private queue helpers).
- `sampling_filter`, `logprob_layout`: SGLang logic Lynx copies and must track (the torch
  sampler's top-k/top-p/min-p filter; the per-request output logprob lists as SGLang's decode
  step appends them).
- `sglang_names`: SGLang's names the runtime uses as values (an enum member, a pool class, a
  device resolver, which SGLang modules a process has loaded), one function each.
- `launch`: SGLang's server launch (`lynx_sglang.serve`); `cpu_compat`: the import-time fallbacks
  and guards SGLang needs to serve without CUDA.

No other runtime module imports SGLang or names one of its modules (tests/test_layout.py): the
rest of the runtime reaches SGLang through this package, and the hook adapters it registers
(`hooks`, `request_trace`, `speculation.hooks`) act on the SGLang objects the hooks hand them.

Who calls it: `lynx_sglang.plugin` (registration, the launcher's checks), the Lynx KV manager at
scheduler start-up (`check_release`, `hook_check.verify_applied`), `lynx-sglang doctor`; the
backend's classes (`kv_transfer`) and the speculation modules (`scheduler_api`, `adapter`).
"""
