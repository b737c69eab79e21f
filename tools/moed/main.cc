// moed: token dispatch and combine for mixture-of-experts models, on CPUs.
// Commands register themselves (registry.h); this file only builds the tree and runs it.
#include <cstdio>
#include <map>

#include "cli/registry.h"

int main(int argc, char** argv) {
  CLI::App app{"moed: MoE token dispatch and combine (AllGather, AlltoAll, Flex, low-latency)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "moed 0.1.0");
  // Options of the top level (e.g. --timeout) may also follow a command: `moed run --timeout 10`.
  app.fallthrough();
  CLI::App* bench = app.add_subcommand("bench", "benchmarks, each figure a fraction of the limit measured in the same run");
  bench->require_subcommand(1);  // the full sweep may relax this when it registers
  // Parents first: top-level commands, then those under `bench`.
  for (const auto& r : moed::cli::registrations()) {
    if (r.parent.empty()) r.setup(app);
  }
  for (const auto& r : moed::cli::registrations()) {
    if (r.parent == "bench") r.setup(*bench);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return 0;
}
