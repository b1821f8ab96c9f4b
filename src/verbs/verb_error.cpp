#include <ringverbs/verbs/verb_error.hpp>

namespace ringverbs::verbs {

void throw_verb_error(int ret, const char* verb) {
    throw_system_error(verb_errno(ret), verb);
}

} // namespace ringverbs::verbs
