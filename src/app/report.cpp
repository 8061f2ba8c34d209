#include "app/report.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "remat/error.h"

namespace remat {

namespace {

// Runs argv[0] (found on PATH) with `input` on its stdin; returns its exit status (-1 when it could
// not start) and what it wrote to stdout and stderr.
struct RunResult {
  int status = -1;
  std::string output;
};

RunResult run_program(const std::vector<std::string>& argv, const std::string& input) {
  RunResult r;
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return r;
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    return r;
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  if (pid < 0) {
    ::close(in[1]);
    ::close(out[0]);
    return r;
  }
  // The script is small (a few KiB): write it all, then read the output.
  size_t done = 0;
  while (done < input.size()) {
    const ssize_t n = ::write(in[1], input.data() + done, input.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // gnuplot gone (EPIPE, where the program ignores SIGPIPE as remat's CLI does)
    done += static_cast<size_t>(n);
  }
  ::close(in[1]);
  char buf[256];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    r.output.append(buf, static_cast<size_t>(n));
  }
  ::close(out[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string extension(const std::string& path) { return std::filesystem::path(path).extension().string(); }

// A gnuplot string literal: single-quoted, where gnuplot expands neither backslashes nor backquotes
// (a backquoted command in a double-quoted string would run); a quote is written twice.
std::string gp_string(std::string_view s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q += '\'';
    if (c == '\n') c = ' ';
    q += c;
  }
  return q + "'";
}

// A label in a data block: double-quoted, with the characters gnuplot could read as anything but
// text (quotes, backquotes, backslashes, control characters) replaced by spaces.
std::string gp_data_string(std::string_view s) {
  std::string q = "\"";
  for (char c : s) q += (c == '"' || c == '`' || c == '\\' || static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
  return q + "\"";
}

}  // namespace

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
  // render_chart runs gnuplot as execvp finds it: in a folder of $PATH.
  const char* env = std::getenv("PATH");
  const std::string folders = env != nullptr ? env : "";
  bool found = false;
  for (size_t begin = 0; !found && begin <= folders.size();) {
    const size_t end = std::min(folders.find(':', begin), folders.size());
    const std::string folder = end > begin ? folders.substr(begin, end - begin) : ".";
    found = ::access((folder + "/gnuplot").c_str(), X_OK) == 0;
    begin = end + 1;
  }
  if (!found)
    fail(
        "chart '{}' is drawn by gnuplot, which is not on PATH: install it (make setup, gnuplot-nox) or leave the chart "
        "out",
        path);
}

void render_chart(const Chart& chart, const std::string& path) {
  check_chart_path(path);
  const bool png = extension(path) == ".png";
  // gnuplot writes into a folder of our own; the bytes then go to `path` as every output does.
  std::string dir = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/remat-chart-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr)
    fail_runtime("cannot draw '{}': no temporary folder ({})", path, std::strerror(errno));
  const std::string tmp = dir + (png ? "/chart.png" : "/chart.svg");
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
    for (const ChartPoint& p : series.points) script += fmt::format("{} {} {}\n", p.x, p.y, gp_data_string(p.label));
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

  const RunResult run = run_program({"gnuplot"}, script);
  const int status = run.status;
  std::string output = run.output;
  std::string image;
  if (status == 0) {
    std::ifstream in(tmp, std::ios::binary);
    image.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (status != 0 || image.empty()) {
    std::replace(output.begin(), output.end(), '\n', ' ');
    fail_runtime("gnuplot could not draw '{}' (is gnuplot-nox installed?): {}", path, output);
  }
  write_file_atomic(path, image);
}

nlohmann::json model_json(const ModelConfig& cfg) {
  return {{"describe", describe(cfg)},
          {"arch", cfg.arch},
          {"layers", cfg.layers},
          {"dim", cfg.dim},
          {"heads", cfg.heads},
          {"kv_heads", cfg.kv()},
          {"batch", cfg.batch},
          {"seq", cfg.seq},
          {"ffn", cfg.hidden()},
          {"vocab", cfg.vocab},
          {"dtype", to_string(cfg.dtype)},
          {"dropout", cfg.dropout},
          {"attention", to_string(cfg.attention)}};
}

}  // namespace remat
