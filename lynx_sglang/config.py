"""Lynx server configuration: the `--lynx-*` flags of an SGLang server and how they reach its
worker processes.

`LynxConfig` embeds the codec's own parameters (`lynx_kernels.CodecSpec`, whose defaults are the
recommended codec) and adds the serving settings. Every `--lynx-*` flag is generated from field
metadata (`add_lynx_arguments`): the codec's fields carry their help text in `lynx_kernels.spec`,
the serving fields below in `_opt`. `LynxConfig.from_namespace` reads the flags after parsing.
SGLang builds its `ServerArgs` record from its own fields only, so the Lynx settings travel to the
scheduler processes (spawned later, with this process's environment) as JSON in the environment
variable `names.CONFIG_ENV`, written by `export_to_env` and read by `LynxConfig.from_env`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lynx_kernels import CodecError, CodecSpec
from lynx_transport.tls import TlsConfig, TlsConfigError
from lynx_transport.verbs import VerbsOptions

from .errors import LynxConfigError
from .names import CONFIG_ENV, SECRET_ENV
from .secret_file import read_secret_file

logger = logging.getLogger(__name__)

TRANSPORTS = ("tcp", "verbs")
MIN_SECRET_BYTES = 16
SPEC_POLICIES = ("auto", "always")
ANCHOR_WIDTHS = ("fixed", "adaptive")
FLAG_PREFIX = "--lynx-"


def _opt(default, help_text: str, **argparse_kw):
    """A serving setting with its `--lynx-*` flag's help text (and extra argparse keywords)."""
    return field(default=default, metadata={"help": help_text, "flag": True, **argparse_kw})


def flag_name(field_name: str) -> str:
    return FLAG_PREFIX + field_name.replace("_", "-")


@dataclass(frozen=True)
class LynxConfig:
    """Everything a Lynx prefill or decode server needs beyond SGLang's own arguments.

    Both ends must use the same codec settings; the decode side checks every chunk header against
    its own (a mismatch fails the request with the differing field named).
    """

    codec: CodecSpec = field(default_factory=CodecSpec)
    transport: str = _opt("tcp", "data plane for the two KV streams", choices=TRANSPORTS)
    ib_device: str | None = _opt(None, "RDMA device for --lynx-transport verbs (e.g. mlx5_0, "
                                       "rxe0) for every rank of this server; default: SGLang's "
                                       "--disaggregation-ib-device resolved per GPU (list, per-GPU "
                                       "map or JSON file, as for Mooncake), else the first device")
    ib_gid_index: int | None = _opt(
        None, "verbs: GID table index of the RDMA port (like Mooncake's MC_GID_INDEX); default: "
              "the GID whose IPv4-mapped address is this server's host, else the first RoCE v2 "
              "GID", type=int)
    ib_anchor_sl: int = _opt(VerbsOptions.anchor_sl, "verbs: InfiniBand service level of the "
                                                     "Anchor queue pair (0-15)")
    ib_residual_sl: int = _opt(VerbsOptions.residual_sl, "verbs: service level of the Residual "
                                                         "queue pair (0-15)")
    ib_anchor_tc: int = _opt(VerbsOptions.anchor_tc, "verbs: RoCE traffic class (DSCP << 2) of "
                                                     "the Anchor queue pair; 184 = DSCP 46 (EF)")
    ib_residual_tc: int = _opt(VerbsOptions.residual_tc, "verbs: traffic class of the Residual "
                                                         "queue pair; 32 = DSCP 8 (CS1)")
    secret_file: str | None = _opt(
        None, "file holding the secret (at least 16 bytes) that authenticates every Lynx transport "
              "session: give every prefill and decode of the deployment the same file (or the "
              f"secret in ${SECRET_ENV}, hex); `lynx-sglang up` makes one. The secret is the "
              "file's bytes as they are (e.g. `head -c 32 /dev/urandom`), or, for a file of only "
              "hex digits and at most one trailing newline, the bytes they spell (e.g. `openssl "
              "rand -hex 32`). The file must be a regular file (not a symbolic link) that only "
              "its owner may access (chmod 600), unless --lynx-insecure. Without a secret Lynx "
              "listens on loopback only, unless --lynx-insecure")
    insecure: bool = _opt(
        False, "allow unauthenticated transport sessions on a non-loopback address: anyone who "
               "can reach the port could write into KV memory; only on an isolated, trusted "
               "network. Also accepts, with a warning, a --lynx-secret-file that others than its "
               "owner may access, or a symbolic link")
    allow_unknown_sglang: bool = _opt(
        False, "run on an SGLang release Lynx has no fingerprints for (`lynx-sglang doctor` "
               "lists what differs from the nearest supported one), after the start-up check "
               "that every hook is in place; refused by default, and always when a function "
               "Lynx hooks or subclasses is missing")
    tls_cert: str | None = _opt(
        None, "tcp transport: PEM certificate (chain) of this server; with --lynx-tls-key and "
              "--lynx-tls-ca every data connection runs TLS 1.3 with certificates checked both "
              "ways against the CA (`lynx-sglang tls-certs` makes a private CA and certificates). "
              "Give prefills and decodes TLS alike: a TLS server refuses a plain peer. Without "
              "it the KV bytes cross the network in clear")
    tls_key: str | None = _opt(None, "tcp transport: PEM private key of --lynx-tls-cert")
    tls_ca: str | None = _opt(None, "tcp transport: PEM CA certificate(s) the peers' TLS "
                                    "certificates must chain to")
    tls_check_hostname: bool = _opt(
        True, "TLS: a prefill also checks that the decode's certificate names the address it "
              "dials (an IP address SAN); --no-lynx-tls-check-hostname checks the chain only")
    chunk_tokens: int = _opt(256, "tokens per wire chunk, a multiple of the group size")
    encode_threads: int = _opt(2, "prefill: threads encoding a layer's K and V at once (the C "
                                  "codec releases the GIL; 1 = one after the other)",
                               choices=(1, 2))
    apply_threads: int = _opt(2, "decode: threads applying a landed layer's K and V at once (the "
                                 "C codec releases the GIL; 1 = one after the other)",
                              choices=(1, 2))
    layer_stream: bool = _opt(
        True, "prefill: encode and send each layer's Anchor while the prefill forward computes "
              "the later layers, so that when the forward ends only its last layers are still "
              "to send (with chunked prefill: the forward of the prompt's last chunk); CPU and "
              "CUDA KV pools (on CUDA through per-layer events). "
              "--no-lynx-layer-stream sends after the forward")
    layer_stream_min_share: float = _opt(
        0.1, "prefill, CPU pools: layer-stream a request only where sending its Anchor after the "
             "forward would delay it by at least this share of its forward (from the measured "
             "link to that decode and the measured forward pace; the encode beside the forward "
             "slows it, which does not pay on a fast link). The first request to a decode, and "
             "while streaming one every 5 minutes and 32 requests, goes after its forward to "
             "measure the link. "
             "0 = stream every request (CUDA pools always do: their forward is not timed yet)")
    link_order: bool = _opt(
        False, "prefill, tcp transport: order the requests that share the link to one decode: a "
               "request whose decode waits on its Residual (its WAITING: the decode parked it at "
               "its speculative cap, or did not speculate) goes before the newer requests' "
               "queued Anchors once it has waited as long as they would take on the link (at its "
               "measured rate), instead of every Anchor before every Residual "
               "(lynx_transport.link_order). A decode that predates the signal: the prefill "
               "guesses the wait from the Residual's byte bound (its Anchor's delivery plus its "
               "own wire time). Off by default: with the guess alone, at R = 1 under load it "
               "cost the next request's Anchor up to 1.2 s (P99 TTFT 0.63x mooncake's against "
               "0.53x) for a time per output token within noise; the signal is not measured yet")
    anchor_width: str = _opt(
        "fixed", "Anchor width per request: 'fixed' = --lynx-anchor-bits for every request; "
                 "'adaptive' = the prefill picks --lynx-anchor-bits or one bit fewer per request, "
                 "the narrower where it brings the first token sooner by at least 0.05 of the "
                 "forward (a link slow against the forward, from the link to that decode and the "
                 "forward pace as measured), the wider elsewhere (its speculation agrees with "
                 "the exact KV more often); exact either way. Give prefill and decode the same "
                 "setting: the decode's staging then holds either width",
        choices=ANCHOR_WIDTHS)
    staging_mib: int = _opt(256, "registered staging memory per server for in-flight requests' "
                                 "encoded KV, in MiB")
    connect_timeout_s: float = _opt(30.0, "deadline for the prefill to connect to a decode's data "
                                          "endpoint, in s")
    transfer_timeout_s: float = _opt(120.0, "stall deadline on decode: once a request's bytes "
                                            "have begun to land, it fails when none lands for "
                                            "this long, in s (prefill: the longest wait for one "
                                            "layer of its forward, a window or staging). The "
                                            "whole transfer, from the decode's announcement, is "
                                            "bounded by SGLang's "
                                            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT or this, "
                                            "whichever is larger")
    speculate: bool = _opt(
        True, "decode: start generating as soon as a request's Anchor has landed, then verify the "
              "speculative tokens with one forward once the Residual is in and roll back what "
              "the exact KV disagrees with; SGLang's own output only ever carries verified tokens "
              "(see --lynx-spec-stream-port); greedy, temperature and (with SGLang's pytorch "
              "sampling backend) top-k/top-p/min-p requests speculate, penalty, logit-bias and "
              "min_new_tokens ones too; logprob requests speculate "
              "and get the exact model's logprobs, grammar ones (xgrammar) too; "
              "custom-logit-processor and hidden-state requests wait for the Residual instead")
    spec_policy: str = _opt(
        "auto", "decode, with --lynx-speculate: 'auto' speculates on a request only when it "
                "pays (the Residual's expected arrival, from the rate the same prefill's recent "
                "Residuals came in at, no faster than this request's Anchor came, is later than "
                "writing the rest of the Anchor plus one verification); 'always' speculates "
                "whenever the Residual is not in yet", choices=SPEC_POLICIES)
    residual: bool = _opt(
        True, "send the Residual stream; --no-lynx-residual sends only the Anchor and the decode "
              "keeps Anchor-precision KV (lossy, like plain low-bit KV quantization: a benchmark "
              "baseline, needs --no-lynx-speculate)")
    spec_max_tokens: int = _opt(128, "cap on speculative tokens per request; a request that "
                                     "reaches it waits for its Residual (a sampled one: see "
                                     "--lynx-spec-max-sampled-tokens)")
    spec_max_sampled_tokens: int = _opt(
        32, "cap on speculative tokens of a sampled (non-greedy) request, at most "
            "--lynx-spec-max-tokens: it keeps each one's draft distribution until verification "
            "(vocabulary x 4 B on the device per token)")
    spec_deadline_s: float = _opt(30.0, "stop speculating on a request whose Residual has not "
                                        "landed this long after its Anchor, and wait for it, in s")
    trace_dir: str | None = _opt(
        None, "write one JSON record per request and stage (lynx_sglang.trace: encode, wire, "
              "apply, report, first step, first token, verification) to DIR/lynx-<pid>.jsonl; "
              "the stage histograms go to SGLang's /metrics with --enable-metrics either way")
    spec_stream_port: int = _opt(
        0, "decode, opt-in: also publish every speculative token, and the outcome of every "
           "verification (tokens accepted, rolled back, corrected), on a ZMQ PUB socket at "
           "--host:PORT (plus the DP rank), one topic per request id, for clients that want "
           "provisional tokens early (lynx_sglang.speculation.stream has the event format and a "
           "client). SGLang's own stream still carries verified tokens only. 0: off")

    def __post_init__(self) -> None:
        if not isinstance(self.codec, CodecSpec):
            raise LynxConfigError(f"codec must be a CodecSpec, got {type(self.codec).__name__}")
        if self.transport not in TRANSPORTS:
            raise LynxConfigError(
                f"{flag_name('transport')} must be one of {TRANSPORTS}, got {self.transport!r}")
        tls_files = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls_files) and not all(tls_files):
            raise LynxConfigError(f"TLS needs all three of {flag_name('tls_cert')}, "
                                  f"{flag_name('tls_key')} and {flag_name('tls_ca')}")
        if any(tls_files) and self.transport != "tcp":
            raise LynxConfigError(f"{flag_name('tls_cert')}: TLS covers the tcp transport's data "
                                  f"connections; {flag_name('transport')} {self.transport} has "
                                  "none (keep RDMA traffic on a fabric only the cluster reaches)")
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.codec.group_size:
            raise LynxConfigError(
                f"{flag_name('chunk_tokens')} must be a positive multiple of "
                f"{flag_name('group_size')} ({self.codec.group_size}): K grouped per channel is "
                f"cut on group boundaries; got {self.chunk_tokens}")
        if not 0 <= self.layer_stream_min_share <= 10:
            raise LynxConfigError(f"{flag_name('layer_stream_min_share')} must be in 0..10 (a "
                                  f"share of the forward), got {self.layer_stream_min_share}")
        if self.anchor_width not in ANCHOR_WIDTHS:
            raise LynxConfigError(f"{flag_name('anchor_width')} must be one of {ANCHOR_WIDTHS}, "
                                  f"got {self.anchor_width!r}")
        if self.anchor_width == "adaptive" and self.codec.anchor_bits < 3:
            raise LynxConfigError(f"{flag_name('anchor_width')} adaptive picks "
                                  f"{flag_name('anchor_bits')} or one bit fewer, and an Anchor "
                                  "has at least 2 bits: give --lynx-anchor-bits 3 or more")
        if self.anchor_width == "adaptive" and not self.residual:
            raise LynxConfigError(f"{flag_name('anchor_width')} adaptive would serve Anchors of "
                                  "two precisions as final KV with --no-lynx-residual: use "
                                  "fixed")
        if self.staging_mib <= 0:
            raise LynxConfigError(f"{flag_name('staging_mib')} must be positive, got "
                                  f"{self.staging_mib}")
        for name in ("connect_timeout_s", "transfer_timeout_s", "spec_deadline_s"):
            if not getattr(self, name) > 0:
                raise LynxConfigError(f"{flag_name(name)} must be > 0")
        try:
            self.verbs_options(device=None)
        except ValueError as exc:
            message = str(exc)
            for option in ("gid_index", "anchor_sl", "residual_sl", "anchor_tc", "residual_tc"):
                message = message.replace(option, flag_name("ib_" + option))
            raise LynxConfigError(message) from None
        if self.speculate and not self.residual:
            raise LynxConfigError("--no-lynx-residual serves the Anchor as the final KV: there is "
                                  "nothing to verify, pass --no-lynx-speculate too")
        if not 0 <= self.spec_stream_port <= 65535:
            raise LynxConfigError(
                f"{flag_name('spec_stream_port')} must be in 0..65535, got "
                f"{self.spec_stream_port}")
        if self.spec_stream_port and not self.speculate:
            raise LynxConfigError("--lynx-spec-stream-port streams speculative tokens: it needs "
                                  "--lynx-speculate")
        if self.spec_policy not in SPEC_POLICIES:
            raise LynxConfigError(f"{flag_name('spec_policy')} must be one of {SPEC_POLICIES}, "
                                  f"got {self.spec_policy!r}")
        for name in ("spec_max_tokens", "spec_max_sampled_tokens"):
            if getattr(self, name) < 0:
                raise LynxConfigError(
                    f"{flag_name(name)} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def build(cls, **settings: Any) -> LynxConfig:
        """A config from flat settings, codec fields included (`build(target="int8",
        speculate=False)`); codec errors are reported with their flag's name."""
        codec_names = {f.name for f in dataclasses.fields(CodecSpec)}
        codec = {k: settings.pop(k) for k in list(settings) if k in codec_names}
        try:
            spec = CodecSpec(**codec)
        except CodecError as exc:
            where = flag_name(exc.field) if exc.field else "codec"
            raise LynxConfigError(f"{where}: {exc}") from None
        return cls(codec=spec, **settings)

    def flat(self) -> dict[str, Any]:
        """Every setting by field name, the codec's included, as JSON-able values."""
        out = {f.name: getattr(self.codec, f.name) for f in dataclasses.fields(CodecSpec)}
        out |= {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "codec"}
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in out.items()}

    def anchor_widths(self) -> tuple[int, ...]:
        """The Anchor widths a request may have (`backend.prefill.anchor_width`), narrowest first."""
        bits = self.codec.anchor_bits
        return (bits - 1, bits) if self.anchor_width == "adaptive" else (bits,)

    def codec_for(self, anchor_bits: int) -> CodecSpec:
        """The codec of a request whose Anchor is `anchor_bits` wide (one of `anchor_widths`):
        the configured codec with that width."""
        return dataclasses.replace(self.codec, anchor_bits=anchor_bits)

    def wire_settings(self) -> dict[str, Any]:
        """The settings prefill and decode must share for the streams to mean the same thing (the
        codec, the chunking, whether a Residual is sent, the data plane); the prefill sends them
        when it opens a session and the decode compares them with its own (`wire_mismatch`)."""
        flat = self.flat()
        return {name: flat[name] for name in WIRE_SETTINGS}

    def verbs_options(self, device: str | None) -> dict[str, Any]:
        """`backend_options` of the verbs transport for this config on RDMA device `device`
        (validated: ValueError names the bad option)."""
        options = {"device": device, "gid_index": self.ib_gid_index,
                   "anchor_sl": self.ib_anchor_sl, "residual_sl": self.ib_residual_sl,
                   "anchor_tc": self.ib_anchor_tc, "residual_tc": self.ib_residual_tc}
        VerbsOptions.from_dict(options)
        return options

    def tls_config(self) -> TlsConfig | None:
        """The tcp transport's TLS files, checked (LynxConfigError names the flag and the file),
        or None without TLS."""
        if not self.tls_cert:
            return None
        try:
            tls = TlsConfig(self.tls_cert, self.tls_key, self.tls_ca,
                            check_hostname=self.tls_check_hostname)
            tls.contexts()
        except TlsConfigError as exc:
            raise LynxConfigError(f"{flag_name('tls_cert')}: {exc}") from None
        return tls

    def load_secret(self) -> bytes | None:
        """The transport secret: from the file (`read_secret_file`; one that is not safe is
        refused unless --lynx-insecure), else the hex in the environment, else None."""
        if self.secret_file:
            read = read_secret_file(self.secret_file, flag_name("secret_file"))
            if read.unsafe and not self.insecure:
                raise LynxConfigError(f"{flag_name('secret_file')}: {read.unsafe}, or pass "
                                      f"{flag_name('insecure')} to use it anyway")
            if read.unsafe:
                logger.warning("lynx: %s: %s; used anyway (%s)", flag_name("secret_file"),
                               read.unsafe, flag_name("insecure"))
            secret = read.secret
            where = f"{flag_name('secret_file')} {self.secret_file}" + (
                " (hex digits)" if read.hex else "")
        elif os.environ.get(SECRET_ENV):
            try:
                secret = bytes.fromhex(os.environ[SECRET_ENV].strip())
            except ValueError:
                raise LynxConfigError(f"${SECRET_ENV} must be hex") from None
            where = f"${SECRET_ENV}"
        else:
            return None
        if len(secret) < MIN_SECRET_BYTES:
            raise LynxConfigError(f"{where}: the secret is {len(secret)} B; use at least "
                                  f"{MIN_SECRET_BYTES} random bytes")
        return secret

    def to_flags(self) -> list[str]:
        """The `--lynx-*` server flags that give this config (those that differ from the
        defaults), e.g. for a launcher starting a prefill and a decode with the same settings."""
        default = LynxConfig().flat()
        out: list[str] = []
        for name, value in self.flat().items():
            if value == default[name]:
                continue
            if isinstance(value, bool):
                out.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
            else:
                out += [flag_name(name), str(value)]
        return out

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> LynxConfig:
        """The config the `--lynx-*` flags give, over `--lynx-config` if one was given (a flag
        left at its default takes the file's value; a flag set on the command line wins)."""
        flat = {f.name: getattr(ns, _dest(f.name)) for f in _flag_fields()}
        source = getattr(ns, CONFIG_SOURCE_DEST, None)
        if source:
            defaults = cls().flat()
            for name, value in load_config_source(source).items():
                if flat[name] == defaults[name]:
                    flat[name] = value
        return cls.build(**flat)

    def export_to_env(self) -> None:
        os.environ[CONFIG_ENV] = json.dumps(self.flat())

    @classmethod
    def from_env(cls) -> LynxConfig | None:
        raw = os.environ.get(CONFIG_ENV)
        if not raw:
            return None
        try:
            return cls.build(**json.loads(raw))
        except (TypeError, json.JSONDecodeError) as exc:
            raise LynxConfigError(f"bad {CONFIG_ENV}={raw!r}: {exc}") from exc


def _dest(name: str) -> str:
    return "lynx_" + name


def _flag_fields() -> list[dataclasses.Field]:
    """The fields that have a flag: the codec's first, then the serving ones, in declared order."""
    codec = [f for f in dataclasses.fields(CodecSpec) if f.metadata.get("flag")]
    return codec + [f for f in dataclasses.fields(LynxConfig) if f.metadata.get("flag")]


def _argparse_kwargs(f: dataclasses.Field, default: Any) -> dict[str, Any]:
    """argparse keywords for a field, from its default's type and its metadata."""
    extra = {k: v for k, v in f.metadata.items() if k not in ("help", "flag")}
    if isinstance(default, enum.Enum):
        shown = default.value
        kwargs = {"choices": [m.value for m in type(default)], "default": default.value}
    elif isinstance(default, bool):
        shown = "on" if default else "off"
        kwargs = {"action": argparse.BooleanOptionalAction, "default": default}
    else:
        shown = "none" if default is None else f"{default:g}" if isinstance(default, float) \
            else default
        kwargs = {"type": type(default) if default is not None else str, "default": default}
    kwargs |= extra
    kwargs["help"] = f"{f.metadata['help']} (default {shown})"
    return kwargs


CONFIG_SOURCE_DEST = "lynx_config_source"


def load_config_source(source: str) -> dict[str, Any]:
    """`--lynx-config`'s settings: a JSON object, inline or in a file, keyed by field or flag name
    (`"target"`, `"lynx-target"` or `"--lynx-target"`); unknown keys are refused by name."""
    try:
        text = source if source.lstrip()[:1] in ("{", "[") else Path(source).read_text()
        raw = json.loads(text)
    except (OSError, json.JSONDecodeError) as exc:
        raise LynxConfigError(f"--lynx-config {source!r}: {exc}") from None
    if not isinstance(raw, dict):
        raise LynxConfigError(f"--lynx-config must be a JSON object, got {type(raw).__name__}")
    known = {f.name for f in _flag_fields()}
    out, unknown = {}, []
    for key, value in raw.items():
        name = str(key).removeprefix("--").removeprefix("lynx-").removeprefix("lynx_")
        name = name.replace("-", "_")
        if name in known:
            out[name] = value
        else:
            unknown.append(key)
    if unknown:
        raise LynxConfigError(f"--lynx-config: unknown settings {unknown}; known: {sorted(known)}")
    return out


def add_lynx_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `--lynx-*` flags (used only with --disaggregation-transfer-backend lynx)."""
    codec, config = CodecSpec(), LynxConfig()
    g = parser.add_argument_group(
        "Lynx KV transfer (with --disaggregation-transfer-backend lynx; "
        "set the same values on prefill and decode)"
    )
    g.add_argument("--lynx-config", dest=CONFIG_SOURCE_DEST, default=None, metavar="FILE|JSON",
                   help="Lynx settings as a JSON object (inline or a file), keyed by flag name "
                        "without --lynx- (e.g. '{\"target\": \"exact\", \"staging-mib\": 1024}'); "
                        "flags given on the command line win")
    for f in _flag_fields():
        default = getattr(codec if hasattr(codec, f.name) else config, f.name)
        g.add_argument(flag_name(f.name), dest=_dest(f.name), **_argparse_kwargs(f, default))


WIRE_SETTINGS = (*(f.name for f in dataclasses.fields(CodecSpec)), "chunk_tokens", "residual",
                 "transport", "anchor_width")


def wire_mismatch(decode: dict[str, Any], prefill: Any) -> list[str]:
    """The wire settings that differ, each as `--lynx-flag: prefill X, decode Y` (a prefill that
    sent none, or not a dict, differs in all of them)."""
    prefill = prefill if isinstance(prefill, dict) else {}
    return [f"{flag_name(name)}: prefill {prefill.get(name, '(not sent)')!r}, decode {value!r}"
            for name, value in decode.items() if prefill.get(name, object()) != value]
