// Errors: every failure in ringverbs is a std::system_error whose message names the operation
// (the io_uring opcode, the verb) and whose code is the errno.
#pragma once

#include <ringverbs/config.hpp>

#include <string>
#include <system_error>

namespace ringverbs {

// Builds the exception for a failed call. `what` names the call ("io_uring_queue_init",
// "ibv_create_cq", "recv"); `err` is a positive errno value. The message reads
// "<what>: <strerror(err)>", with a hint appended for errnos that have a well-known cause
// (EMFILE: too many open files; ENOMEM: out of resources).
[[nodiscard]] std::system_error make_system_error(int err, std::string what);

// Throws make_system_error(err, what).
[[noreturn]] void throw_system_error(int err, std::string what);

} // namespace ringverbs
