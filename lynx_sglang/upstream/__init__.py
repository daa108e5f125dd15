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
- `sglang_names`: SGLang's names the runtime uses as values (an enum member, a pool class, a
  device resolver), one function each.

Other runtime modules still import SGLang themselves (tests/test_layout.py lists them and lets
the list only shrink): the KV manager and transfer classes, the plugin, `serve` and the
speculation modules.

Who calls it: `lynx_sglang.plugin` (registration, the launcher's checks), the Lynx KV manager at
scheduler start-up (`check_release`, `hook_check.verify_applied`), `lynx-sglang doctor`; the
backend's classes and the speculation controller (`adapter`).
"""
