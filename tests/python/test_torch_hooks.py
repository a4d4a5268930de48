"""sgm.torch against the stand-in torch (tests/python/standin/README.md) on the
emulated device: use() wires every setter PyTorch's allocator object has (each
address checked with dladdr to be the right exported sgm symbol) and warns for
what it lacks; the hooks, called through ctypes with PyTorch's C types, do
what docs/frameworks.md says (record_stream defers reuse, reset trims, the
fraction sets the budget, a CUDA graph's pool keeps its memory through idle
trims until it is released); the MemPool route takes only what PyTorch's own
allocator cannot; memory_stats() speaks PyTorch's keys. Each case runs in a
child python (a fresh torch, a fresh libsgm and its hook contexts).
"""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import HERE, child_env

STANDIN = os.path.join(HERE, "standin")

_HEAD = textwrap.dedent("""
    import ctypes, os, sys, warnings
    sys.path.insert(0, {standin!r})
    import torch
    import sgm, sgm.torch
    sgm.torch._EMU_FOR_TESTS["on"] = True
    MiB = 1 << 20
    lib = sgm._lib.lib()

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
    libdl = ctypes.CDLL(None)
    libdl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]

    def symbol_at(addr):
        info = DlInfo()
        assert libdl.dladdr(addr, ctypes.byref(info)), hex(addr)
        assert info.saddr == addr, (hex(addr), info.sname)   # the start of a function
        assert os.path.realpath(info.fname.decode()) == os.path.realpath(sgm.library_path())
        return info.sname.decode()

    def vram():
        return sgm.stats(0)["tiers"]["vram"]

    def bytes_are(t, v):   # host memory on the emulated device and the stand-in
        return ctypes.string_at(t.data_ptr(), t.numel()) == bytes([v]) * t.numel()
""")


def run(body, version="2.9.0", **env):
    code = _HEAD.format(standin=STANDIN) + textwrap.dedent(body) + "\nprint('child ok')\n"
    e = child_env(SGM_BACKEND="emu", SGM_EMU_VRAM="256MiB", SGM_VRAM_LIMIT="64MiB",
                  SGM_SHARED_LIMIT="64MiB", STANDIN_TORCH_VERSION=version, **env)
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "child ok" in r.stdout, r.stdout + r.stderr
    return r


_EXPECTED_2_3 = {
    "set_init_fn": "sgm_torch_init",
    "set_reset_fn": "sgm_torch_empty_cache",
    "set_memory_fraction_fn": "sgm_torch_set_memory_fraction",
    "set_base_alloc_fn": "sgm_torch_base_alloc",
    "set_record_stream_fn": "sgm_torch_record_stream",
    "set_begin_allocate_to_pool": "sgm_torch_begin_allocate_to_pool",
    "set_end_allocate_to_pool_fn": "sgm_torch_end_allocate_to_pool",
    "set_release_pool": "sgm_torch_release_pool",
}
_EXPECTED_2_1 = dict(_EXPECTED_2_3)
del _EXPECTED_2_1["set_begin_allocate_to_pool"], _EXPECTED_2_1["set_end_allocate_to_pool_fn"]
_EXPECTED_2_1["set_begin_allocate_stream_to_pool"] = "sgm_torch_begin_allocate_stream_to_pool"
_EXPECTED_2_1["set_end_allocate_stream_to_pool_fn"] = "sgm_torch_end_allocate_stream_to_pool"


@pytest.mark.parametrize("version,expected", [("2.9.0", _EXPECTED_2_3), ("2.3.0", _EXPECTED_2_3),
                                              ("2.2.0", _EXPECTED_2_1)])
def test_use_wires_every_setter(version, expected):
    """Invariant: every setter the allocator object has gets the address of
    the exported sgm function for it (dladdr names it), before the allocator
    becomes current; nothing is warned when all are there."""
    run(f"""
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            sgm.torch.use()
        assert not w, [str(x.message) for x in w]
        setters = [c for c in torch._C.calls if c[0].startswith("set_")]
        got = {{name: symbol_at(addr) for name, addr in setters}}
        assert got == {expected!r}, got
        assert sgm.torch.hooks() == got
        order = [c[0] for c in torch._C.calls]
        assert order.index("change_current_allocator") > max(order.index(s) for s in got)
    """, version=version)


def test_old_pytorch_warns_what_will_not_work():
    """Invariant: a PyTorch whose allocator object has no setters (2.0) gets
    one warning line per missing hook, naming what will not work, and a loud
    stderr line for record_stream; the allocator is still installed."""
    r = run("""
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            sgm.torch.use()
        msgs = [str(x.message) for x in w]
        assert len(msgs) == 6, msgs
        assert all("\\n" not in m for m in msgs)
        assert any("CORRUPTION RISK" in m and "record_stream" in m for m in msgs)
        assert any("empty_cache" in m for m in msgs)
        assert any("CUDA graphs" in m for m in msgs)
        assert sgm.torch.hooks() == {}
        assert sgm.torch.active()
    """, version="2.0.0")
    assert "sgm: warning: sgm.torch: CORRUPTION RISK" in r.stderr


def test_reset_trims_and_fraction_sets_the_budget():
    """Invariant: torch.cuda.empty_cache() reaches sgm_trim through the reset
    hook (cached and free committed memory goes back), and
    set_per_process_memory_fraction() sets the VRAM budget; init reaches sgm at
    CUDA init."""
    run("""
        sgm.torch.use()
        t = torch.empty(8 * MiB, device="cuda")
        assert ("set_init_fn",) == tuple(c[0] for c in torch._C.calls if c[0] == "set_init_fn")
        del t
        assert vram()["used_bytes"] == 0 and vram()["committed_bytes"] > 0
        torch.cuda.empty_cache()
        assert vram()["committed_bytes"] == 0
        total = sgm.stats(0)["device_total_bytes"]
        torch.cuda.set_per_process_memory_fraction(0.125)
        assert vram()["budget_bytes"] == total // 8
    """)


def test_record_stream_reaches_sgm_on_emu():
    """Invariant: the record_stream hook, called with PyTorch's (void*, cudaStream_t),
    records on a live sgm pointer without error, and a pointer sgm does not
    hold is reported on stderr (not silently ignored)."""
    r = run("""
        sgm.torch.use()
        side = torch.cuda.Stream()
        t = torch.empty(4 * MiB, device="cuda")
        t.record_stream(side)
        assert torch._C.calls[-1][0] == "malloc"     # the hook does not allocate
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(
            sgm.torch._address("sgm_torch_record_stream"))
        fn(12345 * 256, side.cuda_stream)           # not sgm's
    """)
    assert r.stderr.count("sgm_torch_record_stream") == 1, r.stderr
    assert "no hook context holds this pointer live" in r.stderr


def _fake_cuda_dir():
    build = os.environ.get("SGM_BUILD_DIR", "")
    d = os.path.join(build, "tests", "support", "fake_cuda")
    return d if os.path.exists(os.path.join(d, "libcuda.so.1")) else None


def test_record_stream_defers_reuse_on_the_double():
    """Invariant: after record_stream(side) a freed block is not handed to the
    next allocation of its own stream while side's work is pending, and is once
    it completed; without record_stream the same allocation reuses it at once
    (the control). The CUDA backend over the driver double, whose streams keep
    work pending on request."""
    d = _fake_cuda_dir()
    if d is None:
        pytest.skip("skipping: the driver double is not built (no CUDA headers)")
    code = textwrap.dedent(f"""
        import ctypes
        fake = ctypes.CDLL({os.path.join(d, "libcuda.so.1")!r}, mode=ctypes.RTLD_GLOBAL)
        fake.fake_cuda_stream_create.restype = ctypes.c_void_p
        fake.fake_cuda_hold_stream.argtypes = [ctypes.c_void_p, ctypes.c_int]
        fake.fake_cuda_complete_stream.argtypes = [ctypes.c_void_p]
        import sgm, sgm.torch
        lib = sgm._lib.lib()
        addr = sgm.torch._address
        T = ctypes.CFUNCTYPE
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        malloc = T(vp, sz, i, vp)(addr("sgm_torch_malloc"))
        free = T(None, vp, sz, i, vp)(addr("sgm_torch_free"))
        record = T(None, vp, vp)(addr("sgm_torch_record_stream"))
        main, side = fake.fake_cuda_stream_create(), fake.fake_cuda_stream_create()
        n = 4 << 20
        a = malloc(n, 0, main); free(a, n, 0, main)
        assert malloc(n, 0, main) == a              # control: reused on its stream
        fake.fake_cuda_hold_stream(side, 1)         # side's work stays pending
        record(a, side)
        free(a, n, 0, main)
        b = malloc(n, 0, main)
        assert b != a, "reused while the side stream may still read it"
        fake.fake_cuda_complete_stream(side)
        free(b, n, 0, main)
        seen = {{malloc(n, 0, main) for _ in range(3)}}
        assert a in seen, "never reused after the side stream completed"
        print("child ok")
    """)
    env = child_env(SGM_BACKEND="cuda", SGM_NODE="off", SGM_VERBOSE="0",
                    LD_LIBRARY_PATH=d + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "child ok" in r.stdout, r.stdout + r.stderr


_GRAPH = textwrap.dedent("""
    sgm.torch.use()
    x = torch.full(4 * MiB, 3, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tmp = torch.empty(16 * MiB, device="cuda")   # a temporary of the graph
        tmp.fill_(0)
        tmp.add_(7)
        y = torch.empty(4 * MiB, device="cuda")
        y.copy_(x)
        y.add_(1)
        del tmp                                       # freed inside the capture
    # After the capture: other work allocates, fills, goes idle, empties caches.
    others = [torch.full(16 * MiB, 0xAB, device="cuda") for _ in range(2)]
    sgm_ctx = sgm._hook_context(0)
    import time; time.sleep(0.4)                      # ten idle-trim periods
    torch.cuda.empty_cache()
    x.fill_(41)
    g.replay()                                        # writes tmp's memory again
    ok_y = torch.equal(y, torch.full(4 * MiB, 42, device="cuda"))
    ok_others = all(torch.equal(o, torch.full(16 * MiB, 0xAB, device="cuda")) for o in others)
""")


def test_graph_pool_survives_idle_trim_until_release():
    """Invariant (issue 24 defect 7): memory a captured graph uses — its
    temporaries freed during the capture included — is not handed to later
    allocations nor trimmed through idle periods and empty_cache, so a replay
    writes only its own memory (bytes checked); the pool's memory comes back
    when the graph is reset (release pool)."""
    run(_GRAPH + textwrap.dedent("""
        assert ok_y and ok_others, (ok_y, ok_others)
        pools = sgm.torch.memory_stats()
        assert pools["sgm.capture_pools.n_pools"] == 1
        assert pools["sgm.capture_pools.parked_bytes"] == 16 * MiB
        g.reset()
        assert sgm.torch.memory_stats()["sgm.capture_pools.n_pools"] == 0
        used = vram()["used_bytes"]
        torch.cuda.empty_cache()
        assert vram()["used_bytes"] == used
        assert sgm.torch.memory_stats()["allocated_bytes.all.current"] == used
    """), SGM_IDLE_TRIM_MS="40")


def test_graph_without_pool_hooks_is_corrupted():
    """The control for the test above: with a PyTorch that cannot pass the
    pool hooks (2.0), the graph's freed temporary goes to the next allocation
    and the replay overwrites it — the corruption the pool hooks prevent."""
    run(_GRAPH + textwrap.dedent("""
        assert ok_y and not ok_others, (ok_y, ok_others)
    """), version="2.0.0", SGM_IDLE_TRIM_MS="40")


def test_mempool_route_takes_only_what_does_not_fit():
    """Invariant: with sgm.torch.pool(use_on_oom=True) PyTorch's own allocator
    serves what fits its limit and the pool (its segments from sgm_torch_malloc,
    in sgm's VRAM) only what does not; PyTorch's statistics keep working; the
    bytes of both are right."""
    run("""
        pool = sgm.torch.pool(use_on_oom=True)
        assert isinstance(pool, torch.cuda.MemPool)
        a = torch.full(10 * MiB, 1, device="cuda")        # fits the 16 MiB stand-in VRAM
        assert vram()["used_bytes"] == 0
        b = torch.full(10 * MiB, 2, device="cuda")        # does not: from the pool
        assert vram()["used_bytes"] == 10 * MiB
        assert sgm.pointer_tier(b.data_ptr()) == sgm.Tier.VRAM
        assert sgm.pointer_tier(a.data_ptr()) == sgm.Tier.NONE
        mallocs = [c for c in torch._C.calls if c[0] == "malloc"]
        assert len(mallocs) == 1 and mallocs[0][1] == 10 * MiB     # one 2 MiB-rounded segment
        assert bytes_are(a, 1) and bytes_are(b, 2)
        s = torch.cuda.memory_stats()                     # PyTorch's own, no exception
        assert s["num_ooms"] == 0
        with torch.cuda.use_mem_pool(pool):               # a scope from sgm
            c = torch.full(1 * MiB, 3, device="cuda")
        assert sgm.pointer_tier(c.data_ptr()) == sgm.Tier.VRAM and bytes_are(c, 3)
        try:
            sgm.torch.use()
            raise AssertionError("use() after pool() must refuse")
        except sgm.InvalidError as e:
            assert "one route" in str(e)
    """, STANDIN_TORCH_VRAM=str(16 << 20))


def test_mempool_route_per_version():
    """Invariant: use_on_oom needs a MemPool that has it (2.8+): older ones get
    UnsupportedError naming it, and pool(use_on_oom=False) still works; a
    PyTorch without MemPool (< 2.5) is told to use use()."""
    run("""
        try:
            sgm.torch.pool()
            raise AssertionError("no use_on_oom in 2.6")
        except sgm.UnsupportedError as e:
            assert "use_on_oom" in str(e) and "2.8" in str(e)
        pool = sgm.torch.pool(use_on_oom=False)
        with torch.cuda.use_mem_pool(pool):
            t = torch.full(1 * MiB, 5, device="cuda")
        assert sgm.pointer_tier(t.data_ptr()) == sgm.Tier.VRAM
    """, version="2.6.0")
    run("""
        try:
            sgm.torch.pool(use_on_oom=False)
            raise AssertionError("no MemPool in 2.4")
        except sgm.UnsupportedError as e:
            assert "MemPool" in str(e) and "use()" in str(e)
    """, version="2.4.0")


def test_memory_stats_and_patch():
    """Invariant: under use() PyTorch's memory_stats() raises (#133281); after
    patch_memory_stats() it, memory_allocated() and memory_summary() answer
    from sgm in PyTorch's keys, byte-exact for what PyTorch holds; unpatching
    restores PyTorch's."""
    run("""
        sgm.torch.use()
        a = torch.empty(3 * MiB, device="cuda")
        b = torch.empty(5 * MiB + 1, device="cuda")
        try:
            torch.cuda.memory_stats()
            raise AssertionError("the stand-in must raise like PyTorch")
        except RuntimeError as e:
            assert "getDeviceStats" in str(e)
        undo = sgm.torch.patch_memory_stats()
        s = torch.cuda.memory_stats()
        assert s["allocated_bytes.all.current"] == 8 * MiB + 256     # 256-byte alignment
        assert torch.cuda.memory_allocated() == 8 * MiB + 256
        assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
        assert s["allocation.all.current"] == 2 and s["num_ooms"] == 0
        assert s["sgm.tiers.vram.used_bytes"] == 8 * MiB + 256
        text = torch.cuda.memory_summary()
        assert "Allocated memory (current)" in text and "8.00 MiB" in text
        del a
        assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == 5 * MiB + 256
        undo()
        try:
            torch.cuda.memory_stats()
            raise AssertionError("unpatched")
        except RuntimeError:
            pass
    """)


def test_num_ooms_counts_failed_allocations():
    """Invariant: num_ooms counts allocations neither VRAM nor shared memory
    took (not those that fell back)."""
    run("""
        sgm.torch.use()
        undo = sgm.torch.patch_memory_stats()
        a = torch.empty(48 * MiB, device="cuda")
        b = torch.empty(32 * MiB, device="cuda")           # falls back to shared memory
        assert torch.cuda.memory_stats()["num_ooms"] == 0
        try:
            c = torch.empty(48 * MiB, device="cuda")        # fits nowhere
        except torch.OutOfMemoryError:
            pass
        s = torch.cuda.memory_stats()
        assert s["num_ooms"] == 1 and s["sgm.n_fallbacks"] == 1, s
    """)


def test_use_after_cuda_init_is_refused():
    """Invariant: change_current_allocator refuses once CUDA is initialised and
    use() turns that into sgm.BusyError saying to call it first."""
    run("""
        t = torch.empty(1 * MiB, device="cuda")   # PyTorch's allocator is in use
        try:
            sgm.torch.use()
            raise AssertionError("must refuse")
        except sgm.BusyError as e:
            assert "before any tensor" in str(e)
        assert not sgm.torch.active()
    """)


def test_base_alloc_names_the_driver_allocation():
    """Invariant: the base-allocation hook answers the chunk holding a tensor
    where VRAM grows in driver allocations (SGM_VRAM_VMM=off): base <= ptr <
    base + size; on a VMM range (the default) the tensor's own address and the
    size untouched, as PyTorch's default."""
    run("""
        sgm.torch.use()
        a = torch.empty(256 << 10, device="cuda")   # small blocks share a growth chunk
        b = torch.empty(256 << 10, device="cuda")
        alloc = torch._C.state["current"]
        for t in (a, b):
            base, size = alloc.base_allocation(t.data_ptr())
            assert base <= t.data_ptr() < base + size, (hex(base), size, hex(t.data_ptr()))
            assert size >= t.numel()
        assert alloc.base_allocation(a.data_ptr()) == alloc.base_allocation(b.data_ptr())
        assert alloc.base_allocation(b.data_ptr())[0] != b.data_ptr() or \
            alloc.base_allocation(a.data_ptr())[0] != a.data_ptr()
    """, SGM_VRAM_VMM="off")
    run("""
        sgm.torch.use()
        a = torch.empty(3 * MiB, device="cuda")
        assert torch._C.state["current"].base_allocation(a.data_ptr()) == (a.data_ptr(), 0)
    """)
