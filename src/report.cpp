#include "remat/report.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "remat/error.h"

namespace remat {

namespace {

std::string temp_name(const std::string& path) { return fmt::format("{}.tmp.{}", path, getpid()); }

std::string extension(const std::string& path) { return std::filesystem::path(path).extension().string(); }

// A gnuplot string literal.
std::string gp_string(std::string_view s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') q += '\\';
    q += c;
  }
  return q + "\"";
}

}  // namespace

void write_file_atomic(const std::string& path, std::string_view content) {
  const std::string tmp = temp_name(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_runtime("cannot write '{}': {}", path, std::strerror(errno));
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail_runtime("cannot write '{}': {}", path, std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail_runtime("cannot write '{}': {}", path, std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail_runtime("cannot write '{}': {}", path, std::strerror(err));
  }
}

void check_writable(const std::string& path) {
  if (path.empty()) fail("empty output path");
  if (std::filesystem::is_directory(path)) fail("cannot write '{}': it is a directory", path);
  const std::string tmp = temp_name(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write '{}': {}", path, std::strerror(errno));
  ::close(fd);
  ::unlink(tmp.c_str());
}

std::string Table::markdown() const {
  const size_t cols = header.size();
  std::vector<size_t> width(cols, 3);
  for (size_t c = 0; c < cols; ++c) width[c] = std::max(width[c], header[c].size());
  for (const auto& row : rows)
    for (size_t c = 0; c < cols && c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  auto right = [&](size_t c) { return c < numeric.size() && numeric[c]; };
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s = "|";
    for (size_t c = 0; c < cols; ++c) {
      const std::string& cell = c < cells.size() ? cells[c] : std::string();
      s += right(c) ? fmt::format(" {:>{}} |", cell, width[c]) : fmt::format(" {:<{}} |", cell, width[c]);
    }
    return s + "\n";
  };
  std::string out = line(header) + "|";
  for (size_t c = 0; c < cols; ++c)
    out += right(c) ? std::string(width[c] + 1, '-') + ":|" : ":" + std::string(width[c] + 1, '-') + "|";
  out += "\n";
  for (const auto& row : rows) out += line(row);
  return out;
}

void check_chart_path(const std::string& path) {
  const std::string ext = extension(path);
  if (ext != ".png" && ext != ".svg")
    fail("chart '{}': unknown format '{}'; allowed: .png, .svg", path, ext.empty() ? "(none)" : ext);
}

void render_chart(const Chart& chart, const std::string& path) {
  check_chart_path(path);
  const bool png = extension(path) == ".png";
  const std::string tmp = temp_name(path) + (png ? ".png" : ".svg");
  std::string script;
  script += png ? "set terminal pngcairo size 960,640 font 'Sans,11'\n"
                : "set terminal svg size 960,640 font 'Sans,11' background rgb 'white'\n";
  script += "set output " + gp_string(tmp) + "\n";
  script += "set title " + gp_string(chart.title) + "\n";
  script += "set xlabel " + gp_string(chart.xlabel) + "\nset ylabel " + gp_string(chart.ylabel) + "\n";
  bool labelled = false;
  for (const ChartSeries& series : chart.series) labelled = labelled || !series.line;
  script += "set grid\nset key bottom left box opaque\nset yrange [0:*]\n";
  if (labelled) script += "set offsets graph 0.05, graph 0.22, graph 0.12, 0\n";  // room for the labels
  std::string plot;
  for (size_t s = 0; s < chart.series.size(); ++s) {
    const ChartSeries& series = chart.series[s];
    script += fmt::format("$S{} << EOD\n", s);
    for (const ChartPoint& p : series.points) script += fmt::format("{} {} {}\n", p.x, p.y, gp_string(p.label));
    script += "EOD\n";
    if (!plot.empty()) plot += ", \\\n  ";
    if (series.line) {
      const char* style = series.points.size() > 60 ? "lines lw 1.5" : "linespoints lw 2 pt 7 ps 0.6";
      plot += fmt::format("$S{} using 1:2 with {} title {}", s, style, gp_string(series.title));
    } else {
      plot += fmt::format("$S{} using 1:2 with points pt 7 ps 1.6 title {}, ", s, gp_string(series.title));
      plot += fmt::format("$S{} using 1:2:3 with labels offset char 1,0.8 left notitle", s);
    }
  }
  script += "plot " + plot + "\n";

  const std::string script_path = temp_name(path) + ".gp";
  write_file_atomic(script_path, script);
  const std::string cmd = fmt::format("gnuplot {} 2>&1", gp_string(script_path));
  FILE* pipe = ::popen(cmd.c_str(), "r");
  std::string output;
  if (pipe != nullptr) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, pipe) != nullptr) output += buf;
  }
  const int status = pipe != nullptr ? ::pclose(pipe) : -1;
  ::unlink(script_path.c_str());
  if (status != 0 || !std::filesystem::exists(tmp)) {
    ::unlink(tmp.c_str());
    std::replace(output.begin(), output.end(), '\n', ' ');
    fail_runtime("gnuplot could not draw '{}' (is gnuplot-nox installed?): {}", path, output);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail_runtime("cannot write '{}': {}", path, std::strerror(err));
  }
}

}  // namespace remat
