"""The exact Residual's Triton section coder (lynx_kernels.exact_triton) against the torch
reference (lynx_kernels.exact): the same sections byte for byte, the same values back, and for
tampered sections the same verdict (the same values, or a CodecError with the same message).

The inputs are what the wire layer really hands the coder: `exact.encode_sections` is spied on
while a run's Residual is cut into chunks. On this CPU the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), so runs stay small; on a CUDA machine
they compile (scripts/gpu_check.py runs the same comparison at Llama shapes).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from kernel_cases import DTYPES, adversarial

from lynx_kernels import CodecError, CodecSpec, encode, exact, to_chunks

pytest.importorskip("triton", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

from lynx_kernels import exact_triton  # noqa: E402  (after the interpreter check)


def coder_inputs(x: torch.Tensor, spec: CodecSpec, kind: str, chunk_tokens: int, monkeypatch):
    """The (zz, cls, x_bits, counts, coding) the wire layer passes to the section coder for the
    Residual of `x`'s run, cut every `chunk_tokens` tokens."""
    seen = []
    reference = exact.encode_sections

    def spy(*args):
        seen.append(args)
        return reference(*args)

    with monkeypatch.context() as patch:
        patch.setattr(exact, "encode_sections", spy)
        to_chunks(encode(x, spec, kind, impl="torch"), chunk_tokens, stream="residual")
    (args,) = seen
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def mixed_adversarial(dtype: torch.dtype, tokens: int) -> torch.Tensor:
    """`tokens` rows taken in turn from each of kernel_cases' adversarial inputs."""
    cases = list(adversarial(dtype, tokens, 2, 64).values())
    return torch.stack([cases[t % len(cases)][t] for t in range(tokens)])


def same_sections(a: list[exact.Section], b: list[exact.Section]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(pa.cpu(), pb.cpu()) for sa, sb in zip(a, b, strict=True) for pa, pb in
        zip(sa.parts(), sb.parts(), strict=True))


# Each dtype once and each layout once (the interpreter takes ~2 s a case).
@pytest.mark.parametrize(("dtype", "kind", "k_grouping", "rotate"), [
    (torch.bfloat16, "k", "channel", True), (torch.float16, "k", "token", False),
    (torch.float32, "v", "channel", True)])
def test_sections_and_values_match_the_reference(dtype, kind, k_grouping, rotate, monkeypatch):
    x = (torch.randn(150, 2, 64, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    spec = CodecSpec(target="exact", k_grouping=k_grouping, rotate=rotate, group_size=32,
                     sink_tokens=3, recent_tokens=9)
    zz, cls, x_bits, counts, coding = coder_inputs(x, spec, kind, 64, monkeypatch)
    assert len(counts) == 3 and counts[-1] % exact.BLOCK  # a partial last block in each chunk
    ref = exact.encode_sections(zz, cls, x_bits, counts, coding)
    tri = exact_triton.encode_sections(zz, cls, x_bits, counts, coding)
    assert same_sections(tri, ref)
    r_bits = exact.from_ordinal(exact.ordinal(x_bits, coding) - exact.unzigzag(zz), coding)
    assert torch.equal(exact_triton.decode_sections(tri, cls, r_bits, counts, coding), x_bits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_escapes_and_special_values_match(dtype, monkeypatch):
    """Adversarial values (infinities, subnormals, signed zeros, huge outliers): escapes and
    wide corrections in every block."""
    x = mixed_adversarial(dtype, 130)
    spec = CodecSpec(target="exact", group_size=32, sink_tokens=0, recent_tokens=0)
    zz, cls, x_bits, counts, coding = coder_inputs(x, spec, "k", 128, monkeypatch)
    ref = exact.encode_sections(zz, cls, x_bits, counts, coding)
    k_nib = exact.k_nibbles(ref)
    chunk_of = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    k = k_nib[chunk_of.to(zz.device), cls] + coding.k_base
    assert bool(((zz >> k) >= exact.ESCAPE_Q).any()), "no escaped value: E is not exercised"
    tri = exact_triton.encode_sections(zz, cls, x_bits, counts, coding)
    assert same_sections(tri, ref)
    r_bits = exact.from_ordinal(exact.ordinal(x_bits, coding) - exact.unzigzag(zz), coding)
    assert torch.equal(exact_triton.decode_sections(tri, cls, r_bits, counts, coding), x_bits)


def test_empty_chunks_and_single_values():
    coding = exact.CODINGS[torch.bfloat16]
    zz = torch.tensor([5], dtype=torch.int64, device=DEVICE)
    cls = torch.tensor([9], dtype=torch.int64, device=DEVICE)
    x_bits = torch.tensor([0x3F80], dtype=torch.int64, device=DEVICE)
    for counts in ([0, 1], [1, 0], [1]):
        ref = exact.encode_sections(zz, cls, x_bits, counts, coding)
        assert same_sections(exact_triton.encode_sections(zz, cls, x_bits, counts, coding), ref)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert exact_triton.decode_sections([], none, none, [], coding).numel() == 0


def _verdict(decoder, sections, cls, r_bits, counts, coding):
    try:
        return decoder(sections, cls, r_bits, counts, coding).cpu()
    except CodecError as exc:
        # "past the records" (no zero bit left anywhere) is the reference's name for a code the
        # Triton decoder, which reads one record only, finds running past its record.
        return str(exc).replace(exact.CORRUPTIONS[1], exact.CORRUPTIONS[2])


def test_tampered_sections_get_the_reference_verdict(monkeypatch):
    """Flipped bits in the records and k tables, and record lengths moved between neighbours
    (their sum kept, as the wire layer checks it): both decoders return the same values or raise
    the same message."""
    x = mixed_adversarial(torch.bfloat16, 40)
    spec = CodecSpec(target="exact", group_size=32, sink_tokens=0, recent_tokens=0)
    zz, cls, x_bits, counts, coding = coder_inputs(x, spec, "v", 20, monkeypatch)
    r_bits = exact.from_ordinal(exact.ordinal(x_bits, coding) - exact.unzigzag(zz), coding)
    good = exact.encode_sections(zz, cls, x_bits, counts, coding)
    rng = random.Random(7)
    verdicts = set()
    for case in range(24):
        sections = [exact.Section(*(p.clone() for p in s.parts())) for s in good]
        s = sections[case % len(sections)]
        if case % 3 == 0:
            s.k_table[rng.randrange(len(s.k_table))] ^= 1 << rng.randrange(8)
        elif case % 3 == 1:
            for _ in range(1 + case % 4):
                s.records[rng.randrange(len(s.records))] ^= 1 << rng.randrange(8)
        else:
            lengths = s.rec_len.view(torch.int16)
            b = rng.randrange(len(lengths) - 1)
            delta = rng.choice((-3, -1, 1, 2))
            lengths[b] += delta
            lengths[b + 1] -= delta
        ref = _verdict(exact.decode_sections, sections, cls, r_bits, counts, coding)
        tri = _verdict(exact_triton.decode_sections, sections, cls, r_bits, counts, coding)
        if isinstance(ref, str):
            assert tri == ref, case
            verdicts.add(ref)
        else:
            assert isinstance(tri, torch.Tensor) and torch.equal(tri, ref), case
    assert len(verdicts) >= 3, f"the tampering found too few kinds of fault: {verdicts}"


def test_a_set_padding_bit_gets_the_reference_verdict(monkeypatch):
    """The top bit of each record's last byte: padding in most records (refused), the E or U
    area's last bit in others; both decoders agree on every one."""
    x = mixed_adversarial(torch.bfloat16, 40)
    spec = CodecSpec(target="exact", group_size=32, sink_tokens=0, recent_tokens=0)
    zz, cls, x_bits, counts, coding = coder_inputs(x, spec, "v", 40, monkeypatch)
    r_bits = exact.from_ordinal(exact.ordinal(x_bits, coding) - exact.unzigzag(zz), coding)
    (good,) = exact.encode_sections(zz, cls, x_bits, counts, coding)
    ends = torch.cumsum(exact.record_lengths([good]), 0).tolist()
    verdicts = []
    for end in ends[:6]:
        records = good.records.clone()
        records[end - 1] ^= 0x80
        tampered = [exact.Section(good.k_table, good.rec_len, records)]
        ref = _verdict(exact.decode_sections, tampered, cls, r_bits, counts, coding)
        tri = _verdict(exact_triton.decode_sections, tampered, cls, r_bits, counts, coding)
        assert (tri == ref) if isinstance(ref, str) else torch.equal(tri, ref)
        verdicts.append(ref if isinstance(ref, str) else "decoded")
    assert any(exact.CORRUPTIONS[6] in v for v in verdicts), verdicts
