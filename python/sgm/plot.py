"""sgm.plot — a picture of where the memory went, as Task Manager's GPU page
draws it: dedicated and shared GPU memory (and disk) over time, one stacked
band per process, each process's budget as a line on its own band (gaps where
it was absent), fallbacks and evictions marked on the band they happened to,
the legends beside the data.

    python3 -m sgm.plot FILE.csv -o out.png [--width PX] [--height PX] [--title T]

FILE is a record in the format of docs/record-format.md, as `sgm-smi --record`
and `sgm-demo --plot` write it. Needs matplotlib (Debian: python3-matplotlib);
draws with the Agg backend, no display needed. The PNG is exactly
--width x --height pixels (default 1200 x 800).
"""
import argparse
import csv
import math
import sys

COLUMNS = ["time_s", "device", "pid", "name", "vram_used", "vram_budget", "shared_used",
           "shared_budget", "disk_used", "vram_peak", "fallbacks", "evictions", "device_total",
           "shared_cap"]
_INTS = COLUMNS[4:]


class RecordError(ValueError):
    """The file is not a record in docs/record-format.md's format."""


def _utf8_lines(path):
    """The file's lines decoded as UTF-8, one at a time, so that a byte that
    is not UTF-8 is reported with its line (RecordError), not as a traceback."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RecordError(f"{path}:{number}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                  f"{e.start + 1}); a record is UTF-8 text "
                                  f"(docs/record-format.md)") from None


def read_record(path):
    """The rows of a record as dicts (time_s float, pid and the byte/count
    columns int, device and name str). RecordError names the line at fault."""
    rows = []
    reader = csv.reader(_utf8_lines(path))
    header = next(reader, None)
    if header is None:
        raise RecordError(f"{path}: empty file (expected the header line "
                          f"{','.join(COLUMNS)})")
    if [h.strip() for h in header] != COLUMNS:
        raise RecordError(f"{path}:1: the header is {','.join(header)!r}, expected "
                          f"{','.join(COLUMNS)} (docs/record-format.md)")
    for line, fields in enumerate(reader, start=2):
        if not fields:
            continue
        if len(fields) != len(COLUMNS):
            raise RecordError(f"{path}:{line}: {len(fields)} fields, expected "
                              f"{len(COLUMNS)}")
        row = dict(zip(COLUMNS, fields))
        try:
            row["time_s"] = float(row["time_s"])
            if not math.isfinite(row["time_s"]) or row["time_s"] < 0:
                raise ValueError(f"time_s is {fields[0]!r}, not a finite number of seconds >= 0")
            row["pid"] = int(row["pid"])
            for k in _INTS:
                row[k] = int(row[k])
                if row[k] < 0:
                    raise ValueError(f"{k} is negative")
        except ValueError as e:
            raise RecordError(f"{path}:{line}: {e}") from None
        rows.append(row)
    if not rows:
        raise RecordError(f"{path}: a header but no samples")
    return rows


def series(rows, device):
    """One device's record as aligned series: (times, processes) where
    processes maps (pid, name) to {column: [value per time]}, 0 where the
    process was not live in that sample, and "live": [bool per time]."""
    mine = [r for r in rows if r["device"] == device]
    times = sorted({r["time_s"] for r in mine})
    index = {t: i for i, t in enumerate(times)}
    procs = {}
    for r in mine:
        key = (r["pid"], r["name"])
        p = procs.setdefault(key, {k: [0] * len(times) for k in _INTS})
        p.setdefault("live", [False] * len(times))
        for k in _INTS:
            p[k][index[r["time_s"]]] = r[k]
        p["live"][index[r["time_s"]]] = True
    return times, procs


def band_budgets(times, procs, keys, column, budget_of):
    """Each process's budget drawn against its own band: for process k (in
    stacking order), the band's base (the bands below it) plus its budget, so
    the line sits above its band exactly when it is within budget; NaN where
    the process was absent, so the line has a gap instead of plunging to 0.
    Returns {key: [value per time]}."""
    out = {}
    for i_k, k in enumerate(keys):
        line = []
        for i in range(len(times)):
            if not procs[k]["live"][i]:
                line.append(float("nan"))
                continue
            base = sum(procs[j][column][i] for j in keys[:i_k])
            line.append(base + procs[k][budget_of][i])
        out[k] = line
    return out


def _held(times, values):
    """Step data that shows the last sample too: each value holds until the next
    sample, the last one for a typical sampling interval."""
    if len(times) < 2:
        return list(times) + [times[-1] + 1.0], list(values) + [values[-1]]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return list(times) + [times[-1] + gaps[len(gaps) // 2]], list(values) + [values[-1]]


def _unit(max_bytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if max_bytes >= 2 * scale:
            return unit, scale
    return "bytes", 1


def _marks(times, counts):
    """The sample indices where a cumulative count went up, and by how much."""
    out = []
    for i in range(1, len(times)):
        if counts[i] > counts[i - 1]:
            out.append((i, counts[i] - counts[i - 1]))
    if times and counts[0] > 0:
        out.insert(0, (0, counts[0]))
    return out


def draw(rows, out, width=1200, height=800, title=None, dpi=100, inspect=None):
    """Draw the record's rows into a PNG of width x height pixels. inspect
    (tests): called with the figure once it is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = sorted({r["device"] for r in rows})
    show_disk = any(r["disk_used"] for r in rows)
    panels = [("Dedicated GPU memory", "vram_used"), ("Shared GPU memory", "shared_used")]
    if show_disk:
        panels.append(("Disk (spill)", "disk_used"))
    fig, axes = plt.subplots(len(panels), len(devices), squeeze=False, sharex="col",
                             figsize=(width / dpi, height / dpi), dpi=dpi)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, device in enumerate(devices):
        times, procs = series(rows, device)
        keys = sorted(procs)
        colour = {k: colours[i % len(colours)] for i, k in enumerate(keys)}
        for row, (label, column) in enumerate(panels):
            ax = axes[row][col]
            stacked = [sum(procs[k][column][i] for k in keys) for i in range(len(times))]
            budget_of = {"vram_used": "vram_budget", "shared_used": "shared_budget"}.get(column)
            cap_of, cap_label = {"vram_used": ("device_total", "device memory"),
                                 "shared_used": ("shared_cap", "shared GPU memory cap")
                                 }.get(column, (None, None))
            # The scale follows what was used; a budget or cap more than 3x above
            # it runs off the top (a line clipped there) and the legend says so.
            used_top = max(stacked + [0])
            lines = []  # (label, colour, style, values)
            if budget_of:
                for k, values in band_budgets(times, procs, keys, column, budget_of).items():
                    lines.append((f"budget {k[1]} ({k[0]}), on its band", colour[k], "--", values))
            if cap_of:
                cap = [max(procs[k][cap_of][i] for k in keys) for i in range(len(times))]
                if max(cap):
                    lines.append((cap_label, "black", "-", cap))
            top = used_top
            for _, _, _, values in lines:
                finite = [v for v in values if v == v]
                if finite and (used_top == 0 or max(finite) <= 3 * used_top):
                    top = max(top, max(finite))
            top = max(top, 1)
            unit, scale = _unit(top)
            xs = _held(times, times)[0]
            stacks = [_held(times, [v / scale for v in procs[k][column]])[1] for k in keys]
            ax.stackplot(xs, stacks, colors=[colour[k] for k in keys], alpha=0.75,
                         labels=[f"{name} ({pid})" for pid, name in keys], step="post")
            for label_, colour_, style, values in lines:
                finite = [v for v in values if v == v]
                if finite and max(finite) > 1.08 * top:
                    label_ += f" (up to {max(finite) / scale:,.0f} {unit}: off scale)"
                ax.step(xs, _held(times, [v / scale for v in values])[1], where="post",
                        color=colour_, linestyle=style, label=label_,
                        linewidth=1.2 if style == "--" else 1.0)
            # Fallbacks land in shared memory; evictions leave VRAM: mark them there,
            # on the top of the band of the process they happened to, at most one
            # mark per process per 1/60 of the time axis (a busy run makes thousands).
            marker_of = {"shared_used": ("fallbacks", "v", "tab:red"),
                         "vram_used": ("evictions", "x", "tab:purple")}
            if column in marker_of:
                counter, marker, mcolour = marker_of[column]
                total_marks, bins = 0, {}
                span = (times[-1] - times[0]) or 1.0
                for i_k, k in enumerate(keys):
                    for i, n in _marks(times, procs[k][counter]):
                        total_marks += n
                        y = sum(procs[j][column][i] for j in keys[:i_k + 1])
                        bins.setdefault((k, int(60 * (times[i] - times[0]) / span)), (times[i], y))
                if bins:
                    xs_m = [x for x, _ in bins.values()]
                    ys_m = [min(y / scale, 1.04 * top / scale) for _, y in bins.values()]
                    ax.scatter(xs_m, ys_m, marker=marker, color=mcolour, s=36, zorder=5,
                               clip_on=False, label=f"{counter} ({total_marks})")
            ax.set_ylim(0, 1.08 * top / scale)
            ax.set_ylabel(f"{label}\n[{unit}]")
            ax.grid(True, alpha=0.3)
            if row == 0:
                ax.set_title(f"device {device}")
            if row == len(panels) - 1:
                ax.set_xlabel("time [s]")
            if col == len(devices) - 1:
                # Outside the data, to the right of the last column.
                ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                          fontsize="small", framealpha=0.8)
    fig.suptitle(title or "sgm: where the GPU memory went")
    fig.tight_layout(rect=(0, 0, 0.74, 0.97))
    fig.savefig(out, dpi=dpi, format="png")
    if inspect:
        inspect(fig)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m sgm.plot", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", help="CSV record (docs/record-format.md)")
    ap.add_argument("-o", "--output", help="PNG to write (default: the record's name with .png)")
    ap.add_argument("--width", type=int, default=1200, help="pixels (default 1200)")
    ap.add_argument("--height", type=int, default=800, help="pixels (default 800)")
    ap.add_argument("--title", help="the figure's title")
    args = ap.parse_args(argv)
    if not 100 <= args.width <= 10000 or not 100 <= args.height <= 10000:
        ap.error("--width and --height must be within 100..10000 pixels")
    out = args.output or (args.record.rsplit(".", 1)[0] + ".png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("sgm.plot: matplotlib is missing: install it (Debian: apt-get install "
              "python3-matplotlib) for this python3", file=sys.stderr)
        return 2
    try:
        rows = read_record(args.record)
    except (OSError, RecordError) as e:
        print(f"sgm.plot: {e}", file=sys.stderr)
        return 1
    draw(rows, out, args.width, args.height, args.title)
    print(f"sgm.plot: wrote {out} ({args.width}x{args.height}) from {len(rows)} rows of "
          f"{args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
