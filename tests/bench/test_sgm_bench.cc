// test_sgm_bench.cc — sgm-bench as a user runs it: one `--quick --json` run on
// the emulated device (tiny traces from tests/bench/traces, the spill folder in
// the build tree), then its file read back, compared and turned into Markdown.
// No timing is asserted: only that every figure is there, positive and in the
// documented shape, and that --compare flags exactly what moved the bad way.
//
// Environment (benchmarks/sgm-bench/CMakeLists.txt sets it): SGM_BENCH (the
// binary), SGM_BENCH_TRACES (the tiny traces), SGM_BENCH_TMP (a scratch
// folder), SGM_BENCH_DOCS (docs/, for the committed page), SGM_BENCH_FAKE_CUDA
// (the folder of the CUDA driver test double's libcuda.so.1).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "json.h"
#include "report.h"

// Last: cmocka.h needs the C headers above and defines macros (fail) that
// the C++ headers must not see.
extern "C" {
#include <cmocka.h>
}

using sgm_bench::Json;

namespace {

std::string Env(const char *k) {
  const char *v = std::getenv(k);
  if (!v || !*v) fail_msg("%s is not set (run through ctest)", k);
  return v;
}

struct Result {
  int status;          // exit status, or -1 when it did not exit
  std::string output;  // stdout and stderr together
};

Result Run(const std::string &args, const std::string &env = "") {
  std::string cmd = env + "'" + Env("SGM_BENCH") + "' " + args + " 2>&1";
  FILE *p = popen(cmd.c_str(), "r");
  if (!p) fail_msg("cannot run %s", cmd.c_str());
  Result r{-1, ""};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string Tmp(const std::string &name) { return Env("SGM_BENCH_TMP") + "/" + name; }

Json Read(const std::string &path) {
  Json doc;
  std::string err;
  if (!sgm_bench::JsonReadFile(path, &doc, &err)) fail_msg("%s", err.c_str());
  return doc;
}

void Write(const std::string &path, const Json &doc) {
  std::ofstream(path) << sgm_bench::JsonWrite(doc);
}

std::vector<std::string> Lines(const std::string &s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

// The quick run every test reads: made once, by the group setup.
Json g_quick;
std::string g_quick_path;

int SetupQuickRun(void **) {
  g_quick_path = Tmp("quick.json");
  std::remove(g_quick_path.c_str());
  Result r = Run("--quick --json '" + g_quick_path + "' --traces '" + Env("SGM_BENCH_TRACES") +
                 "' --spill-dir '" + Env("SGM_BENCH_TMP") + "'");
  std::printf("%s", r.output.c_str());
  if (r.status != 0) {
    std::printf("sgm-bench --quick exited with %d\n", r.status);
    return -1;
  }
  g_quick = Read(g_quick_path);
  return 0;
}

const Json *Figure(const Json &doc, const std::string &name) {
  for (const Json &f : doc.Get("figures")->arr)
    if (f.StringOr("name", "") == name) return &f;
  return nullptr;
}

// Invariant: a --quick --json run is a valid result file that holds every
// figure of the quick set, each measured and positive, or at least 0 for
// counts (unit "calls"), whose ratio is still positive (GPU figures alone may
// be skipped, and only where the machine has no GPU; disk figures only where
// the build folder's file system refuses O_DIRECT).
void test_quick_run_holds_every_quick_figure_measured(void **) {
  std::string fault = sgm_bench::CheckSchema(g_quick);
  if (!fault.empty()) fail_msg("schema: %s", fault.c_str());
  assert_string_equal(g_quick.StringOr("mode", "").c_str(), "quick");
  Result list = Run("--list");
  assert_int_equal(list.status, 0);
  int n_quick = 0;
  for (const std::string &l : Lines(list.output)) {
    std::istringstream in(l);
    std::string name, mode, needs;
    in >> name >> mode >> needs;
    if (mode != "quick") continue;
    n_quick++;
    const Json *f = Figure(g_quick, name);
    if (!f) fail_msg("quick figure %s is missing from the file", name.c_str());
    if (f->StringOr("status", "") != "measured") {
      std::string why = f->StringOr("skip_reason", "");
      bool gpu_less = needs == "gpu" && g_quick.Get("machine")->StringOr("gpu", "") == "none";
      bool no_direct_io = needs == "o_direct" && why.find("O_DIRECT") != std::string::npos;
      if (!gpu_less && !no_direct_io)
        fail_msg("%s was skipped: %s", name.c_str(), f->StringOr("skip_reason", "").c_str());
      continue;
    }
    const bool count = f->StringOr("unit", "") == "calls";
    assert_true(count ? f->NumberOr("value", -1) >= 0 : f->NumberOr("value", 0) > 0);
    assert_true(count ? f->NumberOr("reference", -1) >= 0 : f->NumberOr("reference", 0) > 0);
    assert_true(f->NumberOr("ratio", 0) > 0);
    assert_true(f->NumberOr("repetitions", 0) >= 1);
  }
  assert_true(n_quick >= 10);
  assert_int_equal(g_quick.Get("figures")->arr.size(), static_cast<size_t>(n_quick));
}

// Invariant: figures whose traces are missing are skipped with a message that
// names the folder, and the run still succeeds.
void test_missing_traces_are_skipped_with_a_message(void **) {
  std::string path = Tmp("notraces.json");
  Result r = Run("--quick --only suballoc --repetitions 1 --traces /nonexistent/sgm-traces --json '" + path + "'");
  assert_int_equal(r.status, 0);
  Json doc = Read(path);
  assert_string_equal(sgm_bench::CheckSchema(doc).c_str(), "");
  const Json *churn = Figure(doc, "suballoc.churn");
  assert_non_null(churn);
  assert_string_equal(churn->StringOr("status", "").c_str(), "measured");
  for (const char *name : {"suballoc.minimalloc.frag", "suballoc.minimalloc.replay"}) {
    const Json *f = Figure(doc, name);
    assert_non_null(f);
    assert_string_equal(f->StringOr("status", "").c_str(), "skipped");
    assert_non_null(std::strstr(f->StringOr("skip_reason", "").c_str(), "/nonexistent/sgm-traces"));
  }
  const char *line = "skipped suballoc.minimalloc.frag, suballoc.minimalloc.replay: no MiniMalloc traces";
  if (r.output.find(line) == std::string::npos) fail_msg("no line '%s' in:\n%s", line, r.output.c_str());
}

// Invariant: the allocation-stream figures replay every idealloc/*.csv of the
// trace folder through sgm_alloc/sgm_free; committed VRAM (growth) and the
// smallest budget with no fallback (reserve) can never be below the live
// bytes, so all four figures are measured, at least 1, the worst no better
// than the mean, against the ideal 1.
void test_alloc_stream_figures_replay_the_traces(void **) {
  std::string path = Tmp("streams.json");
  Result r = Run("--only alloc.stream --repetitions 1 --traces '" + Env("SGM_BENCH_TRACES") +
                 "' --json '" + path + "'");
  assert_int_equal(r.status, 0);
  Json doc = Read(path);
  assert_string_equal(sgm_bench::CheckSchema(doc).c_str(), "");
  for (const char *mode : {"growth", "reserve"}) {
    const Json *mean = Figure(doc, std::string("alloc.stream.") + mode);
    const Json *worst = Figure(doc, std::string("alloc.stream.") + mode + "_max");
    assert_non_null(mean);
    assert_non_null(worst);
    for (const Json *f : {mean, worst}) {
      if (f->StringOr("status", "") != "measured") fail_msg("%s", f->StringOr("skip_reason", "").c_str());
      assert_true(f->NumberOr("value", 0) >= 1.0);
      assert_true(f->NumberOr("reference", 0) == 1.0);
    }
    assert_true(worst->NumberOr("value", 0) >= mean->NumberOr("value", 0));
  }
}

// Invariant: against the CUDA driver test double (a libcuda.so.1 that models
// copies but not kernels), the GPU copy and per-call figures are measured and
// positive, and the kernel figure is skipped saying what the driver lacks.
// The driver-call counts (sgm's own) are what docs/streams.md promises: no
// call per steady-state pair on any stream (ratio 1 against PyTorch's 0), and
// exactly the two of "Why two calls" per transfer between blocking streams,
// 4 between non-blocking ones, and 4 per burst round of three sizes (item 6:
// the sizes the taker used cross at the first transfer).
void test_gpu_figures_run_on_the_driver_double(void **) {
  if (!std::getenv("SGM_BENCH_FAKE_CUDA")) {
    print_message("# no CUDA driver test double in this build (no CUDA headers): skipped\n");
    skip();
  }
  std::string path = Tmp("gpu.json");
  Result r = Run("--quick --only gpu --repetitions 1 --json '" + path + "'",
                 "LD_LIBRARY_PATH='" + Env("SGM_BENCH_FAKE_CUDA") + "' BENCH_CUDA_MAX_MIB=64 ");
  assert_int_equal(r.status, 0);
  Json doc = Read(path);
  assert_string_equal(sgm_bench::CheckSchema(doc).c_str(), "");
  assert_non_null(std::strstr(doc.Get("machine")->StringOr("gpu", "").c_str(), "test double"));
  int measured = 0;
  for (const Json &f : doc.Get("figures")->arr) {
    std::string name = f.StringOr("name", "");
    assert_int_equal(name.compare(0, 4, "gpu."), 0);
    if (name == "gpu.kernel.shared") {
      assert_string_equal(f.StringOr("status", "").c_str(), "skipped");
      assert_non_null(std::strstr(f.StringOr("skip_reason", "").c_str(), "cuModuleLoadData"));
      continue;
    }
    if (f.StringOr("status", "") != "measured") fail_msg("%s: %s", name.c_str(), f.StringOr("skip_reason", "").c_str());
    measured++;
    if (name.compare(0, 10, "gpu.calls.") != 0) continue;
    assert_string_equal(f.StringOr("unit", "").c_str(), "calls");
    /* Non-blocking streams: both asked about capture, a record and a wait
     * (docs/streams.md, "Why two calls"); no target. */
    const bool nb = name == "gpu.calls.transfer.non_blocking", burst = name == "gpu.calls.transfer.burst";
    assert_string_equal(f.StringOr("verdict", "").c_str(), nb ? "none" : "met");
    const double want = nb || burst ? 4 : name == "gpu.calls.transfer" ? 2 : 0;
    if (f.NumberOr("value", -1) != want) fail_msg("%s: %g driver calls, not %g", name.c_str(), f.NumberOr("value", -1), want);
    if (!nb && !burst) assert_true(f.NumberOr("ratio", 0) == 1.0);
  }
  assert_int_equal(measured, 11);  // copies both ways, pairs on three streams, their calls, transfer calls (3)
}

int CountRegressions(const std::string &out, std::string *flagged) {
  int n = 0;
  for (const std::string &l : Lines(out))
    if (l.find("REGRESSION") != std::string::npos) {
      n++;
      *flagged = l.substr(0, l.find(' '));
    }
  return n;
}

// Invariant: a run compared with itself shows no regression (exit status 0).
void test_compare_with_itself_reports_no_regression(void **) {
  Result r = Run("--compare '" + g_quick_path + "' '" + g_quick_path + "'");
  assert_int_equal(r.status, 0);
  std::string flagged;
  assert_int_equal(CountRegressions(r.output, &flagged), 0);
  assert_non_null(std::strstr(r.output.c_str(), "0 regressions beyond the noise band"));
}

// Move one figure's ratio (and every repetition of it) by factor.
void Scale(Json *f, double factor) {
  for (const char *k : {"value", "ratio", "ratio_min", "ratio_max"}) f->Set(k, Json::Number(f->NumberOr(k, 0) * factor));
  for (Json &x : f->Get("values")->arr) x.num *= factor;
}

// Invariant: a doctored copy — one figure worse, another better, each by more
// than twice their noise band — shows exactly the worse one as a regression
// (exit status 1); compared the other way round, exactly the other one.
void test_compare_flags_exactly_the_doctored_figure(void **) {
  Json doc = g_quick;
  std::vector<Json *> measured;
  for (Json &f : doc.Get("figures")->arr)
    if (f.StringOr("status", "") == "measured") measured.push_back(&f);
  assert_true(measured.size() >= 2);
  Json *worse = measured[0], *better = measured[measured.size() / 2];
  auto factor = [](const Json &f, bool make_worse) {
    double move = 0.5 + 4 * f.NumberOr("spread", 0);  // past twice the band: 2 x (spread + spread)
    bool lower_is_better = f.StringOr("better", "") == "lower";
    return make_worse == lower_is_better ? 1 + move : 1 / (1 + move);
  };
  Scale(worse, factor(*worse, true));
  Scale(better, factor(*better, false));
  std::string worse_name = worse->StringOr("name", ""), better_name = better->StringOr("name", "");
  std::string doctored = Tmp("doctored.json");
  Write(doctored, doc);
  assert_string_equal(sgm_bench::CheckSchema(Read(doctored)).c_str(), "");

  Result r = Run("--compare '" + g_quick_path + "' '" + doctored + "'");
  std::string flagged;
  assert_int_equal(CountRegressions(r.output, &flagged), 1);
  assert_string_equal(flagged.c_str(), worse_name.c_str());
  assert_int_equal(r.status, 1);

  r = Run("--compare '" + doctored + "' '" + g_quick_path + "'");
  assert_int_equal(CountRegressions(r.output, &flagged), 1);
  assert_string_equal(flagged.c_str(), better_name.c_str());
  assert_int_equal(r.status, 1);
}

// Invariant: the schema check refuses a document missing a required member,
// holding a non-positive figure or a ratio outside its repetitions' range.
void test_schema_check_refuses_broken_documents(void **) {
  Json doc = g_quick;
  assert_string_equal(sgm_bench::CheckSchema(doc).c_str(), "");
  Json *f = nullptr;
  for (Json &x : doc.Get("figures")->arr)
    if (x.StringOr("status", "") == "measured") f = &x;
  assert_non_null(f);
  Json saved = *f;
  f->Set("value", Json::Number(0));
  assert_string_not_equal(sgm_bench::CheckSchema(doc).c_str(), "");
  *f = saved;
  f->Set("ratio", Json::Number(f->NumberOr("ratio_max", 0) * 2));
  assert_string_not_equal(sgm_bench::CheckSchema(doc).c_str(), "");
  *f = saved;
  f->obj.erase(f->obj.begin());  // "name"
  assert_string_not_equal(sgm_bench::CheckSchema(doc).c_str(), "");
  *f = saved;
  doc.Get("machine")->Set("cores", Json::String("two"));
  assert_string_not_equal(sgm_bench::CheckSchema(doc).c_str(), "");
}

// Invariant: --compare and --markdown refuse, with exit status 2 and a message
// naming the file, input that is not JSON or not a result file.
void test_unreadable_inputs_are_refused(void **) {
  std::string junk = Tmp("junk.json"), other = Tmp("other.json");
  std::ofstream(junk) << "{\"schema\": \"sgm-bench/1\", \"figures\": [1, 2,";
  std::ofstream(other) << "{\"schema\": \"something-else\"}";
  Result r = Run("--compare '" + g_quick_path + "' '" + junk + "'");
  assert_int_equal(r.status, 2);
  assert_non_null(std::strstr(r.output.c_str(), "junk.json: not JSON"));
  r = Run("--compare '" + other + "' '" + g_quick_path + "'");
  assert_int_equal(r.status, 2);
  assert_non_null(std::strstr(r.output.c_str(), "not an sgm-bench result file"));
  r = Run("--markdown '" + other + "'");
  assert_int_equal(r.status, 2);
}

// Invariant: the page --markdown makes of any run names every figure of
// --list: measured, skipped with its reason, or listed as not in the run
// (here: a --quick run, which leaves the full-run figures out).
void test_markdown_shows_every_listed_figure(void **) {
  Result list = Run("--list");
  assert_int_equal(list.status, 0);
  Result page = Run("--markdown '" + g_quick_path + "'");
  assert_int_equal(page.status, 0);
  int n = 0, absent = 0;
  for (const std::string &l : Lines(list.output)) {
    std::istringstream in(l);
    std::string name, mode;
    in >> name >> mode;
    if (name.empty()) continue;
    n++;
    if (page.output.find("`" + name + "`") == std::string::npos)
      fail_msg("%s (--list) is not on the --markdown page", name.c_str());
    absent += mode != "quick";
  }
  assert_true(n >= 10);
  assert_true(absent > 0);
  assert_non_null(std::strstr(page.output.c_str(), "Not in this run"));
}

// Invariant: docs/benchmarks.md is exactly what --markdown makes of the run
// committed beside it (docs/benchmarks.json): the page cannot drift from the tool.
void test_published_page_is_generated_from_its_run(void **) {
  std::string docs = Env("SGM_BENCH_DOCS");
  Result r = Run("--markdown '" + docs + "/benchmarks.json'");
  assert_int_equal(r.status, 0);
  std::ifstream in(docs + "/benchmarks.md");
  std::stringstream page;
  page << in.rdbuf();
  if (r.output != page.str())
    fail_msg("docs/benchmarks.md differs from `sgm-bench --markdown docs/benchmarks.json`: regenerate it");
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_quick_run_holds_every_quick_figure_measured),
      cmocka_unit_test(test_markdown_shows_every_listed_figure),
      cmocka_unit_test(test_missing_traces_are_skipped_with_a_message),
      cmocka_unit_test(test_alloc_stream_figures_replay_the_traces),
      cmocka_unit_test(test_gpu_figures_run_on_the_driver_double),
      cmocka_unit_test(test_compare_with_itself_reports_no_regression),
      cmocka_unit_test(test_compare_flags_exactly_the_doctored_figure),
      cmocka_unit_test(test_schema_check_refuses_broken_documents),
      cmocka_unit_test(test_unreadable_inputs_are_refused),
      cmocka_unit_test(test_published_page_is_generated_from_its_run),
  };
  return cmocka_run_group_tests(tests, SetupQuickRun, nullptr);
}
