"""The sgm package on the emulated device: contexts, options, statistics and
errors that carry sgm's status and message."""
import os

import pytest

import sgm

MiB = 1 << 20


def test_context_reports_backend_budget_and_allocations(ctx):
    """Invariant: a context made with options has those budgets; alloc lands in
    VRAM and is counted in stats(); free gives it back."""
    assert ctx.backend == "emu"
    st = ctx.stats()
    assert st["backend"] == "emu"
    assert st["tiers"]["vram"]["budget_bytes"] == 8 * MiB
    assert st["tiers"]["shared"]["budget_bytes"] == 8 * MiB
    assert set(st["tiers"]) == {"vram", "shared", "disk"}
    p = ctx.alloc(1 * MiB)
    assert p % 256 == 0
    assert ctx.pointer_tier(p) is sgm.Tier.VRAM
    assert ctx.stats()["tiers"]["vram"]["used_bytes"] >= 1 * MiB
    ctx.free(p)
    assert ctx.stats()["tiers"]["vram"]["used_bytes"] == 0
    assert ctx.pointer_tier(p) is sgm.Tier.NONE
    ctx.trim()


def test_alloc_past_vram_falls_back_to_shared(ctx):
    """Invariant: an allocation larger than the VRAM budget lands in shared
    memory and counts as a fallback (DESIGN.md §3 rule 3)."""
    p = ctx.alloc(7 * MiB)
    q = ctx.alloc(2 * MiB)  # past the 8 MiB VRAM budget
    assert ctx.pointer_tier(p) is sgm.Tier.VRAM
    assert ctx.pointer_tier(q) is sgm.Tier.SHARED
    assert ctx.stats()["n_fallbacks"] == 1
    ctx.free(q)
    ctx.free(p)


def test_options_override_the_environment_only_for_that_context(monkeypatch):
    """Invariant: Context(**options) wins over SGM_* in the environment, and
    leaves the environment as it found it."""
    monkeypatch.setenv("SGM_VRAM_LIMIT", "16MiB")
    with sgm.Context(backend="emu", emu_vram="64MiB", vram_limit="4MiB") as c:
        assert c.stats()["tiers"]["vram"]["budget_bytes"] == 4 * MiB
    assert os.environ["SGM_VRAM_LIMIT"] == "16MiB"
    with sgm.Context(backend="emu", emu_vram="64MiB") as c:
        assert c.stats()["tiers"]["vram"]["budget_bytes"] == 16 * MiB
    with sgm.Context(backend="emu", emu_vram="64MiB", vram_limit=None, vram_fraction=0.5) as c:
        assert c.stats()["tiers"]["vram"]["budget_bytes"] == 32 * MiB  # None unsets


def test_booleans_map_to_sgm_values():
    """Invariant: shared_fallback=False reaches sgm as off: a full VRAM budget
    then refuses instead of spilling."""
    with sgm.Context(backend="emu", emu_vram="64MiB", vram_limit="4MiB",
                     shared_fallback=False) as c:
        with pytest.raises(sgm.NoMemoryError):
            c.alloc(5 * MiB)


def test_unknown_option_is_refused_with_the_closest_names():
    with pytest.raises(sgm.InvalidError) as e:
        sgm.Context(backend="emu", vram_limt="1GiB")
    assert "vram_limt" in str(e.value) and "vram_limit" in str(e.value)
    assert e.value.status == -1


def test_option_names_come_from_the_library():
    names = sgm.option_names()
    assert "SGM_BACKEND" in names and "SGM_VRAM_LIMIT" in names and "SGM_SPILL_DIR" in names
    assert len(names) == len(set(names))
    assert sgm.options_env({"vram_limit": "1G", "SGM_POLICY": "arc", "allow_growth": True,
                            "spill_dir": None}) == {
        "SGM_VRAM_LIMIT": "1G", "SGM_POLICY": "arc", "SGM_ALLOW_GROWTH": "1", "SGM_SPILL_DIR": None}


def test_a_bad_value_raises_invalid_error_with_sgms_message():
    """Invariant: the error carries the status, its name and sgm's own message
    (which names the variable and the value)."""
    with pytest.raises(sgm.InvalidError) as e:
        sgm.Context(backend="emu", vram_limit="lots")
    err = e.value
    assert isinstance(err, sgm.Error) and isinstance(err, ValueError)
    assert err.status == -1 and err.status_name == "SGM_ERR_INVALID"
    assert "SGM_VRAM_LIMIT" in err.message and "lots" in err.message
    assert err.call == "sgm_context_create"
    assert "SGM_ERR_INVALID" in str(err)


def test_nomem_is_a_memory_error_naming_the_budgets():
    with sgm.Context(backend="emu", emu_vram="64MiB", vram_limit="4MiB", shared_limit="4MiB",
                     verbose=0) as c:
        with pytest.raises(MemoryError) as e:
            c.alloc(16 * MiB)
        err = e.value
        assert isinstance(err, sgm.NoMemoryError) and err.status == -2
        assert err.status_name == "SGM_ERR_NOMEM"
        assert "budget" in err.message
        with pytest.raises(sgm.NoMemoryError):  # buffers too, with no disk tier
            c.buffer(16 * MiB)


def test_free_of_a_foreign_pointer_is_refused_with_a_message(ctx):
    with pytest.raises(sgm.InvalidError) as e:
        ctx.free(0x1234500)
    assert e.value.message
    assert ctx.stats()["n_bad_frees"] == 1


def test_closed_context_refuses_use_and_closes_its_buffers():
    c = sgm.Context(backend="emu", emu_vram="64MiB")
    b = c.buffer(4096)
    c.close()
    c.close()  # idempotent
    assert "closed" in repr(c) and "closed" in repr(b)
    with pytest.raises(sgm.InvalidError):
        c.stats()
    with pytest.raises(sgm.InvalidError):
        b.read(1)


def test_hook_context_stats_as_dict():
    """sgm.stats(device) reads the framework hooks' context (emu here)."""
    st = sgm.stats(0)
    assert st["backend"] == os.environ.get("SGM_BACKEND", "emu")
    assert "used_bytes" in st["tiers"]["vram"]


def test_error_classes_by_status():
    from sgm import _lib
    for status, cls in [(-1, sgm.InvalidError), (-2, sgm.NoMemoryError), (-3, sgm.BackendError),
                        (-4, sgm.DiskIOError), (-5, sgm.CorruptError), (-6, sgm.BusyError),
                        (-7, sgm.UnsupportedError)]:
        err = _lib.error_for(status, "why", "sgm_x")
        assert type(err) is cls and err.status == status and isinstance(err, sgm.Error)
    assert isinstance(_lib.error_for(-7, "x"), NotImplementedError)
    assert type(_lib.error_for(-99, "x")) is sgm.Error
