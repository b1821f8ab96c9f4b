// Small RAII fds for the engine tests.
#pragma once

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdint>
#include <stdexcept>
#include <utility>

namespace test {

struct unique_fd {
    int fd = -1;
    unique_fd() = default;
    explicit unique_fd(int f) : fd(f) {
        if (fd < 0) throw std::runtime_error("fd creation failed");
    }
    unique_fd(unique_fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
    unique_fd& operator=(unique_fd&& o) noexcept {
        std::swap(fd, o.fd);
        return *this;
    }
    ~unique_fd() {
        if (fd >= 0) ::close(fd);
    }
    int get() const { return fd; }
};

inline unique_fd make_eventfd() {
    return unique_fd{::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)};
}

inline void signal(const unique_fd& efd, std::uint64_t n = 1) {
    if (::write(efd.get(), &n, sizeof n) != sizeof n) throw std::runtime_error("eventfd write");
}

inline std::uint64_t drain(const unique_fd& efd) {
    std::uint64_t v = 0;
    if (::read(efd.get(), &v, sizeof v) != sizeof v) return 0;
    return v;
}

struct pipe_pair {
    unique_fd rd, wr;
    pipe_pair() {
        int p[2];
        if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
        rd = unique_fd{p[0]};
        wr = unique_fd{p[1]};
    }
};

} // namespace test
