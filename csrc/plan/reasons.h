#pragma once
// Every reason code a plan gives for what it holds whole or gathers, with its words: the one
// table both the planner's decisions (settle.cpp) and the printout of what each rank holds
// (python/autoshard/plan/holdings.py, through the plan_reasons op) read.
#include <string>
#include <utility>
#include <vector>

namespace autoshard::plan {

// (code, words) in the order the documentation lists them.
const std::vector<std::pair<std::string, std::string>>& reason_table();

// The words for `code`; an unknown code is a planner bug (TORCH_CHECK).
const std::string& reason_text(const std::string& code);

// The table as a JSON object {code: words} (the plan_reasons op).
std::string plan_reasons();

// Why sequence parallelism is given up, or a region refused, for what the module calls around
// it show (token_indexing.cpp, length_reads.cpp): `indexing` is the label of the op indexing
// the token axis, `module` a module's name, `reader` the label of an op.
std::string indexed_tokens_without_exit(const std::string& indexing);
std::string indexed_tokens_reach_output(const std::string& indexing);
std::string indexed_tokens_read_elsewhere(const std::string& module, const std::string& reader,
                                          const std::string& indexing);
std::string length_may_be_read(const std::string& module);

}  // namespace autoshard::plan
