// run.h — running figures and describing the machine (run.cc).
#ifndef SGM_BENCH_RUN_H
#define SGM_BENCH_RUN_H

#include <string>
#include <vector>

#include "figure.h"
#include "json.h"

namespace sgm_bench {

struct RunOptions {
  RunContext rc;                    // what the measures see
  int repetitions = 5;              // per figure, unless the figure says 1
  std::vector<std::string> only;    // --only: names or name prefixes ("alloc" = alloc.*); empty = all
  bool progress = false;            // progress lines on stderr
};

// The figures a run with these options measures, in order (quick mode keeps
// the kQuick ones; --only keeps the matching ones).
std::vector<const Figure *> SelectFigures(const RunOptions &o);
// True when name is selected by one of the --only patterns.
bool MatchesOnly(const std::string &name, const std::vector<std::string> &only);

// Measure every selected figure; the whole run as the JSON document of
// docs/sgm-bench.md (schema "sgm-bench/1").
Json RunFigures(const RunOptions &o, const std::vector<const Figure *> &figs);

// CPU, cores, RAM, GPU, driver, backend, kernel, load: the "machine" object.
Json MachineFacts();

}  // namespace sgm_bench

#endif  // SGM_BENCH_RUN_H
