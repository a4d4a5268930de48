"""Buffers from Python: NumPy arrays and other buffer-protocol objects written
and read back byte for byte in each of the three tiers (VRAM, shared, disk)."""
import os
import random

import numpy as np
import pytest

import sgm

MiB = 1 << 20


@pytest.fixture
def rng():
    seed = int(os.environ.get("SGM_TEST_SEED", "20261201"))
    print(f"seed {seed} (SGM_TEST_SEED)")
    return np.random.default_rng(seed)


def test_numpy_round_trip_through_every_tier(ctx, rng):
    """Invariant: the bytes written come back unchanged while the buffer moves
    VRAM -> shared -> disk -> VRAM (acquire), read in every tier."""
    a = rng.standard_normal((256, 512)).astype(np.float32)  # 512 KiB
    b = ctx.buffer(a)
    assert b.size == a.nbytes and len(b) == a.nbytes
    assert b.tier is sgm.Tier.VRAM
    np.testing.assert_array_equal(b.numpy(np.float32, a.shape), a)
    b.evict("shared")
    assert b.tier is sgm.Tier.SHARED
    np.testing.assert_array_equal(b.numpy(np.float32, a.shape), a)
    b.evict(sgm.Tier.DISK)
    assert b.tier is sgm.Tier.DISK
    assert ctx.stats()["tiers"]["disk"]["used_bytes"] >= a.nbytes
    np.testing.assert_array_equal(b.numpy(np.float32, a.shape), a)
    with b.acquired() as dptr:
        assert dptr and b.tier is sgm.Tier.VRAM
    out = np.empty_like(a)
    assert b.readinto(out) == a.nbytes
    np.testing.assert_array_equal(out, a)
    b.close()
    assert ctx.stats()["tiers"]["vram"]["n_live"] == 0


def test_oversubscribed_buffers_use_all_three_tiers(ctx, rng):
    """Invariant: 24 MiB of buffers over 8 MiB VRAM + 8 MiB shared spread over
    all three tiers, and every one reads back what was written."""
    data = [rng.integers(0, 1 << 32, size=MiB // 4, dtype=np.uint32) for _ in range(24)]
    bufs = [ctx.buffer(d) for d in data]
    tiers = {b.tier for b in bufs}
    assert tiers == {sgm.Tier.VRAM, sgm.Tier.SHARED, sgm.Tier.DISK}
    for d, b in zip(data, bufs):
        np.testing.assert_array_equal(b.numpy(np.uint32), d)
    st = ctx.stats()
    assert sum(st["tiers"][t]["n_live"] for t in ("vram", "shared", "disk")) == 24


def test_bytes_bytearray_memoryview_and_offsets(ctx):
    b = ctx.buffer(4096)
    assert b.write(b"hello", 0) == 5
    assert b.write(bytearray(b"world"), 100) == 5
    assert b.write(memoryview(b"--sgm--")[2:5], 200) == 3
    assert b.read(5) == b"hello"
    assert b.read(5, offset=100) == b"world"
    assert b.read(3, offset=200) == b"sgm"
    assert len(b.read()) == 4096 and len(b.read(offset=4000)) == 96
    ro = np.frombuffer(b"12345678", dtype=np.uint8)  # a read-only NumPy array
    b.write(ro, 300)
    assert b.read(8, 300) == b"12345678"


def test_out_of_bounds_and_bad_arguments_carry_sgms_message(ctx):
    b = ctx.buffer(4096)
    with pytest.raises(sgm.InvalidError) as e:
        b.write(b"x" * 10, 4090)
    assert e.value.message and e.value.call == "sgm_buffer_write"
    with pytest.raises(sgm.InvalidError):
        b.readinto(b"read-only")                       # not writable
    with pytest.raises(sgm.InvalidError):
        b.write(np.zeros((8, 8))[:, ::2])              # not contiguous
    with pytest.raises(sgm.InvalidError):
        b.evict("vram")                                # sgm refuses: evict goes down
    with pytest.raises(sgm.InvalidError):
        b.evict("floppy")
    with pytest.raises(sgm.InvalidError):
        b.set_priority(9)
    with pytest.raises(sgm.InvalidError):
        ctx.buffer(0)


def test_acquired_buffer_is_busy(ctx):
    """Invariant: an acquired buffer cannot be acquired again or evicted
    (BusyError, sgm's message), and moves again once released."""
    b = ctx.buffer(64 * 1024)
    b.acquire()
    with pytest.raises(sgm.BusyError) as e:
        b.acquire()
    assert e.value.status == -6 and e.value.message
    with pytest.raises(sgm.BusyError):
        b.evict("shared")
    b.release()
    b.evict("shared")
    assert b.tier is sgm.Tier.SHARED
    with pytest.raises(sgm.InvalidError):
        b.release()                                     # not acquired


def test_prefetch_and_priority(ctx):
    """Invariant: a prefetched buffer is in VRAM once acquired, and the move
    into VRAM is counted; priorities take names and numbers."""
    b = ctx.buffer(b"\x01" * (256 * 1024))
    b.set_priority("high")
    b.set_priority(sgm.Priority.LOW)
    b.evict("disk")
    before = ctx.stats()["tiers"]["vram"]["bytes_in"]
    b.prefetch()
    with b.acquired():
        assert b.tier is sgm.Tier.VRAM
    assert ctx.stats()["tiers"]["vram"]["bytes_in"] >= before + 256 * 1024
    assert b.read(4) == b"\x01" * 4


def test_buffers_from_several_threads(ctx):
    """Invariant: one buffer per thread, many threads: all data intact."""
    import threading
    errors = []

    def work(i):
        try:
            r = random.Random(i)
            payload = bytes(r.getrandbits(8) for _ in range(64 * 1024))
            with ctx.buffer(payload) as b:
                b.evict("shared")
                if b.read() != payload:
                    errors.append(f"thread {i}: data changed")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {i}: {e!r}")
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
