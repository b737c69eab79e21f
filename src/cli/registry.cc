// The list every command registers into (registry.h).
#include "cli/registry.h"

namespace moed::cli {

std::vector<Registration>& registrations() {
  static std::vector<Registration> r;
  return r;
}

}  // namespace moed::cli
