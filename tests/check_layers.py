#!/usr/bin/env python3
"""The layer check (issue 31 item 4): lib/ calls only downward.

Invariant: every file of lib/ sits on one layer of lib/LAYERS, and no file
calls a function, uses a variable or includes a header of a higher layer,
except the upward edges named in tests/layers_known_upward.txt; and no files
of one layer reach each other in a circle, except the circles named there.
That list can only shrink: the check fails when a new upward edge appears AND when a listed
one has disappeared from the code without being removed from the list.

Which file reaches which is derived from the code itself, not written down:
calls and data references from the symbol tables of the release objects
(`nm -P`: a symbol one object leaves undefined and another defines is an edge
from the first file to the second), includes from each file's `#include "..."`
lines. Nothing is parsed by hand from C.

Usage:
  check_layers.py ROOT OBJ...             check (ctest: layer_check); also that
                                          no tool (tools/) includes internal.h
  check_layers.py ROOT --self-test OBJ... the checker catches an injected upward
                                          call and a stale list entry (ctest)
  check_layers.py ROOT --picture          print the house drawn from lib/LAYERS
  check_layers.py ROOT --update-docs      write that picture into docs/architecture.md
  check_layers.py ROOT --edges OBJ...     print every upward edge found, in the
                                          list's format (to shrink the list)
docs/architecture.md carries the picture between its layer-picture markers;
the check fails when it differs from what --picture prints now.
"""
import fnmatch
import os
import re
import subprocess
import sys

OBJ_MARK = '/sgm_objects.dir/'


def read_layers(root):
    """[(number, name, [globs])], bottom first, from lib/LAYERS."""
    layers = []
    with open(os.path.join(root, 'lib', 'LAYERS')) as f:
        for line in f:
            line = line.split('#', 1)[0].split()
            if not line:
                continue
            layers.append((int(line[0]), line[1], line[2:]))
    nums = [n for n, _, _ in layers]
    if nums != list(range(len(layers))):
        sys.exit('lib/LAYERS: layers must be numbered 0, 1, 2, ... bottom first; got %s' % nums)
    return layers


def layer_of(layers, path):
    """The layer number of lib/-relative path, or None."""
    hits = [n for n, _, globs in layers for g in globs if fnmatch.fnmatchcase(path, g)]
    if len(set(hits)) > 1:
        sys.exit('lib/LAYERS puts %s on more than one layer (%s): give it one' % (path, hits))
    return hits[0] if hits else None


def lib_files(root):
    out = []
    lib = os.path.join(root, 'lib')
    for d, _, fs in os.walk(lib):
        for f in fs:
            if f.endswith(('.c', '.h')):
                out.append(os.path.relpath(os.path.join(d, f), lib))
    return sorted(out)


def symbol_edges(objs):
    """{(from_src, to_src, symbol)} from the objects' symbol tables."""
    defs, uses = {}, {}
    for o in objs:
        if OBJ_MARK not in o or not o.endswith('.c.o'):
            sys.exit('not an object of sgm_objects: %s' % o)
        src = o.split(OBJ_MARK, 1)[1][:-2]
        out = subprocess.run(['nm', '-P', o], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            p = line.split()
            if len(p) < 2:
                continue
            name, kind = p[0], p[1]
            if kind == 'U':
                uses.setdefault(src, set()).add(name)
            elif kind in 'TDBRVWGS':
                defs[name] = src
    edges = set()
    for src, names in uses.items():
        for n in names:
            to = defs.get(n)
            if to is not None and to != src:
                edges.add((src, to, n))
    return edges, sorted(set(o.split(OBJ_MARK, 1)[1][:-2] for o in objs))


def include_edges(root, files):
    """{(from_file, header, '#include')} for quoted includes of lib/ headers."""
    edges = set()
    for f in files:
        with open(os.path.join(root, 'lib', f), errors='replace') as fh:
            for m in re.finditer(r'^\s*#\s*include\s+"([^"]+)"', fh.read(), re.M):
                h = m.group(1)
                if os.path.exists(os.path.join(root, 'lib', h)):
                    edges.add((f, h, '#include'))
    return edges


def upward(layers, edges):
    """The edges that climb, as 'from -> to: name' lines."""
    out = set()
    for a, b, name in edges:
        la, lb = layer_of(layers, a), layer_of(layers, b)
        if la is not None and lb is not None and lb > la:
            out.add('%s -> %s: %s' % (a, b, name))
    return out


def circles(edges):
    """'circle: f1 f2 ...' for each set of two or more files that reach each
    other through calls (a strongly connected component, Tarjan)."""
    g = {}
    for a, b, _ in edges:
        if not b.endswith('.h'):
            g.setdefault(a, set()).add(b)
    index, low, stack, on, out, n = {}, {}, [], set(), set(), [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add('circle: ' + ' '.join(sorted(comp)))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def read_known(root):
    known = set()
    with open(os.path.join(root, 'tests', 'layers_known_upward.txt')) as f:
        for line in f:
            line = line.split('#', 1)[0].strip()
            if line:
                known.add(re.sub(r'\s+', ' ', line))
    return known


def picture(layers):
    """The house as text: top layer first, arrows pointing down."""
    width = max(len(name) for _, name, _ in layers)
    lines = []
    for i, (n, name, globs) in enumerate(reversed(layers)):
        files = ' '.join(g for g in globs if not g.endswith('.h'))
        lines.append('%2d  %-*s  %s' % (n, width, name, files))
        if i + 1 < len(layers):
            lines.append('     |')
    lines.append('     v  (every arrow points down: a layer calls and includes only layers below it)')
    return '\n'.join(lines) + '\n'


def docs_picture(root):
    path = os.path.join(root, 'docs', 'architecture.md')
    text = open(path).read()
    m = re.search(r'<!-- layer-picture: begin.*?-->\n```\n(.*?)```\n<!-- layer-picture: end -->', text, re.S)
    return m.group(1) if m else None


def check(root, layers, edges, objs_src, known, quiet=False):
    """Returns the list of failure lines (empty when the house stands)."""
    bad = []
    files = lib_files(root)
    for f in files:
        if layer_of(layers, f) is None and f not in ('internal.h', 'LAYERS') and f.endswith('.c'):
            bad.append('%s is on no layer: add it to one line of lib/LAYERS' % f)
    missing = [f for f in files if f.endswith('.c') and f not in objs_src]
    if missing:
        bad.append('no object given for %s: pass every object of sgm_objects' % ', '.join(missing))
    for d, _, fs in os.walk(os.path.join(root, 'tools')):
        for f in fs:
            if f.endswith(('.c', '.h')) and re.search(r'^\s*#\s*include\s+"internal\.h"',
                                                      open(os.path.join(d, f)).read(), re.M):
                bad.append('tools/%s includes internal.h: tools use the public API and '
                           'lib/tool_support.h' % f)
    up = upward(layers, edges) | circles(edges)
    for e in sorted(up - known):
        bad.append(('new circle (files of one layer that reach each other): ' if e.startswith('circle:')
                    else 'new upward edge (a lower layer reaches a higher one): ') + e)
    for e in sorted(known - up):
        bad.append('listed edge or circle no longer in the code: remove it from '
                   'tests/layers_known_upward.txt: ' + e)
    return bad


def main():
    root = sys.argv[1]
    args = sys.argv[2:]
    mode = 'check'
    if args and args[0].startswith('--'):
        mode, args = args[0][2:], args[1:]
    layers = read_layers(root)
    if mode == 'picture':
        sys.stdout.write(picture(layers))
        return 0
    if mode == 'update-docs':
        path = os.path.join(root, 'docs', 'architecture.md')
        text = open(path).read()
        new = re.sub(r'(<!-- layer-picture: begin.*?-->\n```\n).*?(```\n<!-- layer-picture: end -->)',
                     lambda m: m.group(1) + picture(layers) + m.group(2), text, flags=re.S)
        open(path, 'w').write(new)
        return 0
    objs = args
    sedges, objs_src = symbol_edges(objs)
    edges = sedges | include_edges(root, lib_files(root))
    known = read_known(root)
    if mode == 'edges':
        print('\n'.join(sorted(upward(layers, edges) | circles(edges))))
        return 0
    if mode == 'self-test':
        # Invariant of the checker itself: a call from the lowest layer to a
        # function of the top one is reported, and so is a listed edge that
        # is gone; the clean tree (as given) reports neither.
        low = next(f for f in objs_src if layer_of(layers, f) == 0)
        top = next(f for f in objs_src if layer_of(layers, f) == len(layers) - 1)
        fake = (low, top, 'sgm__layer_selftest_climb')
        got = check(root, layers, edges | {fake}, objs_src, known)
        want_new = 'new upward edge (a lower layer reaches a higher one): %s -> %s: %s' % fake
        ok = want_new in got
        print('injected %s -> %s: %s' % fake, 'caught' if ok else 'NOT caught')
        stale = '%s -> %s: sgm__layer_selftest_gone' % (low, top)
        got2 = check(root, layers, edges, objs_src, known | {stale})
        ok2 = any(stale in g and 'no longer in the code' in g for g in got2)
        # and a circle: the top file calling back into the lowest is a new one
        # (and a new upward edge) beyond what the tree had.
        back = (top, low, 'sgm__layer_selftest_back')
        got3 = check(root, layers, edges | {fake, back}, objs_src, known)
        ok2 = ok2 and any(g.startswith('new circle') and low in g and top in g for g in got3)
        print('injected circle', low, '<->', top, 'caught' if ok2 else 'NOT caught')
        print('stale list entry', 'caught' if ok2 else 'NOT caught')
        return 0 if ok and ok2 else 1
    bad = check(root, layers, edges, objs_src, known)
    pic = docs_picture(root)
    if pic != picture(layers):
        bad.append('docs/architecture.md: the layer picture differs from lib/LAYERS; '
                   'run `python3 tests/check_layers.py . --update-docs`')
    for b in bad:
        print(b)
    if not bad:
        print('lib/ calls only downward: %d files on %d layers; %d known upward edges and %d '
              'known circles within a layer left (tests/layers_known_upward.txt)'
              % (len(objs_src), len(layers), len(upward(layers, edges)), len(circles(edges))))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
