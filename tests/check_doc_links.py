#!/usr/bin/env python3
"""check_doc_links.py — every relative link in the repository's Markdown
(README.md, docs/, and the other *.md files outside build folders) names a
file or folder that exists in the repository, the LICENSE file is there, and no document sends readers
to a document that does not ship (a .md outside the repository) or to a
developer machine's absolute path (/work/...). Trace folders are data the
reader fetches (docs/traces.md says where) and may be named. Usage: check_doc_links.py
[ROOT]; exit 0 when clean, else 1 with one line per fault (file:line: what)."""
import os
import re
import sys

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
OUTSIDE = re.compile(r"(?<![\w.])(?:/work/[\w./-]*|(?:\.\./)+[\w./-]*\.md\b)")
SKIP_DIRS = {"build", ".git", "node_modules", "__pycache__"}


def markdown_files(root):
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith("build")]
        for f in files:
            if f.endswith(".md"):
                yield os.path.join(d, f)


def check(root):
    faults = []
    if not os.path.isfile(os.path.join(root, "LICENSE")):
        faults.append("LICENSE: missing (the project's licence ships at the top of the tree)")
    for path in sorted(markdown_files(root)):
        rel = os.path.relpath(path, root)
        in_fence = False
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.lstrip().startswith("```"):
                    in_fence = not in_fence
                for target in LINK.findall(line):
                    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                        continue  # a URL or an anchor in this page
                    target = target.split("#", 1)[0]
                    full = os.path.normpath(os.path.join(os.path.dirname(path), target))
                    if not full.startswith(os.path.abspath(root)) or not os.path.exists(full):
                        faults.append(f"{rel}:{n}: link to {target}, which is not in the repository")
                for m in OUTSIDE.findall(line):
                    faults.append(f"{rel}:{n}: names {m}, which does not ship with the repository")
    return faults


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    faults = check(root)
    for f in faults:
        print(f)
    print(f"check_doc_links: {len(faults)} fault(s)", file=sys.stderr)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
