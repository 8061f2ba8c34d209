// Output shared by the CLI subcommands: files written atomically, Markdown tables, gnuplot charts.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace remat {

// Writes `content` to `path` through a temporary file in the same folder, fsync and rename: readers
// see the old file or the new one, never a part. Throws remat::Error naming the path and the reason.
void write_file_atomic(const std::string& path, std::string_view content);

// Throws a usage remat::Error ("cannot write 'x/y.json': No such file or directory") unless a file
// can be created at `path`. Creates nothing that outlives the call.
void check_writable(const std::string& path);

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
  std::string title;               // legend entry
  std::vector<ChartPoint> points;
  bool line = false;               // true: joined by a line (a frontier); false: labelled points
};

struct Chart {
  std::string title;
  std::string xlabel;
  std::string ylabel;
  std::vector<ChartSeries> series;
};

// Renders `chart` with gnuplot to `path`; the format follows the extension (.png or .svg).
// Throws remat::Error for another extension or when gnuplot fails.
void render_chart(const Chart& chart, const std::string& path);

// The extension check alone, for validating flags before a long run.
void check_chart_path(const std::string& path);

}  // namespace remat
