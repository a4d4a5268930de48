"""The Python layer against a careless or malicious caller (issue 29): every
integer crossing into C is range-checked (ctypes wraps them modulo 2**64),
close() is safe against other threads' calls, and bad arguments raise
sgm.Error subclasses naming what was wrong."""
import threading

import pytest

import sgm

BIG = [2**64, 2**64 + 16, 2**65, -1, -(2**63)]


@pytest.mark.parametrize("size", BIG)
def test_alloc_size_out_of_range_is_refused_by_name(ctx, size):
    """alloc(2**64 + 16) used to return a 16-byte block; alloc(-1) said
    '18446744073709551615 bytes overflows'."""
    with pytest.raises(sgm.InvalidError, match=r"size = -?\d+ is out of range"):
        ctx.alloc(size)
    assert ctx.stats()["tiers"]["vram"]["n_live"] == 0


@pytest.mark.parametrize("size", BIG)
def test_buffer_size_out_of_range_is_refused_by_name(ctx, size):
    """buffer(2**64 + 4096) used to be a 4096-byte buffer."""
    with pytest.raises(sgm.InvalidError, match="size"):
        ctx.buffer(size)
    assert all(t["n_live"] == 0 for t in ctx.stats()["tiers"].values())


def test_offsets_out_of_range_are_refused_by_name(ctx):
    """write(b'ZZZ', offset=2**64) used to write at offset 0."""
    b = ctx.buffer(b"A" * 4096)
    for off in (2**64, 2**64 + 1, -1):
        with pytest.raises(sgm.InvalidError, match="offset"):
            b.write(b"ZZZ", offset=off)
        with pytest.raises(sgm.InvalidError, match="offset"):
            b.read(3, offset=off)
        with pytest.raises(sgm.InvalidError, match="offset"):
            b.readinto(bytearray(3), offset=off)
    assert b.read() == b"A" * 4096
    with pytest.raises(sgm.InvalidError, match="size"):
        b.read(2**64)
    with pytest.raises(sgm.InvalidError, match="size"):
        b.read(-1)
    with pytest.raises(sgm.InvalidError, match="whole number"):
        b.write(b"Z", offset=1.5)


def test_pointers_streams_priorities_out_of_range(ctx):
    for bad in (2**64, -1):
        with pytest.raises(sgm.InvalidError, match="ptr"):
            ctx.free(bad)
        with pytest.raises(sgm.InvalidError, match="ptr"):
            ctx.pointer_tier(bad)
        with pytest.raises(sgm.InvalidError, match="stream"):
            ctx.alloc(256, stream=bad)
    b = ctx.buffer(64)
    for bad in (2**32 + 2, -(2**31) - 1, 2**64):
        with pytest.raises(sgm.InvalidError, match="priority"):
            b.set_priority(bad)
    with pytest.raises(sgm.InvalidError, match="whole number"):
        ctx.alloc(True)


def test_bad_tier_and_nul_in_option_raise_sgm_errors(ctx):
    """evict(7) and a NUL byte in an option raised a bare ValueError."""
    b = ctx.buffer(64)
    with pytest.raises(sgm.Error, match="unknown tier 7"):
        b.evict(7)
    with pytest.raises(sgm.Error, match="NUL"):
        sgm.Context(backend="emu", vram_limit="1MiB\0junk")


def test_calls_after_close_raise_sgm_error(ctx):
    b = ctx.buffer(b"x" * 100)
    ctx.close()
    for call in (lambda: ctx.alloc(256), ctx.trim, ctx.stats, lambda: b.read(),
                 lambda: b.write(b"y"), b.evict, lambda: b.tier):
        with pytest.raises(sgm.Error, match="closed"):
            call()
    b.close()  # a no-op: the context destroyed it
    ctx.close()


def test_close_while_threads_use_its_buffers(tmp_path):
    """Context.close() while threads read, write and move its buffers: it
    waits for the calls in flight, the threads then get sgm.Error; no hang, no
    use after free (this was a heap-use-after-free in sgm__buffer_check, and
    threads hung forever)."""
    for rnd in range(5):
        ctx = sgm.Context(backend="emu", emu_vram="64MiB", vram_limit="1MiB",
                          shared_limit="2MiB", spill_dir=str(tmp_path), verbose=0)
        start = threading.Barrier(5)
        errors, others = [], []

        def worker(k):
            b = ctx.buffer(bytes([k]) * 300_000)
            start.wait()
            try:
                while True:
                    b.write(bytes([k]) * 1000, offset=k * 10)
                    assert b.read(1000, offset=k * 10) == bytes([k]) * 1000
                    b.evict("disk" if k % 2 else "shared")
                    with b.acquired():
                        pass
            except sgm.Error as e:
                errors.append(e)
            except BaseException as e:  # noqa: BLE001 (reported below)
                others.append(e)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        start.wait()
        ctx.close()
        for t in ts:
            t.join(timeout=60)
            assert not t.is_alive(), "a thread hung after close()"
        assert not others, others
        assert len(errors) == 4 and all("closed" in str(e) for e in errors), errors


def test_close_from_inside_a_call_is_busy(ctx):
    """A close that would wait for itself refuses with BusyError."""
    b = ctx.buffer(8)

    # A stream object whose .ptr closes the context: called inside no call of
    # ours (arguments are checked first), so close simply works.
    class Closer:
        @property
        def ptr(self):
            ctx.close()
            return 0

    with pytest.raises(sgm.Error, match="closed"):
        b.acquire(Closer())
    with pytest.raises(sgm.Error, match="closed"):
        b.write(b"z")
    # From inside a guarded call on the same thread: BusyError, not a hang.
    ctx2 = sgm.Context(backend="emu", emu_vram="64MiB", verbose=0)
    try:
        with ctx2._call("test"):
            with pytest.raises(sgm.BusyError):
                ctx2.close()
    finally:
        ctx2.close()
