#!/usr/bin/env python3
"""check_prometheus.py — a strict checker of the Prometheus text exposition
format (version 0.0.4, what node_exporter's textfile collector reads), for
sgm-smi --prometheus. Usage: check_prometheus.py FILE (or - for stdin).
Exit 0 when valid; otherwise 1 with one line per fault: the line number and
what is wrong.

Checked: every line ends in a newline; comments are "# HELP name text" or
"# TYPE name type" (type one of counter, gauge, histogram, summary,
untyped), at most one of each per metric, TYPE before the metric's first
sample; metric and label names match the format's grammar, label names do
not start with "__" and do not repeat in one sample; label values use only
the escapes \\\\, \\" and \\n; values are floats (or +Inf, -Inf, NaN), an
optional timestamp an integer; a metric's samples are contiguous (no
interleaving of families); and no series (name and label set) appears twice,
which Prometheus and node_exporter reject.
"""
import re
import sys

METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}
FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|Inf|inf)$|NaN$")


def parse_labels(s, i, n, faults):
    """Parse {a="b",...} from s[i] == '{'; return (labels, index after '}')."""
    labels = {}
    i += 1
    while True:
        if i < len(s) and s[i] == "}":
            return labels, i + 1
        m = LABEL.match(s, i)
        if not m:
            faults.append(f"line {n}: bad label name at column {i + 1}")
            return None, i
        name = m.group(0)
        if name.startswith("__"):
            faults.append(f"line {n}: label name {name} is reserved (starts with __)")
        if name in labels:
            faults.append(f"line {n}: label {name} repeated")
        i = m.end()
        if s[i:i + 2] != '="':
            faults.append(f"line {n}: expected =\" after label {name}")
            return None, i
        i += 2
        value = []
        while True:
            if i >= len(s):
                faults.append(f"line {n}: unterminated label value for {name}")
                return None, i
            c = s[i]
            if c == "\\":
                if i + 1 >= len(s) or s[i + 1] not in '\\"n':
                    faults.append(f"line {n}: bad escape in the value of {name}")
                    return None, i
                value.append(s[i:i + 2])
                i += 2
                continue
            if c == '"':
                i += 1
                break
            if c == "\n":
                faults.append(f"line {n}: raw newline in the value of {name}")
            value.append(c)
            i += 1
        labels[name] = "".join(value)
        if i < len(s) and s[i] == ",":
            i += 1
            continue
        if i < len(s) and s[i] == "}":
            return labels, i + 1
        faults.append(f"line {n}: expected , or }} after the value of {name}")
        return None, i


def check(text):
    faults = []
    if text and not text.endswith("\n"):
        faults.append("the last line does not end in a newline")
    helps, types, seen_series = set(), {}, set()
    done_families, current = set(), None
    for n, line in enumerate(text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"), 1):
        if line == "":
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                if not METRIC.fullmatch(name):
                    faults.append(f"line {n}: bad metric name {name!r} in {parts[1]}")
                if parts[1] == "HELP":
                    if name in helps:
                        faults.append(f"line {n}: second HELP for {name}")
                    helps.add(name)
                    if re.search(r"\\[^\\n]", parts[3] if len(parts) > 3 else ""):
                        faults.append(f"line {n}: bad escape in HELP of {name}")
                else:
                    t = parts[3] if len(parts) > 3 else ""
                    if t not in TYPES:
                        faults.append(f"line {n}: unknown type {t!r} for {name}")
                    if name in types:
                        faults.append(f"line {n}: second TYPE for {name}")
                    if name in done_families or name == current:
                        faults.append(f"line {n}: TYPE for {name} after its samples")
                    types[name] = t
            continue
        m = METRIC.match(line)
        if not m:
            faults.append(f"line {n}: bad metric name")
            continue
        name, i = m.group(0), m.end()
        labels = {}
        if i < len(line) and line[i] == "{":
            labels, i = parse_labels(line, i, n, faults)
            if labels is None:
                continue
        rest = line[i:]
        if not rest.startswith(" "):
            faults.append(f"line {n}: expected a space before the value")
            continue
        fields = rest[1:].split(" ")
        if len(fields) not in (1, 2) or not FLOAT.match(fields[0]):
            faults.append(f"line {n}: bad value {rest[1:]!r}")
        if len(fields) == 2 and not re.fullmatch(r"-?\d+", fields[1]):
            faults.append(f"line {n}: bad timestamp {fields[1]!r}")
        family = name
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name[: -len(suffix)] in types and types[name[: -len(suffix)]] in (
                    "histogram", "summary"):
                family = name[: -len(suffix)]
        if family != current:
            if family in done_families:
                faults.append(f"line {n}: samples of {family} are not contiguous")
            if current:
                done_families.add(current)
            current = family
        if family not in types:
            faults.append(f"line {n}: {family} has no TYPE line before its samples")
        key = (name, tuple(sorted(labels.items())))
        if key in seen_series:
            faults.append(f"line {n}: duplicate series {name}{{{','.join(f'{k}={v!r}' for k, v in key[1])}}}")
        seen_series.add(key)
    return faults


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[1].strip(), file=sys.stderr)
        return 2
    data = sys.stdin.buffer.read() if sys.argv[1] == "-" else open(sys.argv[1], "rb").read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        print(f"not UTF-8: {e}")
        return 1
    faults = check(text)
    for f in faults:
        print(f)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
