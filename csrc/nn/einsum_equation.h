#pragma once
// Keras-style dense einsum equations, "input,weight->output" (e.g. "btd,dnh->btnh"), where
// the input and the output may both start or both end with "..." (dims carried through
// unchanged) and the weight is spelled out in full. Parsing, the role of each weight letter
// and the layer's shapes are decided here, once, for every layer that uses such an equation.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace autoshard {

enum class Ellipsis { kNone, kLeading, kTrailing };

struct EinsumEquation {
  std::string input, weight, output;  // the letters of each operand, "..." removed
  Ellipsis ellipsis = Ellipsis::kNone;

  // The letter's dim in the input or output tensor; counted from the end (negative) after a
  // leading "...", whose length only the tensor knows. nullopt if the operand lacks the letter.
  std::optional<int64_t> input_dim(char letter) const;
  std::optional<int64_t> output_dim(char letter) const;
};

// Parses and validates; bad equations raise ValueError naming the equation and the fault.
EinsumEquation parse_einsum_equation(std::string_view equation);

// "output" (weight and output, not input), "contracted" (weight and input, not output) or
// "batch" (all three).
const char* weight_axis_role(const EinsumEquation& eq, char letter);

// For each weight letter, in weight order: the letter, its role, its input dim and output dim
// (see EinsumEquation::input_dim).
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::optional<int64_t>>,
           std::vector<std::optional<int64_t>>>
einsum_weight_axes(std::string_view equation);

// Keras' EinsumDense shapes. `input_shape` and `output_shape` leave out the batch dim (the
// input's first), and `output_shape` lists the output letters' sizes only (not the dims a
// "..." carries), with nullopt for "same as the input's". Returns the weight shape, the bias
// shape (empty without bias_axes) and the full output shape, batch dim (unknown) included.
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<std::optional<int64_t>>> einsum_dense_shapes(
    std::string_view equation, const std::vector<std::optional<int64_t>>& input_shape,
    const std::vector<std::optional<int64_t>>& output_shape, std::optional<std::string_view> bias_axes);

}  // namespace autoshard
