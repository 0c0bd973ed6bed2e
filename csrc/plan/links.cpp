// Settling KV links after a pass: whether fewer KV heads than the ranks need are kept apart
// from their query heads (each rank holding the KV heads its query heads use) or united.
#include <iterator>
#include <numeric>

#include "plan/propagation.h"

namespace autoshard::plan {

// Decides every link once the pass has run: a pair whose combined units (their gcd, as if
// one region) still cover the ranks becomes one region, as does any pair that cannot be
// split on the query heads alone; the others keep their KV heads replicated where needed.
void Propagation::settle_links(int64_t world_size) {
  std::map<int, std::set<int>> fines_of;
  for (const Link& l : links) fines_of[find(l.coarse)].insert(find(l.fine));
  std::map<int, std::set<int64_t>> ratios_of_fine;
  for (const auto& [coarse, fines] : fines_of) {
    if (fines.size() != 1 || coarse == *fines.begin()) continue;
    const int fine = *fines.begin();
    const Region& c = regions[coarse];
    const Region& f = regions[fine];
    if (std::gcd(c.units, f.units) >= world_size || c.conflict || f.conflict || f.units < world_size ||
        c.units <= 0 || f.units % c.units || !uniform_groups(f.units, f.units / c.units, world_size) ||
        !only_plain_columns(coarse)) {
      continue;
    }
    kv_fine[coarse] = fine;
    ratios_of_fine[fine].insert(f.units / c.units);
  }
  // One attention's KV projections must all repeat alike.
  for (auto it = kv_fine.begin(); it != kv_fine.end();) {
    it = ratios_of_fine[it->second].size() == 1 ? std::next(it) : kv_fine.erase(it);
  }
  for (const Link& l : links) {
    const int coarse = find(l.coarse);
    if (!kv_fine.count(coarse)) unite(coarse, l.fine);
  }
  std::map<int, int> rooted;
  for (const auto& [coarse, fine] : kv_fine) rooted[find(coarse)] = find(fine);
  kv_fine = rooted;
  refuse_shared_norms();
}

// Whether splitting `units` fine units over the ranks (split_sizes) gives every rank query
// heads that its run of KV heads serves in equal consecutive groups, as repeat_kv and a
// grouped attention compute locally (fine unit u uses coarse unit u / ratio).
bool Propagation::uniform_groups(int64_t units, int64_t ratio, int64_t world_size) {
  int64_t start = 0;
  for (int64_t r = 0; r < world_size; ++r) {
    const int64_t count = units / world_size + (r < units % world_size ? 1 : 0);
    const int64_t first = start / ratio, last = (start + count - 1) / ratio;
    const int64_t kv = last - first + 1;
    if (count == 0 || count % kv) return false;
    const int64_t group = count / kv;
    for (int64_t i = 0; i < count; ++i) {
      if ((start + i) / ratio - first != i / group) return false;
    }
    start += count;
  }
  return true;
}

// A region kept coarse must hold nothing but plain column Linear layers (the KV projections).
bool Propagation::only_plain_columns(int coarse) {
  bool any = false;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    if (node_region[n] < 0 || find(node_region[n]) != coarse) continue;
    if (roles[n] != Style::Column || graph_.nodes[n].kind != Kind::Linear || parts.count(static_cast<int>(n))) {
      return false;
    }
    any = true;
  }
  return any;
}

}  // namespace autoshard::plan
