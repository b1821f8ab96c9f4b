// main() for rdma-suite tests: decides skip (exit 77) before doctest runs, so a machine without
// RDMA reports SKIP instead of a wall of failures.
//
// Cases that need InfiniBand/RoCE semantics (RNR, QP state changes by hand, IB CM reasons) are in
// doctest's test suite "ib_roce_only" (TEST_SUITE("ib_roce_only") { ... }). On an iWARP device
// they are filtered out: doctest counts them as skipped, and a line says why. Never passed.
// Likewise the cases of "iwarp_only" on InfiniBand/RoCE.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "rdma_test_device.hpp"

#include <cstdio>

int main(int argc, char** argv) {
    if (const int status = ringverbs::test::check_rdma_device_or_skip(); status >= 0) return status;
    doctest::Context dt(argc, argv);
    const auto& dev = ringverbs::test::rdma_device();
    auto not_applicable = [&](const char* suite, const char* why) {
        dt.addFilter("test-suite-exclude", suite);
        std::fprintf(stderr,
                     "rdma tests: the cases of test suite '%s' do not apply here (%s); doctest "
                     "lists them as skipped\n",
                     suite, why);
    };
    if (dev.iwarp)
        not_applicable(ringverbs::test::ib_roce_only, "an iWARP device");
    else
        not_applicable(ringverbs::test::iwarp_only, "not an iWARP device");
    if (dev.siw) {
        not_applicable(ringverbs::test::solicited_events,
                       "siw raises no event for a solicited receive");
        not_applicable(ringverbs::test::qp_access_checked,
                       "siw does not enforce a QP's remote access flags, only a region's");
    }
    return dt.run();
}
