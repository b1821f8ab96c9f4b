#include <ringverbs/engine/diagnostics.hpp>

#include <atomic>
#include <cstdarg>
#include <cstdio>

namespace ringverbs {

namespace {

void to_stderr(std::string_view message) noexcept {
    std::fprintf(stderr, "ringverbs: %.*s\n", static_cast<int>(message.size()), message.data());
}

std::atomic<diagnostics_sink> current_sink{&to_stderr};

} // namespace

diagnostics_sink set_diagnostics_sink(diagnostics_sink sink) noexcept {
    return current_sink.exchange(sink != nullptr ? sink : &to_stderr);
}

namespace detail {

void diagnose(const char* format, ...) noexcept {
    char line[1024];
    va_list args;
    va_start(args, format);
    const int n = std::vsnprintf(line, sizeof line, format, args);
    va_end(args);
    if (n < 0) return;
    const auto length =
        static_cast<std::size_t>(n) < sizeof line ? static_cast<std::size_t>(n) : sizeof line - 1;
    current_sink.load()(std::string_view(line, length));
}

} // namespace detail

} // namespace ringverbs
