#include "common/logging.h"

#include <spdlog/sinks/stdout_sinks.h>

#include <mutex>

namespace stoke {
namespace {

spdlog::level::level_enum ToSpd(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

std::shared_ptr<spdlog::logger>& LoggerPtr() {
  static std::shared_ptr<spdlog::logger> logger;
  return logger;
}

std::once_flag g_init_once;

void Create(LogLevel level) {
  // A plain (not colour) stderr sink: logs are often piped to files by job schedulers.
  auto logger = spdlog::stderr_logger_mt("stoke");
  // %L is the one-letter level, %s the source file's base name, %# its line.
  logger->set_pattern("%L %H:%M:%S.%e %s:%#] %v");
  logger->set_level(ToSpd(level));
  logger->flush_on(spdlog::level::warn);
  LoggerPtr() = std::move(logger);
}

}  // namespace

void InitLogging(LogLevel level) {
  bool created = false;
  std::call_once(g_init_once, [&] {
    Create(level);
    created = true;
  });
  if (!created) SetLogLevel(level);
}

void SetLogLevel(LogLevel level) { Logger().set_level(ToSpd(level)); }

spdlog::logger& Logger() {
  std::call_once(g_init_once, [] { Create(LogLevel::kInfo); });
  return *LoggerPtr();
}

}  // namespace stoke
