// main() for rdma-suite tests: decides skip (exit 77) before doctest runs, so a machine without
// RDMA reports SKIP instead of a wall of failures.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "rdma_test_device.hpp"

int main(int argc, char** argv) {
    if (const int status = ringverbs::test::check_rdma_device_or_skip(); status >= 0) return status;
    doctest::Context dt(argc, argv);
    return dt.run();
}
