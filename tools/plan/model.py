"""The queueing model behind `lynx-sglang plan`: one decode fed by `prefills_per_decode` prefill
instances over one shared link (the decode's ingress), each prefill an M/G/1 FIFO server of
Poisson arrivals whose service time is its forward, the link a single server shared by every
request's KV streams.

What each variant puts on the link (`Variant`, byte fractions from the codec, `CodecFractions`):
mooncake sends the whole BF16 KV after the forward, FIFO, and its first token waits for the last
byte. Lynx sends an Anchor (high priority, preempting Residuals) and a Residual (low priority);
the prefill layer-streams both during the forward where sending after it would delay the Anchor by
at least `stream_min_share` of the forward (`lynx_sglang.backend.prefill.stream_policy`), else sends them
after it. A speculative Lynx first token waits for the Anchor only, unless the Residual is due
sooner than one verification (then it waits for it, as `decode_policy.decide_speculation`); its
later tokens are held until the Residual is applied and one verification forward releases the
accepted ones. Decode steps take `DecodeStep` seconds (on a GPU growing with the batch's KV,
the batch from Little's law).

On a GPU the forward and the steps have their processors to themselves. On this box (2 CPU
cores, where the validation's runs were measured) the prefill's and the decode's servers share
them: `SharedCpu` (`Deployment.cpu`, set by `tools.plan.validate` only) says how, and `simulate`
then runs `tools.plan.shared_cpu`'s event-by-event simulation, each activity at the speed the
scheduler leaves it. Without it (`cpu` None, every GPU prediction) nothing is slowed.

Two ways to evaluate it, both here: `pk_wait` (Pollaczek-Khinchine mean waiting times, used for
the stability check and the analytic means in the report) and `simulate` (the same stations
event by event, the source of every percentile: a finite pass of a few requests as the stored
benchmarks ran, or a long steady-state run). `predict` is what the CLI calls; `tools.plan.validate`
calls `simulate` with the stored runs' parameters. Pure Python: no SGLang, no torch, no numpy.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import statistics
from dataclasses import dataclass, field

BF16_BYTES = 2


class PlanError(ValueError):
    """A deployment or workload the model cannot evaluate; the message says which parameter."""


class UnstableError(PlanError):
    """A queue whose utilisation is at or above 1: no steady state, so no TTFT to predict."""


# --- the deployment --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the KV size needs (layers, KV heads, head dim) and, for GPU estimates, the FLOPs and
    weight bytes (parameters, query heads)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float | None = None
    q_heads: int | None = None

    def __post_init__(self):
        for what in ("layers", "kv_heads", "head_dim"):
            if getattr(self, what) <= 0:
                raise PlanError(f"model {what} must be positive, got {getattr(self, what)}")

    @property
    def kv_bytes_per_token(self) -> int:
        """BF16 K and V of every layer for one token: what mooncake moves per prompt token."""
        return self.layers * 2 * self.kv_heads * self.head_dim * BF16_BYTES


# The same figures as tools/regimes.py's table (which owns the docs' R table).
PRESETS = {m.name: m for m in (
    ModelShape("SmolLM2-135M", 30, 3, 64, params=134.5e6, q_heads=9),
    ModelShape("Llama-3-8B", 32, 8, 128, params=8.03e9, q_heads=32),
    ModelShape("Llama-3-70B", 80, 8, 128, params=70.6e9, q_heads=64),
    ModelShape("Qwen2.5-32B", 64, 8, 128, params=32.8e9, q_heads=40),
)}


@dataclass(frozen=True)
class Gpu:
    """Dense BF16 peak and HBM bandwidth of one GPU (datasheet figures, not measurements)."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float


GPUS = {g.name: g for g in (
    Gpu("H100", 989e12, 3.35e12),
    Gpu("H200", 989e12, 4.8e12),
    Gpu("A100", 312e12, 2.0e12),
)}


@dataclass(frozen=True)
class ForwardTime:
    """A prefill forward's seconds for a T-token prompt: per_token_s × T + per_token2_s × T²
    (matmuls linear in T, causal attention quadratic)."""

    per_token_s: float
    per_token2_s: float = 0.0

    def __post_init__(self):
        if self.per_token_s <= 0 or self.per_token2_s < 0:
            raise PlanError("the prefill forward time must be positive")

    def seconds(self, tokens: int) -> float:
        return self.per_token_s * tokens + self.per_token2_s * tokens * tokens

    @classmethod
    def measured(cls, forward_s: float, tokens: int) -> ForwardTime:
        """A forward measured at `tokens`, scaled linearly (at this box's ≤ 1500 tokens the
        attention term is small)."""
        if forward_s <= 0 or tokens <= 0:
            raise PlanError(f"the measured forward must be positive, got {forward_s} s at "
                            f"{tokens} tokens")
        return cls(forward_s / tokens)

    @classmethod
    def from_gpu(cls, shape: ModelShape, gpu: Gpu, gpus: int, mfu: float) -> ForwardTime:
        """2 FLOPs per parameter per token plus causal attention (2 × layers × T² × query heads ×
        head dim), at `mfu` of `gpus` GPUs' peak: an estimate, as tools/regimes.py's."""
        if shape.params is None or shape.q_heads is None:
            raise PlanError(f"model {shape.name}: parameters and query heads are needed to "
                            "estimate the forward from a GPU (or give --forward-s)")
        if not 0 < mfu <= 1:
            raise PlanError(f"MFU must be in (0, 1], got {mfu}")
        if gpus <= 0:
            raise PlanError(f"GPUs per prefill must be positive, got {gpus}")
        flops = gpus * gpu.bf16_flops * mfu
        return cls(2 * shape.params / flops, 2 * shape.layers * shape.q_heads * shape.head_dim / flops)


@dataclass(frozen=True)
class DecodeStep:
    """One decode step: base_s + s_per_kv_byte × the KV bytes the running batch reads (a GPU's
    step is memory-bound: weights once, every request's KV; on this box a measured constant)."""

    base_s: float
    s_per_kv_byte: float = 0.0

    def __post_init__(self):
        if self.base_s <= 0 or self.s_per_kv_byte < 0:
            raise PlanError("the decode step time must be positive")

    @classmethod
    def from_gpu(cls, shape: ModelShape, gpu: Gpu, gpus: int, efficiency: float) -> DecodeStep:
        if shape.params is None:
            raise PlanError(f"model {shape.name}: parameters are needed to estimate the decode "
                            "step from a GPU (or give --decode-step-ms)")
        bw = gpus * gpu.hbm_bytes_per_s * efficiency
        return cls(shape.params * BF16_BYTES / bw, 1.0 / bw)


@dataclass(frozen=True)
class CodecFractions:
    """Wire bytes per BF16 KV byte (docs/codec.md, `codec-report` on real SmolLM2-135M KV,
    headers included): the 4-bit Anchor, Anchor + INT8 Residual, Anchor + exact Residual."""

    anchor: float = 0.296
    int8_total: float = 0.546
    exact_total: float = 0.735

    def __post_init__(self):
        if not 0 < self.anchor <= min(self.int8_total, self.exact_total):
            raise PlanError(f"byte fractions must be 0 < anchor <= totals, got {self}")


@dataclass(frozen=True)
class StageCosts:
    """What a request costs beyond the forward and the wire (`tools.plan.box` reads this box's).

    fixed_s: send → first token beyond forward and wire (bootstrap, first step, client), per
    request. encode_*: the prefill's encode of a room sent after its forward, seconds per BF16
    byte (streamed rooms encode under the forward). apply_*: the decode's apply of the Residual,
    seconds per BF16 byte. verify_steps: (speculated positions, cost of the verification forward
    in decode steps), interpolated. spec_hold_share / spec_break_mean: of speculating requests,
    the share whose speculation holds to the end, and where the others break (mean tokens kept).
    """

    fixed_s: float = 0.05
    encode_exact_s_per_byte: float = 0.0
    encode_int8_s_per_byte: float = 0.0
    apply_exact_s_per_byte: float = 0.0
    apply_int8_s_per_byte: float = 0.0
    verify_steps: tuple[tuple[int, float], ...] = ((1, 1.8), (8, 2.0), (32, 2.7), (128, 6.1))
    spec_hold_share: float = 11 / 18
    spec_break_mean: float = 11.1
    stream_min_share: float = 0.1
    spec_cap: int = 128

    def verify_in_steps(self, positions: int) -> float:
        pts = sorted(self.verify_steps)
        if positions <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if positions <= x1:
                return y0 + (y1 - y0) * (positions - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) * (positions - x1) / (x1 - x0)


@dataclass(frozen=True)
class Variant:
    """A transfer as the model sees it. `target`: None for BF16 (mooncake), else the Lynx target
    ("exact", "int8") whose Anchor + Residual bytes complete the KV; `residual` False sends the
    Anchor alone (int4-anchor); `speculative`: decoding starts on the Anchor."""

    name: str
    description: str
    target: str | None
    speculative: bool = False
    residual: bool = True

    @property
    def lynx(self) -> bool:
        return self.target is not None

    def stream_fractions(self, fr: CodecFractions) -> tuple[float, float]:
        """(first stream, second stream) bytes per BF16 byte: (1, 0) for BF16."""
        if not self.lynx:
            return 1.0, 0.0
        if not self.residual:
            return fr.anchor, 0.0
        total = fr.exact_total if self.target == "exact" else fr.int8_total
        return fr.anchor, total - fr.anchor


MOONCAKE = Variant("mooncake", "SGLang's mooncake: BF16 KV, decode waits for the last byte", None)
LYNX = Variant("lynx", "Lynx exact: speculative on the Anchor, bit-identical KV", "exact", True)
LYNX_INT8 = Variant("lynx-int8", "Lynx int8 target: speculative, INT8 KV (lossy)", "int8", True)
PLAN_VARIANTS = (MOONCAKE, LYNX, LYNX_INT8)
# Measured on this box and modelled for the validation only.
LYNX_INT8_NOSPEC = Variant("lynx-int8-nospec", "INT8 KV, waits for it (lossy)", "int8", False)
INT4_ANCHOR = Variant("int4-anchor", "the Anchor alone (lossy)", "exact", False, residual=False)
VARIANTS = {v.name: v for v in (*PLAN_VARIANTS, LYNX_INT8_NOSPEC, INT4_ANCHOR)}


@dataclass(frozen=True)
class CpuDemand:
    """Cores an activity keeps busy while it runs with every core it asks for (its CPU seconds
    per second): the prefill's forward, the decode's steps (one batch however many requests it
    holds; drafts and verifications included), mooncake's transfer engine polling while its BF16
    bytes are on the wire, and one Lynx encode or apply (a codec thread)."""

    forward: float
    decode: float
    bf16_sender: float
    codec: float = 1.0

    def __post_init__(self):
        if min(self.forward, self.decode, self.codec) <= 0 or self.bf16_sender < 0:
            raise PlanError(f"CPU demands must be positive, got {self}")


ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class SharedCpu:
    """Processors the deployment's servers share (this box; a GPU deployment has none: its
    forward and steps run on the GPU, so `Deployment.cpu` stays None).

    Shared as Linux shares them here: the scheduler (CFS) with autogroup on (this box's
    /proc/sys/kernel/sched_autogroup_enabled is 1) puts each session in its own group, and every
    server starts a session of its own (tools/cluster/local.py, start_new_session), so the
    prefill's processes (its forward, its encode, mooncake's transfer engine) are one group and
    the decode's (its steps, drafts and verifications, the apply) another. A pool's cores go to
    its groups max-min fairly (a group asking for less than an equal share gets what it asks;
    the others split the rest), and within a group to its activities in proportion to what they
    ask: each runs at `rates`' speed for its role. Unpinned, both roles are in one pool of
    `cores`; pinned (`--pin-roles`), each in its own (`prefill_cores`, `decode_cores`)."""

    demand: CpuDemand
    cores: float
    pinned: bool = False
    prefill_cores: float = 0.0
    decode_cores: float = 0.0

    def __post_init__(self):
        if self.cores <= 0 or (self.pinned and min(self.prefill_cores, self.decode_cores) <= 0):
            raise PlanError(f"a CPU pool needs cores, got {self}")

    def _pools(self) -> list[tuple[float, tuple[str, ...]]]:
        if self.pinned:
            return [(self.prefill_cores, ("prefill",)), (self.decode_cores, ("decode",))]
        return [(self.cores, ROLES)]

    def rates(self, asked: dict[str, float]) -> dict[str, float]:
        """Each role's speed (1: full) while its activities ask for asked[role] cores."""
        out = {}
        for cores, roles in self._pools():
            left, waiting = cores, sorted(roles, key=lambda r: asked.get(r, 0.0))
            while waiting:
                role = waiting.pop(0)
                want = asked.get(role, 0.0)
                got = min(want, left / (len(waiting) + 1))
                left -= got
                out[role] = 1.0 if want <= got else got / want
        return out

    def forward_alone_rate(self) -> float:
        """The speed of a forward running alone: one measured so (bench-load's calibration, on
        the pinned prefill's cores too) took forward / this at full speed."""
        return self.rates({"prefill": self.demand.forward})["prefill"]


@dataclass(frozen=True)
class Deployment:
    """One decode and the prefills that feed it. `rate`: Poisson requests per second into EACH
    prefill (the decode's link carries prefills_per_decode × rate). `prompts` / `outputs`: the
    lengths each request draws from (uniformly: a sample of the distribution). `forward` and
    `decode`: at full speed (with `cpu`, as fast as they run with every core they ask for)."""

    shape: ModelShape
    prompts: tuple[int, ...]
    outputs: tuple[int, ...]
    rate: float
    link_bps: float
    prefills_per_decode: int
    forward: ForwardTime
    decode: DecodeStep
    costs: StageCosts = field(default_factory=StageCosts)
    fractions: CodecFractions = field(default_factory=CodecFractions)
    cpu: SharedCpu | None = None  # this box's shared processors (None: no CPU contention)

    def __post_init__(self):
        if not math.isfinite(self.rate) or self.rate < 0:
            raise PlanError(f"the request rate must be >= 0 req/s, got {self.rate}")
        if not math.isfinite(self.link_bps) or self.link_bps <= 0:
            raise PlanError(f"the link must be faster than 0 bit/s, got {self.link_bps}")
        if self.prefills_per_decode < 1:
            raise PlanError(f"prefills per decode must be >= 1, got {self.prefills_per_decode}")
        if not self.prompts or min(self.prompts) < 1:
            raise PlanError("prompt lengths must be >= 1 token")
        if not self.outputs or min(self.outputs) < 1:
            raise PlanError("output lengths must be >= 1 token")

    @property
    def decode_rate(self) -> float:
        return self.rate * self.prefills_per_decode

    def wire_s(self, tokens: int, fraction: float) -> float:
        return tokens * self.shape.kv_bytes_per_token * fraction * 8 / self.link_bps


# --- analytic pieces ---------------------------------------------------------------------------


def pk_wait(rate: float, mean_s: float, second_moment_s2: float) -> float:
    """Mean waiting time in queue of an M/G/1 FIFO server (Pollaczek-Khinchine):
    λ E[S²] / (2 (1 - ρ)), ρ = λ E[S]. Raises UnstableError at ρ >= 1."""
    rho = rate * mean_s
    if rho >= 1:
        raise UnstableError(f"utilisation {rho:.3g} >= 1")
    return rate * second_moment_s2 / (2 * (1 - rho))


def _moments(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.fmean(v * v for v in values)


@dataclass(frozen=True)
class Utilisation:
    prefill: float
    link: dict[str, float]  # per variant: all its bytes
    decode_step_s: float  # at the decode's steady batch


def utilisation(dep: Deployment, variants=PLAN_VARIANTS) -> Utilisation:
    """Busy shares of each station at `dep.rate`; the prefill's above 1 raises UnstableError
    (nothing can be predicted), a variant's link above 1 is reported for that variant."""
    mean_f = statistics.fmean(dep.forward.seconds(t) for t in dep.prompts)
    rho_p = dep.rate * mean_f
    if rho_p >= 1:
        raise UnstableError(
            f"unstable: each prefill is busy {rho_p:.2f} of the time ({dep.rate:g} req/s x mean "
            f"forward {mean_f:.3g} s); its queue grows without bound, so no TTFT exists. One "
            f"prefill serves at most {1 / mean_f:.3g} req/s: lower --rate or add prefills")
    mean_t = statistics.fmean(dep.prompts)
    link = {}
    for v in variants:
        first, second = v.stream_fractions(dep.fractions)
        link[v.name] = dep.decode_rate * dep.wire_s(1, first + second) * mean_t
    return Utilisation(rho_p, link, decode_step_s(dep))


def decode_step_s(dep: Deployment) -> float:
    """The decode step at the steady batch: B = Λ × n_out × step (Little), each request reading
    its prompt + half its output of KV: step = base / (1 - s × Λ × n_out × kv)."""
    d = dep.decode
    if d.s_per_kv_byte == 0 or dep.decode_rate == 0:
        return d.base_s
    n_out = statistics.fmean(dep.outputs)
    kv = (statistics.fmean(dep.prompts) + n_out / 2) * dep.shape.kv_bytes_per_token
    load = d.s_per_kv_byte * dep.decode_rate * n_out * kv
    if load >= 1:
        raise UnstableError(f"unstable: the decode's batch would read its KV slower than it "
                            f"grows (load {load:.2f} >= 1): lower --rate or prefills per decode")
    return d.base_s / (1 - load)


def link_unstable_reason(dep: Deployment, variant: Variant, util: Utilisation) -> str | None:
    rho = util.link[variant.name]
    if rho < 1:
        return None
    return (f"unstable: the link would be busy {rho:.2f} of the time with {variant.name}'s bytes "
            f"({dep.decode_rate:g} req/s into the decode); its queue grows without bound")


# --- one request, no queue ---------------------------------------------------------------------


def _streams(dep: Deployment, variant: Variant, tokens: int) -> bool:
    """The Lynx prefill layer-streams a room where sending its Anchor after the forward would
    delay it by at least stream_min_share of the forward."""
    if not variant.lynx:
        return False
    after = _encode_s(dep, variant, tokens) + dep.wire_s(tokens, dep.fractions.anchor)
    return after >= dep.costs.stream_min_share * dep.forward.seconds(tokens)


def _encode_s(dep: Deployment, variant: Variant, tokens: int) -> float:
    if not variant.lynx:
        return 0.0
    per = (dep.costs.encode_exact_s_per_byte if variant.target == "exact"
           else dep.costs.encode_int8_s_per_byte)
    return per * tokens * dep.shape.kv_bytes_per_token


def _apply_s(dep: Deployment, variant: Variant, tokens: int) -> float:
    if not variant.lynx or not variant.residual:
        return 0.0
    per = (dep.costs.apply_exact_s_per_byte if variant.target == "exact"
           else dep.costs.apply_int8_s_per_byte)
    return per * tokens * dep.shape.kv_bytes_per_token


def one_request_ttft(dep: Deployment, variant: Variant, tokens: int) -> float:
    """TTFT of a request alone (no queue anywhere): the formula the model reduces to at zero load.
    mooncake F + W + fixed; Lynx streamed max(F, W_gating), after the forward F + encode +
    W_gating; W_gating the Anchor's for a speculative variant (or Anchor + Residual where the
    Residual comes sooner than a verification), all its bytes otherwise."""
    f = dep.forward.seconds(tokens)
    first, second = variant.stream_fractions(dep.fractions)
    w_first, w_all = dep.wire_s(tokens, first), dep.wire_s(tokens, first + second)
    if not variant.lynx:
        return f + w_all + dep.costs.fixed_s
    if _streams(dep, variant, tokens):
        anchor, everything = max(f, w_first), max(f, w_all)
    else:
        start = f + _encode_s(dep, variant, tokens)
        anchor, everything = start + w_first, start + w_all
    everything += _apply_s(dep, variant, tokens)
    step = dep.decode.base_s
    if not variant.speculative or everything - anchor <= _verify_s(dep, step, 1):
        return everything + dep.costs.fixed_s
    return anchor + dep.costs.fixed_s


def _verify_s(dep: Deployment, step: float, positions: int) -> float:
    return dep.costs.verify_in_steps(positions) * step


# --- the simulation ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    t: float
    prefill: int
    tokens: int
    outputs: int


@dataclass
class DecodeClock:
    """How far the decode's steps had got by each moment of a simulation with shared processors
    (`tools.plan.shared_cpu`): work (seconds of steps at full speed) against time, piecewise
    linear. Where nothing slows the decode, work = time and `RequestResult.clock` is None."""

    times: list[float] = field(default_factory=lambda: [0.0])
    work: list[float] = field(default_factory=lambda: [0.0])

    def advance(self, t: float, rate: float) -> None:
        self.work.append(self.work[-1] + rate * (t - self.times[-1]))
        self.times.append(t)

    def _work_at(self, t: float) -> float:
        if t >= self.times[-1]:
            return self.work[-1] + t - self.times[-1]
        i = max(1, bisect.bisect_right(self.times, t))
        (t0, t1), (w0, w1) = self.times[i - 1:i + 1], self.work[i - 1:i + 1]
        return w0 + (w1 - w0) * (t - t0) / (t1 - t0)

    def after(self, t: float, work: float) -> float:
        """When `work` seconds of steps started at t are done (at full speed past the end)."""
        target = self._work_at(t) + work
        if target >= self.work[-1]:
            return self.times[-1] + target - self.work[-1]
        i = max(1, bisect.bisect_left(self.work, target))
        (t0, t1), (w0, w1) = self.times[i - 1:i + 1], self.work[i - 1:i + 1]
        return t1 if w1 == w0 else t0 + (t1 - t0) * (target - w0) / (w1 - w0)


@dataclass(frozen=True)
class RequestResult:
    """One simulated request, times from its arrival (its send)."""

    tokens: int
    outputs: int
    prefill_wait_s: float
    ttft_s: float
    speculated: int  # tokens decoded on the Anchor before verification (0: none)
    release_s: float | None  # when a verification released them (from the send)
    accepted: int
    step_s: float
    clock: DecodeClock | None = None  # the decode's progress, where shared processors slow it
    sent: float = 0.0  # the send, on the clock's time base

    def _steps_after(self, since_s: float, steps: int) -> float:
        if self.clock is None:
            return since_s + steps * self.step_s
        return self.clock.after(self.sent + since_s, steps * self.step_s) - self.sent

    def token_s(self, k: int) -> float:
        """When token k (1 = the first) reaches the client."""
        if k <= 1:
            return self.ttft_s
        if self.release_s is None:
            return self._steps_after(self.ttft_s, k - 1)
        released = min(self.outputs, self.accepted + 2)  # the kept drafts and the exact one after
        if k <= released:
            return self.release_s
        return self._steps_after(self.release_s, k - released)

    @property
    def last_s(self) -> float:
        return self.token_s(self.outputs)

    @property
    def tpot_s(self) -> float | None:
        """As sglang.bench_serving: (last token − first) / (outputs − 1)."""
        if self.outputs < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.outputs - 1)


def poisson_arrivals(dep: Deployment, n: int, rng: random.Random) -> list[Arrival]:
    """n requests in all, Poisson at dep.rate into each prefill, lengths drawn from the pools."""
    out = []
    per = math.ceil(n / dep.prefills_per_decode)
    for p in range(dep.prefills_per_decode):
        t = 0.0
        for _ in range(per):
            t += rng.expovariate(dep.rate) if dep.rate > 0 else 1e9
            out.append(Arrival(t, p, rng.choice(dep.prompts), rng.choice(dep.outputs)))
    out.sort(key=lambda a: a.t)
    return out[:n]


@dataclass
class _Job:
    release: float
    priority: int  # 0 Anchor / BF16 KV, 1 Residual
    seq: int
    seconds: float
    floor: float  # a layer-streamed stream cannot land before its forward ends
    done: float = math.nan


def _serve_link(jobs: list[_Job]) -> None:
    """One link, preemptive-resume priority (lower first), FIFO within a priority."""
    order = sorted(jobs, key=lambda j: (j.release, j.priority, j.seq))
    heap: list[tuple[int, float, int, list]] = []
    t, i = 0.0, 0
    while i < len(order) or heap:
        if not heap:
            t = max(t, order[i].release)
        while i < len(order) and order[i].release <= t:
            j = order[i]
            heapq.heappush(heap, (j.priority, j.release, j.seq, [j.seconds, j]))
            i += 1
        _, _, _, entry = heap[0]
        left, job = entry
        nxt = order[i].release if i < len(order) else math.inf
        if t + left <= nxt:
            heapq.heappop(heap)
            t += left
            job.done = max(t, job.floor)
        else:
            entry[0] = left - (nxt - t)
            t = nxt


def simulate_dedicated(dep: Deployment, variant: Variant, arrivals: list[Arrival],
                       rng: random.Random) -> list[RequestResult]:
    """Every request of `arrivals` through its prefill (FIFO), the shared link and the decode,
    each server on processors of its own (`dep.cpu` is not read: `predict.simulate` picks
    `tools.plan.shared_cpu` where it is set)."""
    step = decode_step_s(dep)
    free = [0.0] * dep.prefills_per_decode
    starts, ends = [], []
    for a in arrivals:
        start = max(a.t, free[a.prefill])
        free[a.prefill] = start + dep.forward.seconds(a.tokens)
        starts.append(start)
        ends.append(free[a.prefill])
    first_f, second_f = variant.stream_fractions(dep.fractions)
    jobs: list[tuple[_Job, _Job | None]] = []
    for n, (a, start, end) in enumerate(zip(arrivals, starts, ends, strict=True)):
        if _streams(dep, variant, a.tokens):
            release, floor = start, end
        else:
            release, floor = end + _encode_s(dep, variant, a.tokens), 0.0
        first = _Job(release, 0, n, dep.wire_s(a.tokens, first_f), floor)
        second = (_Job(release, 1, n, dep.wire_s(a.tokens, second_f), floor)
                  if second_f > 0 else None)
        jobs.append((first, second))
    _serve_link([j for pair in jobs for j in pair if j is not None])
    out = []
    for a, start, (first, second) in zip(arrivals, starts, jobs, strict=True):
        ready_all = (second.done if second else first.done) + _apply_s(dep, variant, a.tokens)
        fixed = dep.costs.fixed_s
        speculates = (variant.speculative
                      and ready_all - first.done > _verify_s(dep, step, 1))
        if not speculates:
            out.append(RequestResult(a.tokens, a.outputs, start - a.t, ready_all + fixed - a.t,
                                     0, None, 0, step))
            continue
        # Drafts decoded on the Anchor while the Residual crosses, up to the cap; the
        # verification forward starts when the Residual is applied and releases the kept ones.
        drafts = min(dep.costs.spec_cap, a.outputs - 1, int((ready_all - first.done) // step))
        release = ready_all + _verify_s(dep, step, drafts + 1) + fixed
        accepted = drafts if rng.random() < dep.costs.spec_hold_share else min(
            drafts, int(rng.expovariate(1 / dep.costs.spec_break_mean)))
        out.append(RequestResult(a.tokens, a.outputs, start - a.t, first.done + fixed - a.t, drafts,
                                 release - a.t, accepted, step))
    return out


# --- predictions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float | None = None
    target: float = 0.9  # the share of requests within it that "meets the SLO"

    def met(self, r: RequestResult) -> bool:
        tpot = r.tpot_s
        return r.ttft_s <= self.ttft_s and (self.tpot_s is None or tpot is None
                                            or tpot <= self.tpot_s)


@dataclass(frozen=True)
class VariantPrediction:
    variant: str
    stable: bool
    reason: str | None = None  # why there are no figures
    link_utilisation: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    ttft_mean_pk_s: float | None = None  # analytic mean (P-K waits + the no-queue TTFT)
    tpot_median_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p99_s: float | None = None
    speculated_share: float | None = None
    slo_attainment: float | None = None
    goodput_rps: float | None = None  # requests per second per decode meeting the SLO
    max_rate_meeting_slo: float | None = None  # per prefill, req/s


@dataclass(frozen=True)
class Prediction:
    prefill_utilisation: float
    decode_step_s: float
    variants: list[VariantPrediction]
