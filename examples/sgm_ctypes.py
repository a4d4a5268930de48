"""sgm_ctypes.py — what the framework examples share: finding libsgm.so,
loading it through ctypes with the signatures they call, and reading sgm's
statistics. Imported by pytorch_allocator.py and cupy_allocator.py (Python
puts the script's own folder on sys.path)."""
import ctypes
import json
import os
import sys

MiB = 1 << 20
TIERS = {0: "vram", 1: "shared", 2: "disk", -1: "none"}


def skip(why):
    print(f"no GPU: skipping ({why})")
    sys.exit(0)


def find_lib():
    if len(sys.argv) > 1:
        return os.path.abspath(sys.argv[1])
    if os.environ.get("SGM_LIB"):
        return os.path.abspath(os.environ["SGM_LIB"])
    here = os.path.dirname(os.path.abspath(__file__))
    built = os.path.normpath(os.path.join(here, "..", "build", "release", "lib", "libsgm.so"))
    if os.path.exists(built):
        return built
    return "libsgm.so"  # the dynamic loader's search path



def load_sgm(path):
    """libsgm.so through ctypes, with the signatures the examples call."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        print(f"cannot load {path}: {e}\n"
              "build it (cmake --preset release && cmake --build build/release) or pass its "
              "path as the first argument or in SGM_LIB", file=sys.stderr)
        sys.exit(1)
    c = ctypes
    lib.sgm_torch_malloc.argtypes = [c.c_size_t, c.c_int, c.c_void_p]
    lib.sgm_torch_malloc.restype = c.c_void_p
    lib.sgm_torch_free.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]
    lib.sgm_torch_free.restype = None
    lib.sgm_hook_context.argtypes = [c.c_int]
    lib.sgm_hook_context.restype = c.c_void_p
    lib.sgm_torch_empty_cache.argtypes = []
    lib.sgm_torch_empty_cache.restype = None
    lib.sgm_pointer_tier.argtypes = [c.c_void_p, c.c_void_p]
    lib.sgm_pointer_tier.restype = c.c_int
    lib.sgm_stats_json.argtypes = [c.c_void_p, c.POINTER(c.c_void_p)]
    lib.sgm_stats_json.restype = c.c_int
    lib.sgm_string_free.argtypes = [c.c_void_p]
    lib.sgm_string_free.restype = None
    lib.sgm_last_error.argtypes = []
    lib.sgm_last_error.restype = c.c_char_p
    return lib



def stats(lib, ctx):
    """The context's statistics as a dict (sgm_stats_json; shape in docs/stats.md)."""
    out = ctypes.c_void_p()
    if lib.sgm_stats_json(ctx, ctypes.byref(out)) != 0:
        raise RuntimeError("sgm_stats_json: " + lib.sgm_last_error().decode())
    try:
        return json.loads(ctypes.string_at(out.value).decode())
    finally:
        lib.sgm_string_free(out)



def work_plan(budget):
    """Sizes for 1.5x the VRAM budget of int32 arrays: (block bytes, count, elements per block)."""
    block = (budget // 8) // 4 * 4
    n_blocks = (budget * 3 // 2 + block - 1) // block
    return block, n_blocks, block // 4


def task_manager(st, moment):
    print(f"{moment}:")
    for name, key in (("Dedicated GPU memory", "vram"), ("Shared GPU memory", "shared")):
        t = st["tiers"][key]
        print(f"  {name:21s} {t['used_bytes'] / MiB:9.1f} / {t['budget_bytes'] / MiB:.1f} MiB"
              f"  (committed {t['committed_bytes'] / MiB:.1f} MiB)")
    print(f"  fallbacks: {st['n_fallbacks']} ({st['fallback_bytes'] / MiB:.1f} MiB)")
