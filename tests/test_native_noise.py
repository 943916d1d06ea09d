"""The native noise generator (``native_noise``, ``aes_normal.cpp``): AES-128 against the standard's known
answers and an independent implementation, the Gaussian transform against float64 Box-Muller on the same words,
the stream's independence of the thread count, statistical and limit-case tests, and its use by the DP step."""

from __future__ import annotations

import math
import platform

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from reference import check_gaussian

from compiled_psg._train import dp, native_noise

RUNS_HERE = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2", "AVX512")


def test_it_runs_on_this_machine_or_says_why_not():
    """On an x86-64 CPU with AVX2 (CI's machines), the library builds; elsewhere ``failure()`` names the reason
    and the DP step keeps torch's generators."""
    if RUNS_HERE:
        assert native_noise.available(), native_noise.failure()
        assert native_noise.failure() is None
    else:
        assert not native_noise.available() and native_noise.failure()


needs_native = pytest.mark.skipif(not RUNS_HERE, reason="the native generator needs x86-64 with AVX2")


@needs_native
@pytest.mark.parametrize("key, plaintext, ciphertext", [
    # FIPS-197, appendix C.1 (AES-128)
    ("000102030405060708090a0b0c0d0e0f", "00112233445566778899aabbccddeeff", "69c4e0d86a7b0430d8cdb78070b4c55a"),
    # NIST SP 800-38A, F.5.1 (CTR-AES128): Output Block #1, the keystream of the first counter block
    ("2b7e151628aed2a6abf7158809cf4f3c", "f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff", "ec8cdf7398607cb0f2d21675ea9ea1e4"),
])
def test_aes_matches_the_standards_known_answers(key, plaintext, ciphertext):
    assert native_noise.encrypt_block(bytes.fromhex(key), bytes.fromhex(plaintext)).hex() == ciphertext


def _reference_words(key: tuple[int, int], groups: int, first_group: int) -> torch.Tensor:
    """The keystream by the ``cryptography`` package's AES: block j is AES_key(j as 16 little-endian bytes), 12
    blocks per group."""
    aes = Cipher(algorithms.AES(key[0].to_bytes(8, "little") + key[1].to_bytes(8, "little")), modes.ECB())
    blocks = b"".join(j.to_bytes(16, "little") for j in range(12 * first_group, 12 * (first_group + groups)))
    stream = aes.encryptor().update(blocks)
    return torch.from_numpy(np.frombuffer(stream, dtype="<u4").astype(np.int64))


@needs_native
@pytest.mark.parametrize("first_group", [0, 3, 2 ** 40 + 5])  # the last: counters past 32 bits
def test_the_keystream_is_aes_in_counter_mode(first_group):
    generator = torch.Generator().manual_seed(11)
    for key in [native_noise.draw_key(generator), native_noise.draw_key(None, secure=True)]:
        got = native_noise.keystream_words(key, 4, first_group)
        assert torch.equal(got, _reference_words(key, 4, first_group))


def _box_muller_float64(words: torch.Tensor, first: int, n: int, std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented transform of the stream (aes_normal.cpp's header) in float64, for the numbers
    ``[first, first + n)`` from the words of their groups (``words`` starts at the first one's group): the
    numbers and their radii."""
    e = torch.arange(first, first + n)
    group, pair, half, lane = e // 32 - first // 32, (e % 32) // 16, (e % 16) // 8, e % 8
    at = 48 * group + 24 * pair + lane
    lo, hi, b = words[at].double(), words[at + 8].double(), words[at + 16].double()
    u1 = ((hi * 2.0 ** 32 + lo + 1) / 2.0 ** 64).float().double()  # rounded to float32, as documented
    u2 = torch.floor(b / 256) / 2 ** 24
    radius = std * torch.sqrt(-2 * torch.log(u1))
    angle = 2 * math.pi * u2
    return torch.where(half == 0, radius * torch.cos(angle), radius * torch.sin(angle)), radius


def _one_step_of_u1(radius: torch.Tensor, std: float) -> torch.Tensor:
    """How much the radius moves when u1 moves by one float32 step (the kernel rounds u1 in three FMAs, the
    reference once): large only for radii near 0, where u1 is near 1."""
    u1 = torch.exp(-((radius / std) ** 2) / 2).float()
    up = torch.nextafter(u1, torch.tensor(0.0)).double()
    return std * (torch.sqrt(-2 * torch.log(up)) - torch.sqrt(-2 * torch.log(u1.double()))).abs()


@needs_native
@pytest.mark.parametrize("first, n", [(0, 1), (0, 31), (0, 32), (0, 33), (0, 1000), (0, 300_007), (5, 40),
                                      (37, 1), (31, 2), (64, 64), (2 ** 40 + 3, 100)])
def test_the_numbers_are_box_muller_of_the_stream(first, n):
    """The float32 polynomials (log, and the sine and cosine of a turn) agree with float64 Box-Muller on the
    same words to 3e-7 of the radius (and one float32 step of u1), for slices that start and end inside a group
    of 32; nothing outside the slice is written."""
    key = (0x0123456789ABCDEF, 0x7EDCBA9876543210)
    buffer = torch.full((n + 16,), 1e30)
    got = native_noise.normal_(buffer[8:8 + n], 1.7, key, first).double()
    assert (buffer[:8] == 1e30).all() and (buffer[8 + n:] == 1e30).all()
    groups = (first + n + 31) // 32 - first // 32
    want, radius = _box_muller_float64(native_noise.keystream_words(key, groups, first // 32), first, n, 1.7)
    assert ((got - want).abs() <= 3e-7 * radius + _one_step_of_u1(radius, 1.7) + 1e-12).all()
    whole = native_noise.normal_(torch.empty(first % 32 + n), 1.7, key, first - first % 32)
    assert torch.equal(whole[first % 32:], got.float())


@needs_native
@pytest.mark.parametrize("first, n", [(0, 100_003), (7, 1000), (2 ** 33 + 1, 77)])
def test_vaes_and_aes_ni_give_the_same_numbers(first, n):
    """On a CPU with VAES (this machine, and CI's) the keystream takes two blocks per instruction; the numbers are
    AES-NI's. Without VAES the default path is AES-NI's too (the first assertion)."""
    key = native_noise.draw_key(torch.Generator().manual_seed(6))
    wide, narrow = torch.empty(n), torch.empty(n)
    assert native_noise.fill(wide, 1.0, key, first) == native_noise.has_vaes()
    assert native_noise.fill(narrow, 1.0, key, first, wide_aes=False) is False
    assert torch.equal(wide, narrow)


@needs_native
def test_the_numbers_do_not_depend_on_the_thread_count():
    key = native_noise.draw_key(torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        drawn = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            drawn.append(native_noise.normal_(torch.empty(500_003), 1.0, key))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(drawn[0], drawn[1]) and torch.equal(drawn[0], drawn[2])


@needs_native
def test_the_stream_is_gaussian_independent_and_bounded():
    """Over 2^21 numbers of one seeded key (deterministic, so the thresholds cannot flake): N(0, std^2) by the
    chi-square and KS tests; the two numbers of one Box-Muller pair, neighbours and the same positions under
    another key uncorrelated, also in their squares (Box-Muller's pairs are independent, not just
    uncorrelated); the fraction beyond 3 std and beyond 4.5 std as the normal law says; and nothing beyond
    sqrt(2 log 2^64) std, the largest radius of the 64-bit uniform."""
    std, n = 2.5, 1 << 21
    generator = torch.Generator().manual_seed(5)
    z = native_noise.normal_(torch.empty(n), std, native_noise.draw_key(generator)).double()
    other = native_noise.normal_(torch.empty(n), std, native_noise.draw_key(generator)).double()
    check_gaussian(z, std, p_min=1e-3)
    check_gaussian(other, std, p_min=1e-3)
    groups = (z / std).view(-1, 2, 2, 8)  # [group, pair, cos/sin half, lane]
    bound = 6 / math.sqrt(n // 2)
    for a, b in [(groups[:, :, 0], groups[:, :, 1]), (z[:-1] / std, z[1:] / std), (z / std, other / std)]:
        a, b = a.flatten(), b.flatten()
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < bound
        assert abs(torch.corrcoef(torch.stack([a * a, b * b]))[0, 1]) < bound
    for k in (3.0, 4.5):
        beyond = (z.abs() > k * std).double().mean().item()
        p = math.erfc(k / math.sqrt(2))
        assert abs(beyond - p) < 6 * math.sqrt(p * (1 - p) / n), (k, beyond, p)
    assert z.abs().max() <= std * math.sqrt(2 * math.log(2 ** 64)) * (1 + 1e-6)
    assert not torch.equal(z, other)


@needs_native
def test_a_dp_draw_is_the_native_stream_keyed_from_the_generator():
    """``dp.gaussian_many`` fills float32 CPU noise from the stream of a key drawn from the generator: the same
    numbers as ``normal_`` under that key, a resumed generator state replays them, and float64 noise keeps
    torch's generators."""
    likes = [torch.zeros(30, 70), torch.zeros(70), torch.zeros(5)]
    generator = torch.Generator().manual_seed(9)
    state = generator.get_state()
    key = native_noise.draw_key(torch.Generator().manual_seed(9))
    got = dp.gaussian_many(likes, 0.8, generator=generator)
    want = native_noise.normal_(torch.empty(sum(t.numel() for t in likes)), 0.8, key)
    assert torch.equal(torch.cat([t.flatten() for t in got]), want)
    assert [t.shape for t in got] == [t.shape for t in likes]
    generator.set_state(state)
    assert torch.equal(dp.gaussian_many(likes, 0.8, generator=generator)[0], got[0])
    doubles = dp.gaussian_many([t.double() for t in likes], 0.8, generator=torch.Generator().manual_seed(9))
    assert doubles[0].dtype == torch.float64
    assert torch.equal(doubles[0], torch.randn(30, 70, dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(9)).mul_(0.8))


@needs_native
def test_normal_refuses_a_tensor_or_a_slice_it_cannot_fill():
    for bad in (torch.empty(8, dtype=torch.float64), torch.empty(4, 4).t()):
        with pytest.raises(ValueError, match="contiguous CPU float32"):
            native_noise.normal_(bad, 1.0, (1, 2))
    for first in (-1, 2 ** 64 - 50):
        with pytest.raises(ValueError, match="not in"):
            native_noise.normal_(torch.empty(100), 1.0, (1, 2), first)


@needs_native
def test_the_stream_draws_its_key_when_called_and_ignores_torchs_defaults():
    """``gaussian_stream`` takes its key from the generator when it is called (as ``gaussian_many`` does), and
    its buffers are CPU float32 whatever torch's default dtype (the sharded step's rank 0 under
    ``set_default_dtype(float64)`` with float32 parameters)."""
    likes = [torch.zeros(3, 4), torch.zeros(0), torch.zeros(5)]
    many_gen, stream_gen = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    many = dp.gaussian_many(likes, 1.0, generator=many_gen)
    stream = dp.gaussian_stream(likes, 1.0, generator=stream_gen)
    assert torch.equal(stream_gen.get_state(), many_gen.get_state())
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        streamed = list(stream)
        again = dp.gaussian_many(likes, 1.0, generator=torch.Generator().manual_seed(2))
    finally:
        torch.set_default_dtype(default)
    for a, b, c in zip(many, streamed, again, strict=True):
        assert a.dtype == b.dtype == c.dtype == torch.float32 and torch.equal(a, b) and torch.equal(a, c)


@needs_native
@pytest.mark.parametrize("hi, lo, radius", [
    (0, 0, math.sqrt(2 * math.log(2.0 ** 64))),  # u1 = 2^-64: 9.42 std, where a 24-bit uniform stops at 5.77
    (0, 2 ** 32 - 1, math.sqrt(2 * math.log(2.0 ** 32))),  # u1 = 2^-32
    (2 ** 31, 0, math.sqrt(2 * math.log(2.0))),  # u1 = 1/2 (+ 2^-64)
    (2 ** 32 - 1, 2 ** 32 - 1, 0.0),  # u1 = 1
])
def test_the_transforms_limit_cases(hi, lo, radius):
    """The kernel's transform on crafted words: the radius at the ends of u1's range, and the angle's four
    quarter turns (u2 = 0, 1/4, 1/2, 3/4 give (cos, sin) = (1, 0), (0, 1), (-1, 0), (0, -1))."""
    words = torch.zeros(48, dtype=torch.int64)
    words[0:8], words[8:16] = lo, hi  # pair 0: lo, hi, angle words of its eight lanes
    words[16:24] = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]) << 30
    out = native_noise.box_muller_words(words, 2.0).double()
    cos, sin = out[0:8], out[8:16]
    want_cos = torch.tensor([1.0, 0, -1, 0, 1, 0, -1, 0], dtype=torch.float64) * 2 * radius
    want_sin = torch.tensor([0.0, 1, 0, -1, 0, 1, 0, -1], dtype=torch.float64) * 2 * radius
    torch.testing.assert_close(cos, want_cos, rtol=3e-7, atol=1e-6 * radius + 1e-30)
    torch.testing.assert_close(sin, want_sin, rtol=3e-7, atol=1e-6 * radius + 1e-30)


@needs_native
def test_a_secure_draw_is_keyed_from_os_urandom(monkeypatch):
    """With ``secure``, the key is 16 bytes of ``os.urandom`` and the generator is not read."""
    monkeypatch.setattr("os.urandom", lambda n: bytes(range(n)))
    key = native_noise.draw_key(None, secure=True)
    assert key == (int.from_bytes(bytes(range(8)), "little"), int.from_bytes(bytes(range(8, 16)), "little"))
    generator = torch.Generator().manual_seed(4)
    state = generator.get_state()
    got = dp.gaussian_many([torch.zeros(100)], 1.0, secure=True, generator=generator)[0]
    assert torch.equal(generator.get_state(), state)
    assert torch.equal(got, native_noise.normal_(torch.empty(100), 1.0, key))


def test_a_failed_build_falls_back_to_torchs_generator_and_says_why(monkeypatch, caplog):
    """A build that fails (no compiler, say) leaves ``available()`` False with the reason, logged once, and the
    noise comes from torch's generator tensor by tensor."""
    monkeypatch.setattr(native_noise, "_library", None)
    monkeypatch.setattr(native_noise, "_failure", None)
    monkeypatch.setattr(native_noise.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native_noise.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")

    def no_compiler():
        raise FileNotFoundError("g++ not found")

    monkeypatch.setattr(native_noise, "_build", no_compiler)
    with caplog.at_level("WARNING", logger="compiled_psg"):
        assert not native_noise.available() and not native_noise.available()
    assert native_noise.failure() == "FileNotFoundError: g++ not found"
    assert sum("could not be built" in r.message for r in caplog.records) == 1
    got = dp.gaussian_many([torch.zeros(3, 5), torch.zeros(4)], 2.0, generator=torch.Generator().manual_seed(1))
    want = torch.Generator().manual_seed(1)
    assert torch.equal(got[0], torch.randn(3, 5, generator=want).mul_(2.0))
    assert torch.equal(got[1], torch.randn(4, generator=want).mul_(2.0))
