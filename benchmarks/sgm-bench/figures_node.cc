// figures_node.cc — the node registry's figures (issue 13's targets; bodies
// in common/node.cc, shared with bench_node):
//  node.alloc_pair.registry  sgm_alloc+sgm_free with the registry on, against
//                            off: ratio <= 1.05 (the hot path touches no
//                            shared cache line)
//  node.join_leave           join + leave <= 1 ms (sgm_context_create + destroy,
//                            registry on), against the file-system floor of
//                            a record's creation and removal
//  node.reclaim              SIGKILL to reclaimed <= 1 s, against the period
//  node.smi_json.64          `sgm-smi --json` with 64 processes <= 50 ms,
//                            against fork + exec of /bin/true
#include "bodies.h"
#include "figure.h"

namespace sgm_bench {

namespace {

SGM_BENCH_FIGURE({"node.alloc_pair.registry", "sgm_alloc+sgm_free pair with the node registry on, 256 B-64 KiB",
                  "ns", "the same pairs with the registry off (SGM_NODE=off)", Better::kLower,
                  Target::Ratio(kAtMost, 1.05), kQuick, GbTime("node/alloc/on", BM_NodeAllocFree, {1}),
                  GbTime("node/alloc/off", BM_NodeAllocFree, {0})});

SGM_BENCH_FIGURE({"node.join_leave",
                  "join + leave the node registry: sgm_context_create + destroy (another context holds it open)",
                  "us",
                  "create + fallocate + write + lock + mmap + rename, unlink + munmap + close of a 1 KiB "
                  "record file in the registry folder", Better::kLower,
                  Target::Value(kAtMost, 1000),
                  kQuick, GbMeasure({"node/join_leave", BM_NodeJoinLeave, {}, 1, false, "", 1e-3, 0}),
                  GbMeasure({"node/open_map", BM_NodeOpenMap, {}, 1, false, "", 1e-3, 0})});

double Reclaim(const RunContext &, std::string *) { return NodeReclaimMs(5); }
double Period(const RunContext &, std::string *) { return 50; }
SGM_BENCH_FIGURE({"node.reclaim", "SIGKILL of a registered process to its record removed (ticker every 50 ms)",
                  "ms", "the ticker's period (SGM_NODE_PERIOD_MS)", Better::kLower,
                  Target::Value(kAtMost, 1000), kQuick, Reclaim, Period, 1});

double SmiJson(const RunContext &, std::string *skip) {
  if (!SmiPath()) {
    *skip = "sgm-smi not found next to sgm-bench nor in the build tree";
    return 0;
  }
  return NodeSmiJsonMs(64, 10, false);
}
double TrueCmd(const RunContext &, std::string *) { return NodeSmiJsonMs(0, 10, true); }
SGM_BENCH_FIGURE({"node.smi_json.64", "`sgm-smi --json` with 64 processes registered (fork + exec)", "ms",
                  "fork + exec of /bin/true", Better::kLower, Target::Value(kAtMost, 50), kQuick, SmiJson,
                  TrueCmd, 1});

}  // namespace

}  // namespace sgm_bench
