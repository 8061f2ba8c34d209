// Test helper for code that reads the engine's GEMM table (util/gemm.h): sets a table for one
// scope and puts the process's back after, whatever the test throws.
#pragma once

#include <string_view>

#include "util/gemm.h"

namespace remat::detail {

class GemmTableScope {
 public:
  GemmTableScope() : saved_(gemm_table()) {}
  // The table of `record` ("linear=blas,blas,blas;head=blas,blas,blas", "onednn", "blas").
  explicit GemmTableScope(std::string_view record) : GemmTableScope() { set_gemm_table(parse_gemm_table(record)); }
  ~GemmTableScope() { set_gemm_table(saved_); }
  GemmTableScope(const GemmTableScope&) = delete;
  GemmTableScope& operator=(const GemmTableScope&) = delete;

 private:
  GemmTable saved_;
};

}  // namespace remat::detail
