// Output shared by the CLI subcommands: files written atomically, Markdown tables, gnuplot charts,
// the model as JSON.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "remat/config.h"
#include "util/atomic_file.h"

namespace remat {

struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::vector<bool> numeric;  // per column: right-aligned (default false)

  // GitHub Markdown, columns padded to line up.
  std::string markdown() const;
};

struct ChartPoint {
  std::string label;  // drawn beside the point; "" for none
  double x = 0;
  double y = 0;
};

struct ChartSeries {
  std::string title;  // legend entry
  std::vector<ChartPoint> points;
  bool line = false;  // true: joined by a line (a frontier); false: labelled points
};

struct Chart {
  std::string title;
  std::string xlabel;
  std::string ylabel;
  std::vector<ChartSeries> series;
};

// Renders `chart` with gnuplot to `path`; the format follows the extension (.png or .svg). gnuplot
// runs from an argument vector with the script on its stdin: no shell sees any of the text.
// Throws remat::Error for another extension or when gnuplot fails.
void render_chart(const Chart& chart, const std::string& path);

// The extension check, and gnuplot on PATH, for validating flags before a long run.
void check_chart_path(const std::string& path);

// A model's shape as every JSON report (bench, plan) writes it: describe, arch, layers, dim, heads,
// kv_heads, batch, seq, ffn (the MLP width), vocab, dtype, dropout, attention.
nlohmann::json model_json(const ModelConfig& cfg);

}  // namespace remat
