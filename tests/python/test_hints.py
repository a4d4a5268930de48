"""Residency hints from Python (issue 30): Buffer.will_use / done / parent and
Context.will_use, and docs/policies.md's worked example of a serving engine
feeding them (a scheduler queue over KV blocks), run as written."""
import pytest

import sgm

KiB = 1 << 10


@pytest.fixture
def small(tmp_path):
    """VRAM of four 64 KiB blocks, lru."""
    with sgm.Context(backend="emu", emu_vram="16MiB", vram_limit="256KiB", shared_limit="16MiB",
                     policy="lru", verbose=0) as c:
        yield c


def use(b):
    with b.acquired():
        pass


def test_will_use_keeps_and_done_sends_first(small):
    """Invariant: a declared buffer stays in VRAM though it is the least
    recently used; a done one leaves first though it is the most recent."""
    blocks = [small.buffer(64 * KiB) for _ in range(4)]
    for b in blocks:
        use(b)
    small.will_use([blocks[0]], distance=1)
    blocks[3].done()
    newer = [small.buffer(64 * KiB)]  # kept: a dropped Buffer is destroyed
    assert blocks[3].tier is sgm.Tier.SHARED
    assert blocks[0].tier is sgm.Tier.VRAM
    newer.append(small.buffer(64 * KiB))
    assert blocks[1].tier is sgm.Tier.SHARED
    assert blocks[0].tier is sgm.Tier.VRAM


def test_bad_hints_are_refused(small, ctx):
    a, b = small.buffer(4 * KiB), small.buffer(4 * KiB)
    with pytest.raises(sgm.InvalidError, match="this context"):
        small.will_use([a, ctx.buffer(4 * KiB)], 1)
    with pytest.raises(sgm.InvalidError, match="distance"):
        small.will_use([a], -1)
    b.parent = a
    assert b.parent is a
    with pytest.raises(sgm.InvalidError, match="cycle"):
        a.parent = b
    b.parent = None
    assert b.parent is None
    a.will_use(3)
    small.will_use([a], None)  # cancelled


def test_worked_example_engine_queue(small):
    """docs/policies.md, "A serving engine's hints": the engine declares the
    blocks of its queued requests, names each block's prefix, and marks a
    finished request's partial last block done. The queued request's shared
    prefix stays resident through a burst of one-off requests."""
    # --- the example, as in the docs ---
    blocks = {}                       # hash of a 512-token prefix -> sgm.Buffer

    def kv_block(ctx, h, parent_hash):
        if h not in blocks:
            blocks[h] = ctx.buffer(64 * KiB)
            if parent_hash is not None:
                blocks[h].parent = blocks[parent_hash]
        return blocks[h]

    def run_request(ctx, hashes, queue):
        for i, h in enumerate(hashes):
            b = kv_block(ctx, h, hashes[i - 1] if i else None)
            with b.acquired():
                pass                  # attention over this block
        # the queue after this step: declare what the next requests reuse
        for distance, req in enumerate(queue, start=1):
            ctx.will_use([blocks[h] for h in req if h in blocks], distance)
        if not any(hashes[-1] in req for req in queue):
            blocks[hashes[-1]].done()  # the partial last block: rewritten next turn
    # --- end of the example ---

    system = ["sys0", "sys1"]
    run_request(small, system + ["a0"], queue=[system + ["b0"]])
    for k in range(6):                # one-off requests pass through
        run_request(small, [f"x{k}"], queue=[system + ["b0"]])
    assert blocks["sys0"].tier is sgm.Tier.VRAM and blocks["sys1"].tier is sgm.Tier.VRAM
    assert blocks["a0"].tier is sgm.Tier.SHARED  # done: it left first
