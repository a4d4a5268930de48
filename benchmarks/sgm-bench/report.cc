// report.cc — the table, the comparison and the Markdown page, all read from
// a result document so that the terminal, --compare and docs/benchmarks.md
// show the same numbers; and the schema check that --compare, --markdown and
// the tests run on every document they read.
#include "report.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <vector>

namespace sgm_bench {

namespace {

// Three significant digits, no exponent for everyday magnitudes.
std::string Fmt(double x) {
  char b[48];
  double a = std::fabs(x);
  if (a >= 100)
    std::snprintf(b, sizeof b, "%.0f", x);
  else if (a >= 10)
    std::snprintf(b, sizeof b, "%.1f", x);
  else if (a >= 1)
    std::snprintf(b, sizeof b, "%.2f", x);
  else if (a >= 0.001 || a == 0)
    std::snprintf(b, sizeof b, "%.3f", x);
  else
    std::snprintf(b, sizeof b, "%.3g", x);
  return b;
}

std::string Pct(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f%%", 100 * x);
  return b;
}

// "<= 80 ns", "ratio >= 0.9", "-" (markdown: the symbols ≤ and ≥).
std::string TargetText(const Json &f, bool md) {
  const Json *t = f.Get("target");
  if (!t || t->type != Json::kObject) return md ? "—" : "-";
  std::string op = t->StringOr("op", "?");
  if (md) op = op == "<=" ? "≤" : "≥";
  std::string limit = Fmt(t->NumberOr("limit", 0));
  if (t->StringOr("on", "") == "ratio") return "ratio " + op + " " + limit;
  return op + " " + limit + " " + f.StringOr("unit", "");
}

std::string WithUnit(const Json &f, const char *member) {
  return Fmt(f.NumberOr(member, 0)) + " " + f.StringOr("unit", "");
}

const Json *FiguresOf(const Json &doc) {
  const Json *f = doc.Get("figures");
  return f && f->type == Json::kArray ? f : nullptr;
}

bool Measured(const Json &f) { return f.StringOr("status", "") == "measured"; }

std::string Fault(const std::string &where, const std::string &what) { return where + ": " + what; }

std::string CheckMember(const Json &o, const std::string &where, const char *k, Json::Type t) {
  const Json *x = o.Get(k);
  if (!x) return Fault(where, std::string("no member \"") + k + "\"");
  if (x->type != t) return Fault(where, std::string("\"") + k + "\" has the wrong type");
  return "";
}

}  // namespace

std::string CheckSchema(const Json &doc) {
  if (doc.type != Json::kObject) return "the document is not a JSON object";
  if (doc.StringOr("schema", "") != "sgm-bench/1")
    return "\"schema\" is not \"sgm-bench/1\" (not an sgm-bench result file, or a newer one)";
  std::string e;
  for (const char *k : {"sgm_version", "mode", "started_utc", "traces_dir", "spill_dir"})
    if (!(e = CheckMember(doc, "top level", k, Json::kString)).empty()) return e;
  for (const char *k : {"repetitions", "min_time_s", "seconds"})
    if (!(e = CheckMember(doc, "top level", k, Json::kNumber)).empty()) return e;
  if (!(e = CheckMember(doc, "top level", "machine", Json::kObject)).empty()) return e;
  if (!(e = CheckMember(doc, "top level", "figures", Json::kArray)).empty()) return e;
  const Json &m = *doc.Get("machine");
  for (const char *k : {"cpu", "gpu", "driver", "backend"})
    if (!(e = CheckMember(m, "machine", k, Json::kString)).empty()) return e;
  for (const char *k : {"cores", "ram_bytes"}) {
    if (!(e = CheckMember(m, "machine", k, Json::kNumber)).empty()) return e;
    if (!(m.Get(k)->num > 0)) return Fault("machine", std::string("\"") + k + "\" is not positive");
  }
  std::set<std::string> names;
  for (const Json &f : doc.Get("figures")->arr) {
    if (f.type != Json::kObject) return "an entry of \"figures\" is not an object";
    std::string where = "figure " + f.StringOr("name", "?");
    for (const char *k : {"name", "what", "unit", "reference_is", "better", "status", "verdict"})
      if (!(e = CheckMember(f, where, k, Json::kString)).empty()) return e;
    if (!names.insert(f.StringOr("name", "")).second) return Fault(where, "appears twice");
    std::string better = f.StringOr("better", "");
    if (better != "lower" && better != "higher") return Fault(where, "\"better\" is neither lower nor higher");
    const Json *t = f.Get("target");
    if (!t) return Fault(where, "no member \"target\"");
    if (t->type != Json::kNull) {
      if (t->type != Json::kObject) return Fault(where, "\"target\" is neither null nor an object");
      std::string on = t->StringOr("on", ""), op = t->StringOr("op", "");
      if ((on != "value" && on != "ratio") || (op != "<=" && op != ">=") || !t->Get("limit") ||
          t->Get("limit")->type != Json::kNumber)
        return Fault(where, "\"target\" needs on (value|ratio), op (<=|>=) and a numeric limit");
    }
    std::string status = f.StringOr("status", ""), verdict = f.StringOr("verdict", "");
    if (status == "skipped") {
      if ((e = CheckMember(f, where, "skip_reason", Json::kString)).size()) return e;
      if (f.Get("skip_reason")->str.empty()) return Fault(where, "skipped without a reason");
      if (verdict != "skipped") return Fault(where, "skipped but its verdict is not \"skipped\"");
      continue;
    }
    if (status != "measured") return Fault(where, "\"status\" is neither measured nor skipped");
    if (verdict != "met" && verdict != "missed" && verdict != "none")
      return Fault(where, "\"verdict\" is not met, missed or none");
    if ((verdict == "none") != (t->type == Json::kNull)) return Fault(where, "a verdict without a target, or the reverse");
    // Counts (unit "calls") may be 0 in value and reference; ratios never are.
    const bool count = IsCount(f.StringOr("unit", ""));
    for (const char *k : {"value", "reference", "ratio", "ratio_min", "ratio_max", "repetitions"}) {
      if (!(e = CheckMember(f, where, k, Json::kNumber)).empty()) return e;
      const bool may_be_zero = count && (std::string(k) == "value" || std::string(k) == "reference");
      if (!(may_be_zero ? f.Get(k)->num >= 0 : f.Get(k)->num > 0))
        return Fault(where, std::string("\"") + k + "\" is not " + (may_be_zero ? "a count" : "positive"));
    }
    if (!(e = CheckMember(f, where, "spread", Json::kNumber)).empty()) return e;
    if (f.Get("spread")->num < 0) return Fault(where, "\"spread\" is negative");
    double lo = f.Get("ratio_min")->num, hi = f.Get("ratio_max")->num, r = f.Get("ratio")->num;
    if (!(lo <= r && r <= hi)) return Fault(where, "\"ratio\" lies outside [ratio_min, ratio_max]");
    for (const char *k : {"values", "references"}) {
      if (!(e = CheckMember(f, where, k, Json::kArray)).empty()) return e;
      if (f.Get(k)->arr.size() != static_cast<size_t>(f.Get("repetitions")->num))
        return Fault(where, std::string("\"") + k + "\" does not hold one number per repetition");
      for (const Json &x : f.Get(k)->arr)
        if (x.type != Json::kNumber || !(count ? x.num >= 0 : x.num > 0))
          return Fault(where, std::string("\"") + k + "\" holds a " + (count ? "negative" : "non-positive") + " entry");
    }
  }
  return "";
}

void PrintTable(const Json &doc, FILE *out) {
  const Json *figs = FiguresOf(doc);
  if (!figs) return;
  std::fprintf(out, "%-32s %14s %14s %8s %7s %18s  %s\n", "figure", "sgm", "reference", "ratio", "spread",
               "target", "verdict");
  for (const Json &f : figs->arr) {
    if (!Measured(f)) continue;
    std::fprintf(out, "%-32s %14s %14s %8s %7s %18s  %s\n", f.StringOr("name", "?").c_str(),
                 WithUnit(f, "value").c_str(), WithUnit(f, "reference").c_str(),
                 Fmt(f.NumberOr("ratio", 0)).c_str(), ("±" + Pct(f.NumberOr("spread", 0))).c_str(),
                 TargetText(f, false).c_str(), f.StringOr("verdict", "?").c_str());
  }
  // One line per reason: "no CUDA device" once for every GPU figure.
  std::vector<std::pair<std::string, std::string>> skipped;  // reason, names
  for (const Json &f : figs->arr) {
    if (Measured(f)) continue;
    std::string why = f.StringOr("skip_reason", "?"), name = f.StringOr("name", "?");
    auto it = std::find_if(skipped.begin(), skipped.end(), [&](const auto &p) { return p.first == why; });
    if (it == skipped.end())
      skipped.emplace_back(why, name);
    else
      it->second += ", " + name;
  }
  for (const auto &p : skipped) std::fprintf(out, "skipped %s: %s\n", p.second.c_str(), p.first.c_str());
}

int Compare(const Json &a, const Json &b, FILE *out, std::string *err) {
  for (const Json *d : {&a, &b}) {
    std::string e = CheckSchema(*d);
    if (!e.empty()) {
      *err = (d == &a ? "A: " : "B: ") + e;
      return -1;
    }
  }
  const Json *fa = FiguresOf(a), *fb = FiguresOf(b);
  std::map<std::string, const Json *> in_b;
  for (const Json &f : fb->arr) in_b[f.StringOr("name", "")] = &f;
  std::fprintf(out, "A: %s, %s run, %s, load %s\n", a.StringOr("started_utc", "?").c_str(),
               a.StringOr("mode", "?").c_str(), a.Get("machine")->StringOr("cpu", "?").c_str(),
               Fmt(a.Get("machine")->NumberOr("load_1min", 0)).c_str());
  std::fprintf(out, "B: %s, %s run, %s, load %s\n", b.StringOr("started_utc", "?").c_str(),
               b.StringOr("mode", "?").c_str(), b.Get("machine")->StringOr("cpu", "?").c_str(),
               Fmt(b.Get("machine")->NumberOr("load_1min", 0)).c_str());
  std::fprintf(out, "%-32s %9s %9s %8s %8s  %-16s %s\n", "figure", "A ratio", "B ratio", "change", "noise",
               "verdict A -> B", "");
  int regressions = 0;
  std::set<std::string> seen;
  for (const Json &x : fa->arr) {
    std::string name = x.StringOr("name", "");
    seen.insert(name);
    auto it = in_b.find(name);
    if (it == in_b.end()) {
      std::fprintf(out, "%-32s only in A\n", name.c_str());
      continue;
    }
    const Json &y = *it->second;
    if (!Measured(x) || !Measured(y)) {
      std::fprintf(out, "%-32s skipped in %s\n", name.c_str(), !Measured(x) && !Measured(y) ? "both" : !Measured(x) ? "A" : "B");
      continue;
    }
    double ra = x.NumberOr("ratio", 0), rb = y.NumberOr("ratio", 0);
    double change = (rb - ra) / ra;
    double band = x.NumberOr("spread", 0) + y.NumberOr("spread", 0);
    bool worse = y.StringOr("better", "lower") == "lower" ? change > 0 : change < 0;
    bool regression = worse && std::fabs(change) > band;
    regressions += regression;
    std::string verdicts = x.StringOr("verdict", "?") + " -> " + y.StringOr("verdict", "?");
    std::fprintf(out, "%-32s %9s %9s %8s %8s  %-16s %s\n", name.c_str(), Fmt(ra).c_str(), Fmt(rb).c_str(),
                 ((change >= 0 ? "+" : "") + Pct(change)).c_str(), ("±" + Pct(band)).c_str(), verdicts.c_str(),
                 regression ? "REGRESSION" : "");
  }
  for (const Json &y : fb->arr)
    if (!seen.count(y.StringOr("name", ""))) std::fprintf(out, "%-32s only in B\n", y.StringOr("name", "").c_str());
  std::fprintf(out, "%d regression%s beyond the noise band\n", regressions, regressions == 1 ? "" : "s");
  return regressions;
}

std::string Markdown(const Json &doc, const std::vector<KnownFigure> &known) {
  const Json &m = *doc.Get("machine");
  std::string s;
  char b[512];
  s += "# Benchmarks\n\n";
  s += "<!-- Generated by `sgm-bench --markdown docs/benchmarks.json` from the run saved there; "
       "change benchmarks/sgm-bench/, not this page (tests/bench checks that they agree). -->\n\n";
  s += "Every figure is sgm's number beside its reference, measured in the same run, back to back in each\n"
       "repetition, on a machine shared with other work: read the ratios, not the absolutes. Value,\n"
       "reference and ratio are medians over the repetitions (the ratio is the median of the\n"
       "per-repetition ratios); *spread* is half the range of those ratios relative to their median.\n"
       "The verdict checks the target on the value or on the ratio, as the target column says.\n"
       "The tool and its JSON schema: [sgm-bench.md](sgm-bench.md).\n\n";
  std::snprintf(b, sizeof b,
                "Run: `sgm-bench%s`, sgm %s, %s, %.0f s, %d repetitions, minimum time %.2f s per run.  \n",
                doc.StringOr("mode", "") == "quick" ? " --quick" : "", doc.StringOr("sgm_version", "?").c_str(),
                doc.StringOr("started_utc", "?").c_str(), doc.NumberOr("seconds", 0),
                static_cast<int>(doc.NumberOr("repetitions", 0)), doc.NumberOr("min_time_s", 0));
  s += b;
  std::snprintf(b, sizeof b,
                "Machine: %s, %d cores, %.1f GiB RAM, %s; GPU: %s (driver: %s); backend `%s`; "
                "load average %.2f at the start, %.2f at the end.\n\n",
                m.StringOr("cpu", "?").c_str(), static_cast<int>(m.NumberOr("cores", 0)),
                m.NumberOr("ram_bytes", 0) / (1024.0 * 1024 * 1024), m.StringOr("kernel", "?").c_str(),
                m.StringOr("gpu", "?").c_str(), m.StringOr("driver", "?").c_str(),
                m.StringOr("backend", "?").c_str(), m.NumberOr("load_1min", 0), doc.NumberOr("load_1min_end", 0));
  s += b;
  s += "| figure | what | sgm | reference | ratio | spread | target | verdict |\n";
  s += "|---|---|---:|---:|---:|---:|---|---|\n";
  const Json *figs = FiguresOf(doc);
  for (const Json &f : figs->arr) {
    if (!Measured(f)) continue;
    std::string verdict = f.StringOr("verdict", "?");
    if (verdict == "none") verdict = "—";
    if (verdict == "missed") verdict = "**missed**";
    s += "| `" + f.StringOr("name", "?") + "` | " + f.StringOr("what", "") + " | " + WithUnit(f, "value") + " | " +
         WithUnit(f, "reference") + " | " + Fmt(f.NumberOr("ratio", 0)) + " | ±" + Pct(f.NumberOr("spread", 0)) +
         " | " + TargetText(f, true) + " | " + verdict + " |\n";
  }
  s += "\nReferences:\n\n";
  for (const Json &f : figs->arr)
    s += "- `" + f.StringOr("name", "?") + "`: " + f.StringOr("reference_is", "") + "\n";
  bool any_skipped = false;
  for (const Json &f : figs->arr)
    if (!Measured(f)) {
      if (!any_skipped) s += "\nSkipped in this run:\n\n";
      any_skipped = true;
      s += "- `" + f.StringOr("name", "?") + "`: " + f.StringOr("skip_reason", "") + "\n";
    }
  std::set<std::string> in_run;
  for (const Json &f : figs->arr) in_run.insert(f.StringOr("name", ""));
  bool any_absent = false;
  for (const KnownFigure &k : known)
    if (!in_run.count(k.name)) {
      if (!any_absent) s += "\nNot in this run (`sgm-bench --only NAME` measures one):\n\n";
      any_absent = true;
      s += "- `" + k.name + "`: " + k.what + (k.quick ? "" : " (full runs only)") + "\n";
    }
  s += "\nReproduce (release build): `build/release/benchmarks/sgm-bench/sgm-bench --json docs/benchmarks.json`, "
       "then `sgm-bench --markdown docs/benchmarks.json > docs/benchmarks.md`.\n"
       "The per-area binaries (`build/release/benchmarks/bench_*`) run the same bodies with Google\n"
       "Benchmark's own table; earlier measurements and the analysis behind each target are in\n"
       "[benchmarks-history.md](benchmarks-history.md), the policy tables in\n"
       "[benchmarks-replay.md](benchmarks-replay.md).\n";
  return s;
}

}  // namespace sgm_bench
