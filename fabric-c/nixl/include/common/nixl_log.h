/* The logging macros NIXL's backend headers use (NIXL_ERROR << ...), for building the
 * plugin without Abseil: NIXL's own common/nixl_log.h needs absl/log (2023 or newer), which
 * Debian 12 lacks. build.sh puts this folder before NIXL's on the include path. Messages
 * go to stderr; FABRIC_NIXL_LOG=debug|info|warn|error (default warn) picks the level. */
#ifndef FABRIC_NIXL_LOG_H
#define FABRIC_NIXL_LOG_H

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>

namespace fabric_nixl_log {

inline int threshold() {
    static const int level = [] {
        const char *v = std::getenv("FABRIC_NIXL_LOG");
        if (v == nullptr) return 2;
        if (std::strcmp(v, "debug") == 0 || std::strcmp(v, "trace") == 0) return 0;
        if (std::strcmp(v, "info") == 0) return 1;
        if (std::strcmp(v, "error") == 0) return 3;
        return 2;
    }();
    return level;
}

/* One message: collected, then written whole (one line) when the statement ends. */
class Line {
public:
    Line(int level, const char *tag) : on_(level >= threshold()) {
        if (on_) out_ << "[FABRIC " << tag << "] ";
    }
    ~Line() {
        if (on_) std::cerr << out_.str() << std::endl;
    }
    template <typename T> Line &operator<<(const T &v) {
        if (on_) out_ << v;
        return *this;
    }

private:
    bool on_;
    std::ostringstream out_;
};

} // namespace fabric_nixl_log

#define NIXL_TRACE fabric_nixl_log::Line(0, "trace")
#define NIXL_DEBUG fabric_nixl_log::Line(0, "debug")
#define NIXL_INFO fabric_nixl_log::Line(1, "info")
#define NIXL_WARN fabric_nixl_log::Line(2, "warn")
#define NIXL_ERROR fabric_nixl_log::Line(3, "error")
#define NIXL_ERROR_FUNC NIXL_ERROR << __FUNCTION__ << ": "
#define NIXL_ASSERT(c) fabric_nixl_log::Line((c) ? -1 : 3, "assert")
#define NIXL_ASSERT_ALWAYS(c) NIXL_ASSERT(c)

#endif
