// remat cpu: the CPU as remat's cached measurements know it, and the kind its results are kept
// under (results/by-cpu/KIND).
#include <memory>

#include <fmt/format.h>

#include "cli.h"
#include "remat/runtime.h"

namespace remat::cli {

Command add_cpu(CLI::App& parent) {
  auto kind_only = std::make_shared<bool>(false);
  CLI::App* a =
      parent.add_subcommand("cpu", "print this machine's CPU as remat's calibrations are keyed on, and its kind");
  a->add_flag("--kind", *kind_only, "print the kind alone (a folder name, such as intel-6-167-avx512)");
  return {a,
          {},
          [kind_only] {
            if (*kind_only)
              fmt::print("{}\n", cpu_kind());
            else
              fmt::print("cpu: {}\nkind: {}\n", cpu_name(), cpu_kind());
            return 0;
          },
          /*runs_products=*/false,
          /*reads_caches=*/false};
}

}  // namespace remat::cli
