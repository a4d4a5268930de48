// main.cc — sgm-bench: measures this machine against the references, one
// table; compares two runs; writes docs/benchmarks.md. Usage: USAGE below and
// docs/sgm-bench.md. Exit status: 0 done (missed targets included); 1
// --compare found a regression, or a run measured nothing; 2 bad usage or an
// unreadable file.
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "bodies.h"
#include "report.h"
#include "run.h"

namespace {

const char kUsage[] =
    "usage: sgm-bench [--quick] [--only NAME[,NAME...]] [--traces DIR] [--spill-dir DIR]\n"
    "                 [--json FILE] [--repetitions N] [--min-time SECONDS]\n"
    "       sgm-bench --compare A.json B.json\n"
    "       sgm-bench --markdown RUN.json\n"
    "       sgm-bench --list\n"
    "\n"
    "Measures sgm on this machine, each figure beside its reference in the same run\n"
    "(jemalloc, memcpy, mmap+mlock, raw O_DIRECT I/O, Belady's OPT), and prints one\n"
    "table: figure, sgm, reference, ratio (sgm / reference), spread, target, verdict.\n"
    "  --quick            the short set, 3 repetitions of short runs (under a minute)\n"
    "  --only NAME        only these figures; a NAME without its last parts takes the\n"
    "                     whole area (--only alloc = alloc.*); repeatable\n"
    "  --traces DIR       the trace folder (minimalloc/, mooncake/); default: %s\n"
    "  --spill-dir DIR    where the disk figures write (default: $TMPDIR or /tmp)\n"
    "  --json FILE        also write the run as JSON (schema: docs/sgm-bench.md)\n"
    "  --repetitions N    repetitions per figure (default 5, --quick 3)\n"
    "  --min-time S       Google Benchmark's minimum time per run (default 0.5, --quick 0.02)\n"
    "  --compare A B      the figures of two runs side by side with the change in each\n"
    "                     ratio; exit status 1 when one moved the bad way beyond the\n"
    "                     noise band (the two runs' spreads added)\n"
    "  --markdown RUN     print docs/benchmarks.md for a --json run\n"
    "  --list             the figures: name, in --quick or not, what a skip depends on\n";

int Usage(const std::string &why, const std::string &traces) {
  if (!why.empty()) std::fprintf(stderr, "sgm-bench: %s\n(sgm-bench --help for the usage)\n", why.c_str());
  else std::printf(kUsage, traces.c_str());
  return 2;
}

std::string Dirname(const std::string &p) {
  size_t k = p.rfind('/');
  return k == std::string::npos ? "." : p.substr(0, k);
}

std::string RealPath(const std::string &p) {
  char buf[PATH_MAX];
  return realpath(p.c_str(), buf) ? std::string(buf) : p;
}

// The default trace folder: the source tree's ../shared/traces when this
// binary runs from its build folder; installed, <prefix>/share/sgm/traces
// found from the binary's own place (<prefix>/bin), so a moved tree still
// finds its traces.
std::string DefaultTraces() {
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return *SGM_BENCH_TRACES_BUILD ? SGM_BENCH_TRACES_BUILD : "/usr/share/sgm/traces";
  exe[n] = '\0';
  std::string dir = Dirname(exe);
  // (A standalone build of benchmarks/ against an installed sgm has no source
  // tree's traces: it takes the installed layout.)
  if (*SGM_BENCH_TRACES_BUILD && RealPath(dir) == RealPath(SGM_BENCH_BUILD_DIR)) return SGM_BENCH_TRACES_BUILD;
  return Dirname(dir) + "/" SGM_BENCH_DATADIR_FROM_PREFIX "/sgm/traces";
}

bool ReadDoc(const std::string &path, sgm_bench::Json *doc) {
  std::string err;
  if (!sgm_bench::JsonReadFile(path, doc, &err)) {
    std::fprintf(stderr, "sgm-bench: %s\n", err.c_str());
    return false;
  }
  return true;
}

bool WriteFile(const std::string &path, const std::string &text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) {
    std::fprintf(stderr, "sgm-bench: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char **argv) {
  using namespace sgm_bench;
  // The CPU figures run on the emulated device unless told otherwise.
  setenv("SGM_BACKEND", "emu", 0);
  setenv("SGM_VERBOSE", "0", 0);
  RunOptions o;
  o.rc.traces_dir = DefaultTraces();
  const char *tmp = std::getenv("TMPDIR");
  o.rc.spill_dir = tmp && *tmp ? tmp : "/tmp";
  std::string json_path;
  int reps = 0;
  double min_time = 0;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto value = [&](std::string *v) {
      size_t eq = a.find('=');
      if (eq != std::string::npos) {
        *v = a.substr(eq + 1);
        return true;
      }
      if (i + 1 >= argc) return false;
      *v = argv[++i];
      return true;
    };
    std::string v;
    std::string flag = a.substr(0, a.find('='));
    if (flag == "--help" || flag == "-h") return Usage("", o.rc.traces_dir), 0;
    if (flag == "--quick") {
      o.rc.quick = true;
    } else if (flag == "--list") {
      for (const Figure &f : Figures())
        std::printf("%-30s %-6s %-7s %s\n", f.name.c_str(), f.mode == kQuick ? "quick" : "full",
                    f.needs.empty() ? "-" : f.needs.c_str(), f.what.c_str());
      return 0;
    } else if (flag == "--compare") {
      if (i + 2 >= argc) return Usage("--compare takes two result files", "");
      Json a_doc, b_doc;
      if (!ReadDoc(argv[i + 1], &a_doc) || !ReadDoc(argv[i + 2], &b_doc)) return 2;
      std::string err;
      int n = Compare(a_doc, b_doc, stdout, &err);
      if (n < 0) {
        std::fprintf(stderr, "sgm-bench: --compare: %s\n", err.c_str());
        return 2;
      }
      return n > 0 ? 1 : 0;
    } else if (flag == "--markdown") {
      if (i + 1 >= argc) return Usage("--markdown takes a result file", "");
      Json doc;
      if (!ReadDoc(argv[i + 1], &doc)) return 2;
      std::string err = CheckSchema(doc);
      if (!err.empty()) {
        std::fprintf(stderr, "sgm-bench: %s: %s\n", argv[i + 1], err.c_str());
        return 2;
      }
      std::vector<KnownFigure> known;
      for (const Figure &f : Figures()) known.push_back({f.name, f.what, f.mode == kQuick});
      std::fputs(Markdown(doc, known).c_str(), stdout);
      return 0;
    } else if (flag == "--only") {
      if (!value(&v) || v.empty()) return Usage("--only takes a figure name", "");
      for (size_t s = 0; s <= v.size();) {
        size_t c = v.find(',', s);
        if (c == std::string::npos) c = v.size();
        if (c > s) o.only.push_back(v.substr(s, c - s));
        s = c + 1;
      }
    } else if (flag == "--traces") {
      if (!value(&v) || v.empty()) return Usage("--traces takes a folder", "");
      o.rc.traces_dir = v;
    } else if (flag == "--spill-dir") {
      if (!value(&v) || v.empty()) return Usage("--spill-dir takes a folder", "");
      o.rc.spill_dir = v;
    } else if (flag == "--json") {
      if (!value(&v) || v.empty()) return Usage("--json takes a file name", "");
      json_path = v;
    } else if (flag == "--repetitions") {
      if (!value(&v) || (reps = std::atoi(v.c_str())) < 1 || reps > 1000)
        return Usage("--repetitions takes a whole number from 1 to 1000", "");
    } else if (flag == "--min-time") {
      char *end = nullptr;
      if (!value(&v) || !((min_time = std::strtod(v.c_str(), &end)) > 0) || *end || min_time > 60)
        return Usage("--min-time takes seconds, more than 0 and at most 60", "");
    } else {
      return Usage("unknown argument '" + a + "'", "");
    }
  }
  o.repetitions = reps ? reps : o.rc.quick ? 3 : 5;
  o.rc.min_time_s = min_time > 0 ? min_time : o.rc.quick ? 0.02 : 0.5;
  o.progress = isatty(STDERR_FILENO);
  std::vector<const Figure *> figs = SelectFigures(o);
  if (figs.empty()) return Usage("--only matches no figure (sgm-bench --list names them)", "");
  for (const std::string &p : o.only) {
    bool any = false;
    for (const Figure &f : Figures()) any |= MatchesOnly(f.name, {p});
    if (!any) return Usage("--only " + p + ": no such figure (sgm-bench --list names them)", "");
  }

  int argc1 = 1;
  char name[] = "sgm-bench";
  char *argv1[] = {name, nullptr};
  benchmark::Initialize(&argc1, argv1);
  Json doc = RunFigures(o, figs);
  benchmark::Shutdown();
  AllocContextDestroy();
  DiskTeardown();
  CudaClose();

  PrintTable(doc, stdout);
  if (!json_path.empty() && !WriteFile(json_path, JsonWrite(doc))) return 2;
  for (const Json &f : doc.Get("figures")->arr)
    if (f.StringOr("status", "") == "measured") return 0;
  std::fprintf(stderr, "sgm-bench: every selected figure was skipped\n");
  return 1;
}
