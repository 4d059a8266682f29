// `nonstop simulate`: goodput of each checkpoint scheme against a failure trace
// (docs/SIMULATE.md). The model lives in src/tune/simulate.cc; this file reads
// inputs, prints the ranking table or JSON, and hands plotting to matplotlib.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "nonstop/simulate.h"
#include "tools/commands.h"
#include "tools/remote_cli.h"

namespace nonstop::cli {
namespace {

using nlohmann::json;

struct SimulateArgs {
  std::string trace;
  double mtbf_s = 0;
  double horizon_s = 0;
  uint64_t seed = 1;
  int gpus_per_failure = 0;
  std::string schemes;
  std::vector<int> intervals = {1, 2, 5, 10, 25, 50, 100};
  double restart_s = -1;
  double step_s = 0;
  bool json_out = false;
  std::string plot;
};

[[noreturn]] void Fail(const std::string& message, int code = 1) {
  std::cerr << "nonstop simulate: " << message << "\n";
  throw CLI::RuntimeError(code);
}

// A number from `obj[key]`, or `obj[key_ms]` / 1000, or `fallback`.
double Seconds(const json& obj, const char* key, const char* key_ms, double fallback,
               const std::string& who) {
  if (obj.contains(key)) {
    if (!obj[key].is_number()) Fail(who + ": '" + key + "' must be a number");
    return obj[key].get<double>();
  }
  if (obj.contains(key_ms)) {
    if (!obj[key_ms].is_number()) Fail(who + ": '" + key_ms + "' must be a number");
    return obj[key_ms].get<double>() / 1e3;
  }
  return fallback;
}

// Scheme descriptions: {"defaults": {...}, "schemes": [{...}, ...]} or a bare
// list. Each field a scheme leaves out comes from "defaults", then from the
// PCcheck-like default scheme of the same kind.
std::vector<SchemeSpec> SchemesFromDescriptions(const json& doc) {
  const json& list = doc.is_array() ? doc : doc.value("schemes", json::array());
  const json defaults = doc.is_object() ? doc.value("defaults", json::object()) : json::object();
  if (!list.is_array() || list.empty()) Fail("scheme file has no 'schemes' list");
  std::map<SchemeKind, SchemeSpec> base;
  for (const SchemeSpec& s : PccheckLikeSchemes()) base[s.kind] = s;
  std::vector<SchemeSpec> out;
  for (const json& item : list) {
    if (!item.is_object() || !item.contains("name") || !item["name"].is_string()) {
      Fail("every scheme needs a string 'name'");
    }
    const std::string name = item["name"].get<std::string>();
    const std::string kind_name = item.value("kind", defaults.value("kind", name));
    SchemeKind kind;
    if (!ParseSchemeKind(kind_name, &kind)) {
      Fail("scheme '" + name + "': unknown kind '" + kind_name +
           "'; use none, sync, single, concurrent, layerwise, multistep or ideal");
    }
    SchemeSpec s = base[kind];
    s.name = name;
    s.kind = kind;
    const std::string who = "scheme '" + name + "'";
    for (const json* src : {&defaults, &item}) {
      s.step_s = Seconds(*src, "step_s", "step_ms", s.step_s, who);
      s.stall_s = Seconds(*src, "stall_s", "stall_ms", s.stall_s, who);
      s.persist_s = Seconds(*src, "persist_s", "persist_ms", s.persist_s, who);
      s.restart_s = Seconds(*src, "restart_s", "restart_ms", s.restart_s, who);
      if (src->contains("max_in_flight")) s.max_in_flight = (*src)["max_in_flight"].get<int>();
      if (src->contains("intervals")) s.intervals = (*src)["intervals"].get<std::vector<int>>();
    }
    Status st = ValidateScheme(s);
    if (!st.ok()) Fail(st.message());
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<SchemeSpec> SchemesFromBenchJson(const json& doc, const SimulateArgs& args) {
  std::vector<BenchRow> rows;
  for (const json& r : doc["rows"]) {
    if (!r.is_object() || !r.contains("scheme")) Fail("bench row without 'scheme'");
    BenchRow row;
    row.scheme = r["scheme"].get<std::string>();
    row.interval = r.value("interval", 0);
    row.max_in_flight = r.value("max_in_flight", 1);
    row.steps_per_s = r.value("steps_per_s", 0.0);
    row.stall_ms_mean = r.value("stall_ms_mean", 0.0);
    for (const char* key : {"persist_ms_mean", "persist_ms", "tw_ms"}) {
      if (r.contains(key) && r[key].is_number()) {
        row.persist_ms = r[key].get<double>();
        break;
      }
    }
    rows.push_back(std::move(row));
  }
  const double restart = args.restart_s >= 0 ? args.restart_s : PccheckLikeSchemes()[0].restart_s;
  Result<std::vector<SchemeSpec>> specs = SchemesFromBench(rows, restart, args.step_s);
  if (!specs.ok()) Fail(specs.status().message());
  return std::move(specs).value();
}

std::vector<SchemeSpec> LoadSchemes(const SimulateArgs& args) {
  if (args.schemes.empty()) {
    std::vector<SchemeSpec> s = PccheckLikeSchemes();
    if (args.restart_s >= 0) {
      for (SchemeSpec& spec : s) spec.restart_s = args.restart_s;
    }
    return s;
  }
  std::ifstream in(args.schemes);
  if (!in) Fail("cannot open scheme file " + args.schemes);
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::exception& e) {
    Fail(args.schemes + ": not valid JSON: " + e.what());
  }
  try {
    if (doc.is_object() && doc.contains("rows") && doc["rows"].is_array()) {
      return SchemesFromBenchJson(doc, args);
    }
    return SchemesFromDescriptions(doc);
  } catch (const json::exception& e) {
    Fail(args.schemes + ": " + e.what());
  }
}

FailureTrace LoadFailures(const SimulateArgs& args) {
  double horizon = args.horizon_s;
  Result<FailureTrace> trace = Status::InvalidArgument("give --trace FILE or --mtbf SECONDS");
  if (!args.trace.empty()) {
    trace = LoadAvailabilityTrace(args.trace, TraceOptions{args.gpus_per_failure});
    if (!trace.ok()) Fail(trace.status().message());
    if (horizon <= 0) horizon = trace->horizon_s;
  }
  if (args.mtbf_s > 0) {
    if (horizon <= 0) horizon = 86400;
    trace = ExponentialFailures(args.mtbf_s, horizon, args.seed);
  }
  if (!trace.ok()) Fail(trace.status().message());
  return std::move(trace).value();
}

const SimResult* Find(const std::vector<SimResult>& rows, const std::string& scheme, int f) {
  for (const SimResult& r : rows) {
    if (r.scheme == scheme && r.interval == f) return &r;
  }
  return nullptr;
}

struct Best {
  std::string scheme;
  SchemeKind kind;
  const SimResult* row;
};

// A plotting script for matplotlib; tools/plot_simulate.py is the same for use
// on a saved `--json` output.
constexpr const char* kPlotScript = R"PY(
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
doc = json.load(open(sys.argv[1]))
by = {}
for r in doc["rows"]:
    by.setdefault(r["scheme"], []).append((r["interval"], r["goodput_steps_per_s"]))
fig, ax = plt.subplots(figsize=(8, 5))
for name, pts in by.items():
    pts.sort()
    xs, ys = zip(*pts)
    style = dict(linestyle="--", color="grey") if name == "ideal" else dict(marker="o")
    ax.plot(xs, ys, label=name, **style)
ax.set_xscale("log")
ax.set_xlabel("checkpoint interval (steps)")
ax.set_ylabel("goodput (useful steps / s)")
ax.set_title("goodput on " + doc.get("source", ""), fontsize=9)
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=150)
)PY";

// A shell word: `s` in single quotes (a quote inside closed, escaped, reopened).
std::string ShellQuoted(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

void Plot(const json& doc, const std::string& out) {
  // The package's interpreter (tools/remote_cli.h), not whatever python3 is on PATH.
  const std::string python = nonstop::cli::PackagePython();
  if (std::system((ShellQuoted(python) + " -c 'import matplotlib' >/dev/null 2>&1").c_str()) !=
      0) {
    const std::string data = out + ".json";
    std::ofstream(data) << doc.dump(1) << "\n";
    Fail("--plot: matplotlib is not installed for " + python + " (pip install matplotlib); wrote the "
         "data to " + data + ": plot it later with tools/plot_simulate.py " + data + " " + out);
  }
  char data[] = "/tmp/nonstop-simulate-XXXXXX";
  const int fd = mkstemp(data);
  if (fd < 0) Fail("--plot: cannot create a temporary file");
  close(fd);
  std::ofstream(data) << doc.dump() << "\n";
  std::string script_path = std::string(data) + ".py";
  std::ofstream(script_path) << kPlotScript;
  const std::string cmd = ShellQuoted(python) + " " + ShellQuoted(script_path) + " " +
                          ShellQuoted(data) + " " + ShellQuoted(out);
  const int rc = std::system(cmd.c_str());
  std::remove(data);
  std::remove(script_path.c_str());
  if (rc != 0) Fail("--plot: matplotlib failed to write " + out);
  std::cerr << "wrote " << out << "\n";
}

void RunSimulate(const SimulateArgs& args) {
  if (args.trace.empty() && args.mtbf_s <= 0) Fail("give --trace FILE or --mtbf SECONDS");
  for (int f : args.intervals) {
    if (f < 1) Fail("--intervals must be positive step counts");
  }
  const FailureTrace failures = LoadFailures(args);
  const std::vector<SchemeSpec> specs = LoadSchemes(args);
  Result<std::vector<SimResult>> sim = Simulate(specs, args.intervals, failures);
  if (!sim.ok()) Fail(sim.status().message());
  const std::vector<SimResult>& rows = *sim;

  const double rate = static_cast<double>(failures.times_s.size()) / failures.horizon_s;
  std::map<std::string, const SchemeSpec*> spec_of;
  for (const SchemeSpec& s : specs) spec_of.emplace(s.name, &s);

  // Best interval per scheme, in first-seen order, then ranked.
  std::vector<std::string> names;
  std::map<std::string, Best> best;
  for (const SimResult& r : rows) {
    auto it = best.find(r.scheme);
    if (it == best.end()) {
      names.push_back(r.scheme);
      best[r.scheme] = {r.scheme, r.kind, &r};
    } else if (r.goodput_steps_per_s > it->second.row->goodput_steps_per_s) {
      it->second.row = &r;
    }
  }
  double ideal_best = 0;
  for (const auto& [name, b] : best) {
    if (b.kind == SchemeKind::kIdeal) ideal_best = std::max(ideal_best, b.row->goodput_steps_per_s);
  }
  std::vector<Best> ranked;
  for (const std::string& n : names) ranked.push_back(best[n]);
  std::stable_sort(ranked.begin(), ranked.end(), [](const Best& a, const Best& b) {
    return a.row->goodput_steps_per_s > b.row->goodput_steps_per_s;
  });
  const Best* nonstop_best = nullptr;
  for (const Best& b : ranked) {
    if (b.kind == SchemeKind::kConcurrent || b.kind == SchemeKind::kLayerwise ||
        b.kind == SchemeKind::kMultistep) {
      nonstop_best = &b;
      break;
    }
  }
  auto ratio = [&](double g) { return ideal_best > 0 ? g / ideal_best : 0.0; };

  json doc;
  doc["source"] = failures.source;
  doc["horizon_s"] = failures.horizon_s;
  doc["failures"] = failures.times_s.size();
  doc["gpus_per_failure"] = args.gpus_per_failure;
  doc["ideal_best_goodput_steps_per_s"] = ideal_best;
  json jrows = json::array();
  for (const SimResult& r : rows) {
    const SchemeSpec& s = *spec_of.at(r.scheme);
    json j = {{"scheme", r.scheme},
              {"kind", std::string(SchemeKindName(r.kind))},
              {"interval", r.interval},
              {"goodput_steps_per_s", r.goodput_steps_per_s},
              {"ratio_to_ideal_best", ratio(r.goodput_steps_per_s)},
              {"useful_steps", r.useful_steps},
              {"lost_steps", r.lost_steps},
              {"failures", r.failures},
              {"checkpoints", r.checkpoints},
              {"durable_checkpoints", r.durable_checkpoints},
              {"stall_s", r.stall_s},
              {"restart_s", r.restart_s},
              {"first_order_model_steps_per_s", FirstOrderGoodput(s, r.interval, rate)},
              {"pccheck_artifact_model_steps_per_s",
               PccheckArtifactGoodput(s, r.interval, r.failures, failures.horizon_s)}};
    jrows.push_back(std::move(j));
  }
  doc["rows"] = std::move(jrows);
  json jbest = json::array();
  for (const Best& b : ranked) {
    jbest.push_back({{"scheme", b.scheme},
                     {"interval", b.row->interval},
                     {"goodput_steps_per_s", b.row->goodput_steps_per_s},
                     {"ratio_to_ideal_best", ratio(b.row->goodput_steps_per_s)}});
  }
  doc["best"] = std::move(jbest);
  if (nonstop_best != nullptr) {
    doc["nonstop_best"] = {{"scheme", nonstop_best->scheme},
                           {"interval", nonstop_best->row->interval},
                           {"ratio_to_ideal_best", ratio(nonstop_best->row->goodput_steps_per_s)}};
  }
  json jspecs = json::array();
  for (const SchemeSpec& s : specs) {
    jspecs.push_back({{"name", s.name},
                      {"kind", std::string(SchemeKindName(s.kind))},
                      {"step_s", s.step_s},
                      {"stall_s", s.stall_s},
                      {"persist_s", s.persist_s},
                      {"max_in_flight", s.max_in_flight},
                      {"restart_s", s.restart_s},
                      {"intervals", s.intervals}});
  }
  doc["schemes"] = std::move(jspecs);

  if (args.json_out) {
    std::cout << doc.dump(2) << "\n";
  } else {
    std::printf("failures: %s, %zu in %.0f s (MTBF %.0f s)\n", failures.source.c_str(),
                failures.times_s.size(), failures.horizon_s,
                failures.times_s.empty() ? INFINITY : 1 / rate);
    std::printf("\ngoodput (useful steps/s) by checkpoint interval (steps)\n%-14s", "scheme");
    for (int f : args.intervals) std::printf(" %8d", f);
    std::printf("\n");
    for (const std::string& n : names) {
      std::printf("%-14s", n.c_str());
      for (int f : args.intervals) {
        const SimResult* r = Find(rows, n, f);
        if (r == nullptr) {
          std::printf(" %8s", "-");
        } else {
          std::printf(" %8.3f", r->goodput_steps_per_s);
        }
      }
      std::printf("\n");
    }
    std::printf("\nranking (best interval per scheme)\n");
    std::printf("%-14s %8s %9s %8s %6s %6s %9s %9s %8s\n", "scheme", "interval", "goodput",
                "x ideal", "fails", "lost", "stall_s", "restart_s", "YD f*");
    for (const Best& b : ranked) {
      const SimResult& r = *b.row;
      const SchemeSpec& s = *spec_of.at(r.scheme);
      const bool checkpoints = s.kind != SchemeKind::kNone && s.kind != SchemeKind::kIdeal;
      const double cost =
          s.kind == SchemeKind::kSync ? std::max(s.stall_s, s.persist_s) : s.stall_s;
      const double yd = checkpoints ? YoungDalyIntervalSteps(cost, s.step_s, rate) : NAN;
      std::printf("%-14s %8d %9.3f %8.3f %6lld %6lld %9.1f %9.1f %8.1f\n", r.scheme.c_str(),
                  r.interval, r.goodput_steps_per_s, ratio(r.goodput_steps_per_s),
                  static_cast<long long>(r.failures), static_cast<long long>(r.lost_steps),
                  r.stall_s, r.restart_s, yd);
    }
    if (nonstop_best != nullptr) {
      std::printf("\nnonstop's best: %s at interval %d = %.3f x ideal's best\n",
                  nonstop_best->scheme.c_str(), nonstop_best->row->interval,
                  ratio(nonstop_best->row->goodput_steps_per_s));
    }
    std::printf(
        "(YD f*: Young/Daly interval sqrt(2C/(p T^2)), C = visible stall per checkpoint)\n");
  }
  if (!args.plot.empty()) Plot(doc, args.plot);
}

}  // namespace

void AddSimulateCommand(CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "simulate", "Goodput of each checkpoint scheme on a failure trace (docs/SIMULATE.md)");
  cmd->add_option("--trace", args->trace,
                  "availability trace CSV (',Time,GPUs'); every GPU-count change is a failure");
  cmd->add_option("--mtbf", args->mtbf_s,
                  "synthetic exponential failures with this mean time between failures (s)");
  cmd->add_option("--horizon", args->horizon_s,
                  "simulated seconds (default: the trace's span, or 86400 with --mtbf alone)");
  cmd->add_option("--seed", args->seed, "seed for --mtbf failures")->capture_default_str();
  cmd->add_option("--gpus-per-failure", args->gpus_per_failure,
                  "count floor(|change|/G) failures per GPU-count change (PCcheck's artifact: 4); "
                  "0 = one per change")
      ->capture_default_str();
  cmd->add_option("--schemes", args->schemes,
                  "scheme descriptions JSON, or `nonstop bench ... --json` output (default: "
                  "PCcheck-like VGG16/A100 schemes)");
  cmd->add_option("--intervals", args->intervals, "checkpoint intervals in steps")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--restart-s", args->restart_s,
                  "restart cost after a failure (s); default 0.837, PCcheck's VGG16 load time");
  cmd->add_option("--step-s", args->step_s,
                  "step time for bench input without a 'none' row (s)");
  cmd->add_flag("--json", args->json_out, "print one JSON object instead of the table");
  cmd->add_option("--plot", args->plot, "write goodput vs interval to this PNG (matplotlib)");
  cmd->callback([args]() { RunSimulate(*args); });
}

}  // namespace nonstop::cli
