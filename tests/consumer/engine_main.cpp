// A program that uses only ringverbs' io_uring engine (ringverbs-engine): a timer and a poll
// on an eventfd, awaited together. tools/consumer-test builds it as a subproject consumer and
// against the installed ringverbs-engine.pc, and checks with ldd that it does not link
// libibverbs or librdmacm. Exits 0 when both awaits ended as they should, 1 otherwise.
#include <ringverbs/engine.hpp>

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>

using namespace ringverbs;

int main() {
    try {
        io_context io;
        const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (fd < 0) {
            std::perror("consumer-engine: eventfd");
            return 1;
        }
        auto signal_later = [&]() -> task<void> {
            co_await sleep_for(io, std::chrono::milliseconds(2));
            const std::uint64_t one = 1;
            if (::write(fd, &one, sizeof one) != sizeof one) std::perror("consumer-engine: write");
        };
        auto wait_readable = [&]() -> task<int> { co_return co_await poll(io, fd, POLLIN); };
        auto [nothing, revents] = io.run(when_all(signal_later(), wait_readable()));
        (void)nothing;
        ::close(fd);
        if ((revents & POLLIN) == 0) {
            std::fprintf(stderr, "consumer-engine: poll gave revents %#x, not POLLIN\n",
                         static_cast<unsigned>(revents));
            return 1;
        }
        std::printf("consumer-engine: co_await poll on an eventfd after a timer: POLLIN\n");
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "consumer-engine: %s\n", e.what());
        return 1;
    }
}
