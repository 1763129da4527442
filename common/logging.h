// STOKE_LOG: leveled logging to stderr through spdlog, in the form
//   I 12:03:44.120 packer.cc:212] message
// Messages use fmt syntax: STOKE_LOG(INFO, "packed {} records", n). Thread-safe.
#pragma once

#include <spdlog/spdlog.h>

namespace stoke {

enum class LogLevel { kDebug, kInfo, kWarn, kError, kOff };

// Installs the stderr logger with stoke's pattern. Idempotent; called lazily by Logger().
void InitLogging(LogLevel level = LogLevel::kInfo);
void SetLogLevel(LogLevel level);
spdlog::logger& Logger();

}  // namespace stoke

#define STOKE_LOG_LEVEL_DEBUG spdlog::level::debug
#define STOKE_LOG_LEVEL_INFO spdlog::level::info
#define STOKE_LOG_LEVEL_WARN spdlog::level::warn
#define STOKE_LOG_LEVEL_ERROR spdlog::level::err

#define STOKE_LOG(severity, ...)                                                      \
  ::stoke::Logger().log(spdlog::source_loc{__FILE__, __LINE__, SPDLOG_FUNCTION},     \
                        STOKE_LOG_LEVEL_##severity, __VA_ARGS__)
