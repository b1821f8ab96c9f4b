#include <ringverbs/engine/error.hpp>

#include <cerrno>

namespace ringverbs {

std::system_error make_system_error(int err, std::string what) {
    switch (err) {
    case EMFILE:
        what += " (too many open files in this process: raise RLIMIT_NOFILE or close some)";
        break;
    case ENFILE:
        what += " (too many open files in the system)";
        break;
    case ENOMEM:
        what += " (out of resources: memory, locked-memory limit or device resources)";
        break;
    default:
        break;
    }
    return std::system_error(err, std::system_category(), std::move(what));
}

void throw_system_error(int err, std::string what) {
    throw make_system_error(err, std::move(what));
}

} // namespace ringverbs
