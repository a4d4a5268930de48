"""python3 -m sgm.plot: a record (docs/record-format.md) becomes a PNG of the
asked size; bad records are refused with the line at fault."""
import os
import struct
import subprocess
import sys

import pytest

from conftest import HERE, child_env
from sgm import plot

FIXTURES = os.path.join(HERE, "fixtures")


def png_size(path):
    """(width, height) from a PNG's IHDR chunk; AssertionError if not a PNG."""
    with open(path, "rb") as f:
        head = f.read(33)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", head[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", head[16:24])


def run_plot(*args):
    return subprocess.run([sys.executable, "-m", "sgm.plot", *args], env=child_env(),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("record,width,height", [("demo-record.csv", 1000, 700),
                                                 ("smi-two-processes.csv", 1200, 800),
                                                 ("two-processes.csv", 640, 480)])
def test_plot_writes_a_png_of_the_asked_size(tmp_path, record, width, height):
    """Invariant: the command exits 0 and writes a PNG exactly width x height
    that is a picture (decodes; many colours), not an empty canvas."""
    out = tmp_path / "out.png"
    r = run_plot(os.path.join(FIXTURES, record), "-o", str(out), "--width", str(width),
                 "--height", str(height))
    assert r.returncode == 0, r.stderr
    assert png_size(out) == (width, height)
    import matplotlib.image
    pixels = matplotlib.image.imread(str(out))
    assert pixels.shape[:2] == (height, width)
    colours = {tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::37].tolist()}
    assert len(colours) > 20


def test_default_output_name_and_size(tmp_path):
    src = tmp_path / "rec.csv"
    src.write_text(open(os.path.join(FIXTURES, "two-processes.csv")).read())
    assert plot.main([str(src)]) == 0
    assert png_size(tmp_path / "rec.png") == (1200, 800)


def test_smi_record_of_two_processes():
    """The sgm-smi record: two processes of one emulated device, the second
    joining later; absent processes read as 0, every row lands in a series."""
    rows = plot.read_record(os.path.join(FIXTURES, "smi-two-processes.csv"))
    times, procs = plot.series(rows, "emu-plotdemo")
    assert len(procs) == 2
    joined = {k: next(i for i, v in enumerate(procs[k]["vram_budget"]) if v) for k in procs}
    first, second = sorted(procs, key=joined.get)
    assert joined[second] > joined[first]
    # The fair split: the first process's budget fell once the second joined.
    budget = procs[first]["vram_budget"]
    assert min(budget[joined[second]:]) < budget[joined[first]]
    assert len(rows) == sum(1 for k in procs for v in procs[k]["device_total"] if v)


def test_series_fill_absent_processes_with_zero():
    rows = plot.read_record(os.path.join(FIXTURES, "two-processes.csv"))
    times, procs = plot.series(rows, "GPU-5f3c0d2e-emu")
    assert times == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert set(procs) == {(101, "trainer"), (202, "notebook")}
    assert procs[(202, "notebook")]["vram_used"] == [0, 0, 0, 268435456, 268435456, 0, 0]
    assert procs[(101, "trainer")]["disk_used"][4] == 268435456
    # Cumulative counters become marks where they rose, with the increase.
    assert plot._marks(times, procs[(101, "trainer")]["fallbacks"]) == [(2, 2), (3, 3), (4, 2)]
    assert plot._marks(times, procs[(101, "trainer")]["evictions"]) == [(3, 3), (4, 6)]


def test_budget_lines_sit_on_their_own_band_with_gaps():
    """Issue 28 item 13: a process's budget is drawn against its own band (the
    bands below it plus its budget), so it is above its band exactly when the
    process is within budget; where the process was absent the line has a gap
    (NaN), not a plunge to 0."""
    rows = plot.read_record(os.path.join(FIXTURES, "two-processes.csv"))
    times, procs = plot.series(rows, "GPU-5f3c0d2e-emu")
    keys = sorted(procs)
    lines = plot.band_budgets(times, procs, keys, "vram_used", "vram_budget")
    for i_k, k in enumerate(keys):
        for i in range(len(times)):
            if not procs[k]["live"][i]:
                assert lines[k][i] != lines[k][i], (k, i)  # NaN: a gap
                continue
            base = sum(procs[j]["vram_used"][i] for j in keys[:i_k])
            assert lines[k][i] == base + procs[k]["vram_budget"][i]
            top = base + procs[k]["vram_used"][i]
            assert (lines[k][i] >= top) == (procs[k]["vram_used"][i] <= procs[k]["vram_budget"][i])
    assert any(v != v for v in lines[(202, "notebook")])  # it came and went


def test_legends_beside_the_data_and_fallbacks_marked(tmp_path):
    """Issue 28 item 13: no legend overlaps a plot's data area, and the
    fallbacks entry comes with markers inside the picture."""
    rows = plot.read_record(os.path.join(FIXTURES, "two-processes.csv"))
    seen = {}

    def inspect(fig):
        renderer = fig.canvas.get_renderer()
        axes = [ax.get_window_extent(renderer) for ax in fig.axes]
        for ax in fig.axes:
            leg = ax.get_legend()
            if leg is None:
                continue
            box = leg.get_window_extent(renderer)
            for a in axes:
                assert not box.overlaps(a), "a legend covers a plot"
            seen["legends"] = seen.get("legends", 0) + 1
            for coll in ax.collections:
                if str(coll.get_label()).startswith("fallbacks"):
                    seen["fallback_marks"] = len(coll.get_offsets())

    plot.draw(rows, str(tmp_path / "p.png"), inspect=inspect)
    assert seen.get("legends", 0) >= 2
    assert seen.get("fallback_marks", 0) >= 1


@pytest.mark.parametrize("text,why", [
    ("", "empty file"),
    ("time_s,device,pid\n1,a,2\n", "the header is"),
    (",".join(plot.COLUMNS) + "\n", "no samples"),
    (",".join(plot.COLUMNS) + "\n0.1,d,1,n,1,2,3\n", ":2: 7 fields"),
    (",".join(plot.COLUMNS) + "\n0.1,d,1,n,1,2,3,4,5,6,7,-8,9,10\n", ":2: evictions is negative"),
    (",".join(plot.COLUMNS) + "\n0.1,d,1,n,1,2,3,4,5,6,7,8,9,ten\n", ":2: invalid literal"),
    # issue 29 item 6: the line at fault, never a traceback
    (",".join(plot.COLUMNS) + "\n0.1,d,1,n,1,2,3,4,5,6,7,8,9,10\nnan,d,1,n,1,2,3,4,5,6,7,8,9,10\n",
     ":3: time_s is 'nan'"),
    (",".join(plot.COLUMNS) + "\ninf,d,1,n,1,2,3,4,5,6,7,8,9,10\n", ":2: time_s is 'inf'"),
    (",".join(plot.COLUMNS) + "\n0.1,d,1,n\xff\xfe,1,2,3,4,5,6,7,8,9,10\n", ":2: not UTF-8"),
])
def test_bad_records_are_refused_naming_the_line(tmp_path, capsys, text, why):
    src = tmp_path / "bad.csv"
    src.write_bytes(text.encode("utf-8", "surrogateescape") if "\xff" not in text
                    else text.encode("latin-1"))
    assert plot.main([str(src), "-o", str(tmp_path / "bad.png")]) == 1
    err = capsys.readouterr().err
    assert why in err, err
    assert not (tmp_path / "bad.png").exists()


@pytest.mark.parametrize("tail,why", [(b"nan,d,1,n,1,2,3,4,5,6,7,8,9,10\n", ":2: time_s"),
                                      (b"0.1,d,1,n\xff,1,2,3,4,5,6,7,8,9,10\n", ":2: not UTF-8")])
def test_command_reports_the_line_not_a_traceback(tmp_path, tail, why):
    """Issue 29 item 6: the command itself (python3 -m sgm.plot) exits 1 with
    the line at fault on stderr, for a nan time and a non-UTF-8 byte."""
    src = tmp_path / "bad.csv"
    src.write_bytes(",".join(plot.COLUMNS).encode() + b"\n" + tail)
    r = run_plot(str(src), "-o", str(tmp_path / "bad.png"))
    assert r.returncode == 1, r.stderr
    assert why in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sizes_out_of_range_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        plot.main([os.path.join(FIXTURES, "two-processes.csv"), "--width", "5"])
    assert e.value.code == 2 and "--width" in capsys.readouterr().err


def test_one_column_per_device(tmp_path):
    """Invariant: a record of two devices draws (one column each) at the asked size."""
    rows = plot.read_record(os.path.join(FIXTURES, "two-processes.csv"))
    other = [dict(r, device="GPU-0a1b-second", pid=r["pid"] + 1000) for r in rows]
    out = tmp_path / "two-devices.png"
    plot.draw(rows + other, str(out), width=900, height=500)
    assert png_size(out) == (900, 500)
    assert [plot.series(rows + other, d)[0] for d in ("GPU-0a1b-second", "GPU-5f3c0d2e-emu")] \
        == [plot.series(rows, "GPU-5f3c0d2e-emu")[0]] * 2
