// gdn_jax_report: how a jitted op reports a refused batch without a host callback. A host
// callback (even one in a branch never taken) takes JAX's jit call off its C++ fast path:
// ~0.2 ms per call, as much as a whole decode step at B = 1. So the plain ops pass one of
// their results through this call (aliased, nothing copied) with the status beside it; on
// an error it prints the message to stderr. The message templates come from Python
// (gdn_jax/_checks.py STATUS_MESSAGES, one per line, code 1 first) so that both the eager
// error and this line say the same thing.
#include <cstdio>
#include <string>
#include <string_view>

#include "handlers/common.h"

namespace gdn {

// Replaces {code}, {row}, {row_plus_1}, {value}, {aux} in the template of `code`.
static std::string format_status(std::string_view op, std::string_view templates, const Status& s) {
  std::string_view tpl;
  int line = 1;
  size_t pos = 0;
  while (pos <= templates.size()) {
    size_t end = templates.find('\n', pos);
    if (end == std::string_view::npos) end = templates.size();
    if (line == s.code) {
      tpl = templates.substr(pos, end - pos);
      break;
    }
    ++line;
    pos = end + 1;
  }
  if (tpl.empty()) tpl = "unknown status code {code} (row {row}, value {value}, aux {aux})";
  std::string detail;
  for (size_t i = 0; i < tpl.size(); ++i) {
    if (tpl[i] == '{') {
      const size_t close = tpl.find('}', i);
      if (close != std::string_view::npos) {
        const std::string_view key = tpl.substr(i + 1, close - i - 1);
        bool known = true;
        if (key == "code") detail += std::to_string(s.code);
        else if (key == "row") detail += std::to_string(s.row);
        else if (key == "row_plus_1") detail += std::to_string(int64_t(s.row) + 1);
        else if (key == "value") detail += std::to_string(s.value);
        else if (key == "aux") detail += std::to_string(s.aux);
        else known = false;
        if (known) {
          i = close;
          continue;
        }
      }
    }
    detail += tpl[i];
  }
  return "gdn_jax." + std::string(op) + ": invalid batch, nothing was written: " + detail;
}

static ffi::Error ReportImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> status, ffi::Result<ffi::AnyBuffer> x_out,
                             std::string_view op, std::string_view templates) {
  if (status.element_count() < 4) return bad("report", "status must be int32[4]");
  if (x_out->untyped_data() != x.untyped_data()) std::memcpy(x_out->untyped_data(), x.untyped_data(), x.size_bytes());
  const int32_t* p = status.typed_data();
  if (p[0] != kOk) {
    const std::string msg = format_status(op, templates, Status{p[0], p[1], p[2], p[3]});
    std::fprintf(stderr, "%s\n", msg.c_str());
    std::fflush(stderr);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnReport, ReportImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x: any result of the op
                                  .Arg<ffi::Buffer<ffi::S32>>()   // status [4]
                                  .Ret<ffi::AnyBuffer>()          // x (aliased)
                                  .Attr<std::string_view>("op")
                                  .Attr<std::string_view>("templates"));

}  // namespace gdn
