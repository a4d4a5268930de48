// report.h — what sgm-bench makes of a result document (schema "sgm-bench/1",
// docs/sgm-bench.md): the terminal table, the comparison of two runs and the
// Markdown page docs/benchmarks.md. No Google Benchmark here: the tests link
// this and json.h alone.
#ifndef SGM_BENCH_REPORT_H
#define SGM_BENCH_REPORT_H

#include <cstdio>
#include <string>
#include <vector>

#include "json.h"

namespace sgm_bench {

// The unit of count figures (figure.h): value and reference may be 0, and the
// ratio is (value + 1) / (reference + 1).
inline constexpr const char *kCountUnit = "calls";
inline bool IsCount(const std::string &unit) { return unit == kCountUnit; }

// The table: figure, sgm, reference, ratio (and its spread), target, verdict;
// then one line per skipped figure saying why.
void PrintTable(const Json &doc, FILE *out);

// The figures of a and b side by side with the change in each ratio. A
// regression: b's ratio moved the bad way by more than the noise band, the
// sum of both runs' spreads (relative half-ranges of the per-repetition
// ratios). Returns the number of regressions, or -1 (with *err) when either
// document is not a result file.
int Compare(const Json &a, const Json &b, FILE *out, std::string *err);

// A figure the tool knows (sgm-bench --list): its name and what it measures.
struct KnownFigure {
  std::string name;  // the figure's stable name
  std::string what;  // one line: what is measured
  bool quick;        // part of --quick runs
};

// docs/benchmarks.md from one run. Every figure of `known` that the run does
// not hold (a --quick run, an --only run, a run older than the figure) is
// listed as not measured, so that the page shows every figure of --list.
std::string Markdown(const Json &doc, const std::vector<KnownFigure> &known = {});

// "" when doc has the shape of a result file (every required member, of its
// type; measured figures positive, counts at least 0); else the first fault.
std::string CheckSchema(const Json &doc);

}  // namespace sgm_bench

#endif  // SGM_BENCH_REPORT_H
