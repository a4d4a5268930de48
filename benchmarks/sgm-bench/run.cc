// run.cc — the figure registry, one Google Benchmark run of a body with a
// reporter that keeps the numbers (nothing reaches stdout), the repetition
// loop (sgm then its reference, back to back, per repetition) and the
// machine facts every result file carries.
//
// Threading: everything runs on the main thread, except the bodies, which
// run on Google Benchmark's threads inside RunSpecifiedBenchmarks.
#include "run.h"

#include <dlfcn.h>
#include <sys/sysinfo.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>

#include "sgm.h"

namespace sgm_bench {

namespace {

std::vector<Figure> &Registry() {
  static std::vector<Figure> figures;
  return figures;
}

// Keeps the runs Google Benchmark reports; prints nothing.
class Collector : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context &) override { return true; }
  void ReportRuns(const std::vector<Run> &runs) override {
    for (const Run &r : runs) runs_.push_back(r);
  }
  std::vector<Run> runs_;  // every run reported, in order
};

}  // namespace

bool RegisterFigure(Figure f) {
  auto &r = Registry();
  auto at = std::lower_bound(r.begin(), r.end(), f.name,
                             [](const Figure &a, const std::string &n) { return a.name < n; });
  if (at != r.end() && at->name == f.name) {
    std::fprintf(stderr, "sgm-bench: figure %s registered twice\n", f.name.c_str());
    std::abort();
  }
  r.insert(at, std::move(f));
  return true;
}

const std::vector<Figure> &Figures() { return Registry(); }

double RunGb(const Gb &g, const RunContext &rc, std::string *skip) {
  benchmark::ClearRegisteredBenchmarks();
  benchmark::internal::Benchmark *b = benchmark::RegisterBenchmark(g.label.c_str(), g.body);
  if (!g.args.empty()) b->Args(g.args);
  double min_time = rc.min_time_s;
  if (g.max_min_time_s > 0) min_time = std::min(min_time, g.max_min_time_s);
  b->Threads(g.threads)->Unit(benchmark::kNanosecond);
  if (g.iterations > 0)
    b->Iterations(g.iterations);
  else
    b->MinTime(min_time);
  if (g.manual_time)
    b->UseManualTime();
  else
    b->UseRealTime();
  Collector c;
  benchmark::RunSpecifiedBenchmarks(&c);
  benchmark::ClearRegisteredBenchmarks();
  if (c.runs_.empty()) {
    *skip = g.label + ": Google Benchmark reported no run";
    return 0;
  }
  const benchmark::BenchmarkReporter::Run &r = c.runs_.back();
  if (r.error_occurred) {
    *skip = g.label + ": " + r.error_message;
    return 0;
  }
  if (g.counter.empty()) return r.GetAdjustedRealTime() * g.scale;
  auto it = r.counters.find(g.counter);
  if (it == r.counters.end()) {
    *skip = g.label + ": no counter " + g.counter;
    return 0;
  }
  return it->second.value * g.scale;
}

bool MatchesOnly(const std::string &name, const std::vector<std::string> &only) {
  if (only.empty()) return true;
  for (const std::string &p : only)
    if (name == p || (name.size() > p.size() && name.compare(0, p.size(), p) == 0 && name[p.size()] == '.'))
      return true;
  return false;
}

std::vector<const Figure *> SelectFigures(const RunOptions &o) {
  std::vector<const Figure *> v;
  for (const Figure &f : Figures())
    if ((!o.rc.quick || f.mode == kQuick) && MatchesOnly(f.name, o.only)) v.push_back(&f);
  return v;
}

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

Json Numbers(const std::vector<double> &v) {
  Json a = Json::Array();
  for (double x : v) a.Push(Json::Number(x));
  return a;
}

bool Meets(const Target &t, double x) { return t.bound == kAtMost ? x <= t.limit : x >= t.limit; }

Json TargetJson(const Target &t) {
  if (t.kind == Target::kNone) return Json();
  return Json::Object()
      .Set("on", Json::String(t.kind == Target::kValue ? "value" : "ratio"))
      .Set("op", Json::String(t.bound == kAtMost ? "<=" : ">="))
      .Set("limit", Json::Number(t.limit));
}

void Progress(const RunOptions &o, size_t k, size_t n, const Figure &f, int rep, int reps) {
  if (!o.progress) return;
  std::fprintf(stderr, "\r\033[K[%zu/%zu] %s  repetition %d/%d", k + 1, n, f.name.c_str(), rep + 1, reps);
  std::fflush(stderr);
}

// One figure: the repetitions, then its result object.
Json RunOne(const RunOptions &o, const Figure &f, size_t k, size_t n) {
  Json r = Json::Object()
               .Set("name", Json::String(f.name))
               .Set("what", Json::String(f.what))
               .Set("unit", Json::String(f.unit))
               .Set("reference_is", Json::String(f.reference))
               .Set("better", Json::String(f.better == Better::kLower ? "lower" : "higher"))
               .Set("target", TargetJson(f.target));
  const int reps = f.repetitions > 0 ? f.repetitions : o.repetitions;
  std::vector<double> values, refs, ratios;
  std::string skip;
  for (int i = 0; i < reps && skip.empty(); i++) {
    Progress(o, k, n, f, i, reps);
    double v = f.sgm(o.rc, &skip);
    if (!skip.empty()) break;
    double x = f.ref(o.rc, &skip);
    if (!skip.empty()) break;
    const bool count = IsCount(f.unit);  // counts may be 0 (figure.h)
    if (!(count ? v >= 0 && x >= 0 : v > 0 && x > 0) || !std::isfinite(v) || !std::isfinite(x)) {
      char b[160];
      std::snprintf(b, sizeof b, "measured a %s figure (sgm %g, reference %g)",
                    count ? "negative count:" : "non-positive", v, x);
      skip = b;
      break;
    }
    values.push_back(v);
    refs.push_back(x);
    ratios.push_back(count ? (v + 1) / (x + 1) : v / x);
  }
  if (!skip.empty()) {
    r.Set("status", Json::String("skipped")).Set("skip_reason", Json::String(skip))
        .Set("verdict", Json::String("skipped"));
    return r;
  }
  const double value = Median(values), ref = Median(refs), ratio = Median(ratios);
  const double lo = *std::min_element(ratios.begin(), ratios.end());
  const double hi = *std::max_element(ratios.begin(), ratios.end());
  std::string verdict = "none";
  if (f.target.kind != Target::kNone)
    verdict = Meets(f.target, f.target.kind == Target::kValue ? value : ratio) ? "met" : "missed";
  r.Set("status", Json::String("measured"))
      .Set("value", Json::Number(value))
      .Set("reference", Json::Number(ref))
      .Set("ratio", Json::Number(ratio))
      .Set("verdict", Json::String(verdict))
      .Set("repetitions", Json::Number(reps))
      .Set("ratio_min", Json::Number(lo))
      .Set("ratio_max", Json::Number(hi))
      .Set("spread", Json::Number((hi - lo) / 2 / ratio))
      .Set("values", Numbers(values))
      .Set("references", Numbers(refs));
  return r;
}

std::string NowUtc() {
  std::time_t t = std::time(nullptr);
  std::tm tm;
  gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

}  // namespace

Json RunFigures(const RunOptions &o, const std::vector<const Figure *> &figs) {
  auto t0 = std::chrono::steady_clock::now();
  Json doc = Json::Object()
                 .Set("schema", Json::String("sgm-bench/1"))
                 .Set("sgm_version", Json::String(std::to_string(SGM_VERSION_MAJOR) + "." +
                                                  std::to_string(SGM_VERSION_MINOR) + "." +
                                                  std::to_string(SGM_VERSION_PATCH)))
                 .Set("mode", Json::String(o.rc.quick ? "quick" : "full"))
                 .Set("started_utc", Json::String(NowUtc()))
                 .Set("machine", MachineFacts())
                 .Set("traces_dir", Json::String(o.rc.traces_dir))
                 .Set("spill_dir", Json::String(o.rc.spill_dir))
                 .Set("repetitions", Json::Number(o.repetitions))
                 .Set("min_time_s", Json::Number(o.rc.min_time_s));
  Json arr = Json::Array();
  for (size_t k = 0; k < figs.size(); k++) arr.Push(RunOne(o, *figs[k], k, figs.size()));
  if (o.progress) std::fprintf(stderr, "\r\033[K");
  doc.Set("figures", std::move(arr));
  double load[1];
  if (getloadavg(load, 1) == 1) doc.Set("load_1min_end", Json::Number(std::round(load[0] * 100) / 100));
  doc.Set("seconds", Json::Number(std::round(std::chrono::duration<double>(
                                                 std::chrono::steady_clock::now() - t0).count() * 10) / 10));
  return doc;
}

// ---- machine facts ----

namespace {

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.compare(0, 10, "model name") == 0) {
      size_t c = line.find(':');
      if (c != std::string::npos) return line.substr(line.find_first_not_of(' ', c + 1));
    }
  struct utsname u;
  return uname(&u) == 0 ? std::string(u.machine) : "unknown";
}

// The CUDA device sgm would open (SGM_DEVICE, default 0) and the driver's API
// version, asked of libcuda.so.1 directly (dlopen'ed, as sgm's backend does);
// gpu "none" and why, when there is none.
void GpuFacts(Json *m) {
  using Fn0 = int (*)(int *);
  using FnInit = int (*)(unsigned);
  using FnGet = int (*)(int *, int);
  using FnName = int (*)(char *, int, int);
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    m->Set("gpu", Json::String("none")).Set("driver", Json::String("none"))
        .Set("gpu_note", Json::String("libcuda.so.1 could not be loaded: no NVIDIA driver"));
    return;
  }
  auto version = reinterpret_cast<Fn0>(dlsym(lib, "cuDriverGetVersion"));
  auto init = reinterpret_cast<FnInit>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<Fn0>(dlsym(lib, "cuDeviceGetCount"));
  auto get = reinterpret_cast<FnGet>(dlsym(lib, "cuDeviceGet"));
  auto name = reinterpret_cast<FnName>(dlsym(lib, "cuDeviceGetName"));
  int v = 0, n = 0, dev = 0;
  const char *env = std::getenv("SGM_DEVICE");
  int ordinal = env ? std::atoi(env) : 0;
  char buf[256] = "";
  if (version && version(&v) == 0) {
    char d[32];
    std::snprintf(d, sizeof d, "CUDA %d.%d", v / 1000, v % 1000 / 10);
    m->Set("driver", Json::String(d));
  } else {
    m->Set("driver", Json::String("unknown"));
  }
  if (init && count && get && name && init(0) == 0 && count(&n) == 0 && n > ordinal &&
      get(&dev, ordinal) == 0 && name(buf, sizeof buf, dev) == 0) {
    m->Set("gpu", Json::String(buf));
  } else {
    m->Set("gpu", Json::String("none"))
        .Set("gpu_note", Json::String("the driver loaded but reports no usable device " +
                                      std::to_string(ordinal)));
  }
  dlclose(lib);
}

}  // namespace

Json MachineFacts() {
  Json m = Json::Object();
  m.Set("cpu", Json::String(CpuModel()));
  m.Set("cores", Json::Number(static_cast<double>(sysconf(_SC_NPROCESSORS_ONLN))));
  struct sysinfo si;
  double ram = sysinfo(&si) == 0 ? static_cast<double>(si.totalram) * si.mem_unit : 0;
  m.Set("ram_bytes", Json::Number(ram));
  GpuFacts(&m);
  const char *be = std::getenv("SGM_BACKEND");
  m.Set("backend", Json::String(be && *be ? be : "emu"));
  struct utsname u;
  if (uname(&u) == 0) m.Set("kernel", Json::String(std::string(u.sysname) + " " + u.release));
  double load[3];
  if (getloadavg(load, 3) == 3) m.Set("load_1min", Json::Number(std::round(load[0] * 100) / 100));
  return m;
}

}  // namespace sgm_bench
