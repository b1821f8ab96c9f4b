// The locked-memory limit: registration pins pages, and past RLIMIT_MEMLOCK ibv_reg_mr fails with
// ENOMEM unless the process has CAP_IPC_LOCK (root does, which is why the test VM registers
// freely even under the default 8 MiB limit). The test lowers the limit and drops the capability
// from its effective set to see the error a normal user would get.
#include "verbs_test_util.hpp"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

using namespace ringverbs;
using namespace ringverbs::test;

namespace {

struct caps {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2]{};
};

caps get_caps() {
    caps c;
    REQUIRE(syscall(SYS_capget, &c.header, c.data) == 0);
    return c;
}

// Turns CAP_IPC_LOCK on or off in the effective set; the permitted set is untouched, so it can
// come back.
void set_ipc_lock(bool on) {
    caps c = get_caps();
    const unsigned bit = 1u << CAP_IPC_LOCK; // CAP_IPC_LOCK (14) is in the first word
    if (on)
        c.data[0].effective |= bit;
    else
        c.data[0].effective &= ~bit;
    REQUIRE(syscall(SYS_capset, &c.header, c.data) == 0);
}

bool ipc_lock_permitted() {
    return (get_caps().data[0].permitted & (1u << CAP_IPC_LOCK)) != 0;
}

} // namespace

TEST_CASE("past RLIMIT_MEMLOCK without CAP_IPC_LOCK, ibv_reg_mr reads as out of resources") {
    verbs::context ctx(rdma_device().name);
    verbs::protection_domain pd(ctx);
    rlimit saved{};
    REQUIRE(getrlimit(RLIMIT_MEMLOCK, &saved) == 0);
    MESSAGE("RLIMIT_MEMLOCK " << (saved.rlim_cur == RLIM_INFINITY
                                      ? std::string("unlimited")
                                      : std::to_string(saved.rlim_cur) + " bytes")
                              << ", CAP_IPC_LOCK permitted: " << ipc_lock_permitted());

    std::vector<std::byte> big(std::size_t{4} << 20), small(16 << 10);
    rlimit low = saved;
    low.rlim_cur = 256 << 10;
    REQUIRE(setrlimit(RLIMIT_MEMLOCK, &low) == 0);
    set_ipc_lock(false);

    const auto e = catch_system_error([&] { verbs::memory_region mr(pd, big); });
    std::optional<verbs::memory_region> fits;
    std::string fits_error;
    try {
        fits.emplace(pd, small);
    } catch (const std::system_error& err) {
        fits_error = err.what();
    }

    if (ipc_lock_permitted()) set_ipc_lock(true);
    REQUIRE(setrlimit(RLIMIT_MEMLOCK, &saved) == 0);

    MESSAGE(std::string(e.what()));
    CHECK(e.code() == std::errc::not_enough_memory);
    CHECK(std::string(e.what()).find("ibv_reg_mr(4194304 bytes") != std::string::npos);
    CHECK(std::string(e.what()).find("out of resources") != std::string::npos);
    CHECK_MESSAGE(fits.has_value(), fits_error);

    // With the capability back (root), the same registration goes through.
    if (ipc_lock_permitted()) {
        verbs::memory_region mr(pd, big);
        CHECK(mr.size() == big.size());
    }
}
