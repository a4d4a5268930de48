"""install_dir.py PREFIX — where `cmake --install` puts the sgm package for
the interpreter running this script: the entry of its sys.path under PREFIX/lib
(Debian's /usr/local/lib/python3.X/dist-packages, /usr/lib/python3/dist-packages),
so that `python3 -c "import sgm"` finds it with no PYTHONPATH; for any other
prefix, PREFIX/lib/python3.X/site-packages (then PYTHONPATH must name it).
Prints the folder, then "on-path" or "needs-pythonpath"."""
import os
import sys
import sysconfig

prefix = os.path.normpath(os.path.abspath(sys.argv[1]))
for entry in sys.path:
    if entry.startswith(os.path.join(prefix, "lib") + os.sep) and entry.endswith("-packages"):
        print(entry)
        print("on-path")
        break
else:
    print(sysconfig.get_path("purelib", "posix_prefix", vars={"base": prefix, "platbase": prefix}))
    print("needs-pythonpath")
