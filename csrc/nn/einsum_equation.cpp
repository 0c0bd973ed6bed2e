#include "nn/einsum_equation.h"

#include <algorithm>
#include <cctype>

#include <c10/util/Exception.h>

namespace autoshard {
namespace {

constexpr const char* kEllipsis = "...";

bool has(const std::string& letters, char letter) {
  return letters.find(letter) != std::string::npos;
}

// One operand's letters, with where its "..." sits (kNone if it has none).
struct Operand {
  std::string letters;
  Ellipsis ellipsis = Ellipsis::kNone;
};

Operand parse_operand(const std::string& text, const char* name, const std::string& equation) {
  Operand operand;
  std::string rest = text;
  if (rest.rfind(kEllipsis, 0) == 0) {
    operand.ellipsis = Ellipsis::kLeading;
    rest = rest.substr(3);
  } else if (rest.size() >= 3 && rest.compare(rest.size() - 3, 3, kEllipsis) == 0) {
    operand.ellipsis = Ellipsis::kTrailing;
    rest = rest.substr(0, rest.size() - 3);
  }
  for (char c : rest) {
    TORCH_CHECK_VALUE(std::isalpha(static_cast<unsigned char>(c)), "einsum equation '", equation, "': the ", name,
                      " '", text, "' may hold only letters and one '...' at its start or end, found '", c, "'");
    TORCH_CHECK_VALUE(std::count(rest.begin(), rest.end(), c) == 1, "einsum equation '", equation, "': letter '", c,
                      "' appears more than once in the ", name, " '", text, "'");
  }
  operand.letters = rest;
  return operand;
}

std::optional<int64_t> dim_in(const std::string& letters, Ellipsis ellipsis, char letter) {
  const size_t pos = letters.find(letter);
  if (pos == std::string::npos) return std::nullopt;
  const int64_t index = static_cast<int64_t>(pos);
  return ellipsis == Ellipsis::kLeading ? index - static_cast<int64_t>(letters.size()) : index;
}

std::string describe(const std::vector<std::optional<int64_t>>& shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ", ";
    text += shape[i] ? std::to_string(*shape[i]) : "None";
  }
  return text + (shape.size() == 1 ? ",)" : ")");
}

}  // namespace

std::optional<int64_t> EinsumEquation::input_dim(char letter) const {
  return dim_in(input, ellipsis, letter);
}

std::optional<int64_t> EinsumEquation::output_dim(char letter) const {
  return dim_in(output, ellipsis, letter);
}

EinsumEquation parse_einsum_equation(std::string_view equation_text) {
  const std::string equation(equation_text);
  std::string text;
  for (char c : equation) {
    if (!std::isspace(static_cast<unsigned char>(c))) text += c;
  }
  const size_t arrow = text.find("->");
  TORCH_CHECK_VALUE(arrow != std::string::npos && text.find("->", arrow + 2) == std::string::npos,
                    "einsum equation '", equation, "' must have the form 'input,weight->output' with exactly one '->'");
  const std::string inputs = text.substr(0, arrow);
  const size_t comma = inputs.find(',');
  TORCH_CHECK_VALUE(comma != std::string::npos && inputs.find(',', comma + 1) == std::string::npos,
                    "einsum equation '", equation,
                    "' must have exactly two operands before '->' (the input and the weight), separated by one ','");
  const Operand input = parse_operand(inputs.substr(0, comma), "input", equation);
  const Operand weight = parse_operand(inputs.substr(comma + 1), "weight", equation);
  const Operand output = parse_operand(text.substr(arrow + 2), "output", equation);
  TORCH_CHECK_VALUE(weight.ellipsis == Ellipsis::kNone, "einsum equation '", equation,
                    "': the weight must name every one of its dims; '...' is allowed in the input and output only");
  TORCH_CHECK_VALUE(input.ellipsis == output.ellipsis, "einsum equation '", equation,
                    "': '...' must appear in both the input and the output, at the same end, or in neither");

  EinsumEquation eq{input.letters, weight.letters, output.letters, input.ellipsis};
  for (char c : eq.output) {
    TORCH_CHECK_VALUE(has(eq.input, c) || has(eq.weight, c), "einsum equation '", equation, "': output letter '", c,
                      "' appears in neither the input nor the weight");
  }
  for (char c : eq.weight) {
    TORCH_CHECK_VALUE(has(eq.input, c) || has(eq.output, c), "einsum equation '", equation, "': weight letter '", c,
                      "' appears in neither the input nor the output, so its size cannot be known");
  }
  return eq;
}

const char* weight_axis_role(const EinsumEquation& eq, char letter) {
  const bool in_input = has(eq.input, letter), in_output = has(eq.output, letter);
  if (in_input && in_output) return "batch";
  return in_input ? "contracted" : "output";
}

std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::optional<int64_t>>,
           std::vector<std::optional<int64_t>>>
einsum_weight_axes(std::string_view equation) {
  const EinsumEquation eq = parse_einsum_equation(equation);
  std::vector<std::string> letters, roles;
  std::vector<std::optional<int64_t>> input_dims, output_dims;
  for (char c : eq.weight) {
    letters.emplace_back(1, c);
    roles.emplace_back(weight_axis_role(eq, c));
    input_dims.push_back(eq.input_dim(c));
    output_dims.push_back(eq.output_dim(c));
  }
  return {letters, roles, input_dims, output_dims};
}

std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<std::optional<int64_t>>> einsum_dense_shapes(
    std::string_view equation, const std::vector<std::optional<int64_t>>& input_shape,
    const std::vector<std::optional<int64_t>>& output_shape, std::optional<std::string_view> bias_axes) {
  std::optional<std::string> bias_letters;
  if (bias_axes) bias_letters = std::string(*bias_axes);
  const EinsumEquation eq = parse_einsum_equation(equation);
  for (const auto& size : input_shape) {
    TORCH_CHECK_VALUE(!size || *size >= 0, "EinsumDense: input_shape ", describe(input_shape),
                      " must hold sizes >= 0 or None");
  }
  for (const auto& size : output_shape) {
    TORCH_CHECK_VALUE(!size || *size >= 0, "EinsumDense: output_shape ", describe(output_shape),
                      " must hold sizes >= 0 or None");
  }
  // Shapes below are full tensor shapes: the batch dim (size unknown) first.
  std::vector<std::optional<int64_t>> input(1, std::nullopt);
  input.insert(input.end(), input_shape.begin(), input_shape.end());
  const int64_t in_letters = static_cast<int64_t>(eq.input.size());
  const int64_t out_letters = static_cast<int64_t>(eq.output.size());
  const int64_t rank = static_cast<int64_t>(input.size());
  const int64_t elided = rank - in_letters;  // the dims "..." stands for
  switch (eq.ellipsis) {
    case Ellipsis::kNone:
      TORCH_CHECK_VALUE(elided == 0, "EinsumDense: input_shape ", describe(input_shape), " must have ",
                        in_letters - 1, " dims for equation '", equation,
                        "' (one per input letter, leaving out the first: the batch dim)");
      break;
    case Ellipsis::kTrailing:
      TORCH_CHECK_VALUE(elided >= 0, "EinsumDense: input_shape ", describe(input_shape), " must have at least ",
                        in_letters - 1, " dims for equation '", equation,
                        "' (one per input letter, leaving out the first: the batch dim)");
      break;
    case Ellipsis::kLeading:
      TORCH_CHECK_VALUE(elided >= 1, "EinsumDense: input_shape ", describe(input_shape), " must have at least ",
                        in_letters, " dims for equation '", equation,
                        "' (one per input letter; the batch dim is part of the leading '...')");
      break;
  }
  // Without a leading "...", the batch dim is the first letter of both the input and the output.
  const bool batch_lettered = eq.ellipsis != Ellipsis::kLeading;
  if (batch_lettered) {
    TORCH_CHECK_VALUE(!eq.input.empty() && !eq.output.empty() && eq.output[0] == eq.input[0], "EinsumDense: equation '",
                      equation, "' must start the output with the input's first letter (the batch dim)");
  }
  const int64_t listed = batch_lettered ? out_letters - 1 : out_letters;
  TORCH_CHECK_VALUE(static_cast<int64_t>(output_shape.size()) == listed, "EinsumDense: output_shape ",
                    describe(output_shape), " must have ", listed, " dims for equation '", equation,
                    "' (one per output letter", batch_lettered ? ", leaving out the first: the batch dim)" : ")");

  std::vector<std::optional<int64_t>> output;
  switch (eq.ellipsis) {
    case Ellipsis::kNone:
    case Ellipsis::kTrailing:
      output.push_back(std::nullopt);
      output.insert(output.end(), output_shape.begin(), output_shape.end());
      output.insert(output.end(), input.end() - elided, input.end());
      break;
    case Ellipsis::kLeading:
      output.insert(output.end(), input.begin(), input.begin() + elided);
      output.insert(output.end(), output_shape.begin(), output_shape.end());
      break;
  }
  auto at = [](std::vector<std::optional<int64_t>>& shape, int64_t dim) -> std::optional<int64_t>& {
    return shape[dim < 0 ? dim + static_cast<int64_t>(shape.size()) : dim];
  };
  for (char c : eq.output) {
    const std::optional<int64_t> in_dim = eq.input_dim(c);
    if (!in_dim) continue;
    std::optional<int64_t>& out_size = at(output, *eq.output_dim(c));
    const std::optional<int64_t> in_size = at(input, *in_dim);
    if (!out_size) {
      out_size = in_size;
    } else {
      TORCH_CHECK_VALUE(!in_size || *in_size == *out_size, "EinsumDense: letter '", c, "' of equation '", equation,
                        "' has size ", *in_size, " in input_shape ", describe(input_shape), " but ", *out_size,
                        " in output_shape ", describe(output_shape));
    }
  }

  std::vector<int64_t> weight_shape;
  for (char c : eq.weight) {
    const std::optional<int64_t> in_dim = eq.input_dim(c), out_dim = eq.output_dim(c);
    std::optional<int64_t> size = in_dim ? at(input, *in_dim) : std::nullopt;
    if (!size && out_dim) size = at(output, *out_dim);
    TORCH_CHECK_VALUE(size.has_value(), "EinsumDense: the size of weight letter '", c, "' of equation '", equation,
                      "' is unknown: give it in input_shape ", describe(input_shape), " or output_shape ",
                      describe(output_shape));
    weight_shape.push_back(*size);
  }

  std::vector<int64_t> bias_shape;
  if (bias_letters) {
    TORCH_CHECK_VALUE(!bias_letters->empty(),
                      "EinsumDense: bias_axes must name at least one output letter, or be None");
    size_t first = eq.output.size();
    for (char c : *bias_letters) {
      TORCH_CHECK_VALUE(has(eq.output, c), "EinsumDense: bias_axes '", *bias_letters,
                        "' must be letters of the output '", eq.output, "' of equation '", equation, "', found '", c,
                        "'");
      TORCH_CHECK_VALUE(std::count(bias_letters->begin(), bias_letters->end(), c) == 1, "EinsumDense: bias_axes '",
                        *bias_letters, "' names letter '", c, "' more than once");
      first = std::min(first, eq.output.find(c));
    }
    // The bias covers the output's dims from its first letter on, so it broadcasts against the output.
    for (size_t i = first; i < eq.output.size(); ++i) {
      const char c = eq.output[i];
      if (!has(*bias_letters, c)) {
        bias_shape.push_back(1);
        continue;
      }
      const std::optional<int64_t> size = at(output, *eq.output_dim(c));
      TORCH_CHECK_VALUE(size.has_value(), "EinsumDense: bias letter '", c, "' of equation '", equation,
                        "' has unknown size: give it in input_shape or output_shape");
      bias_shape.push_back(*size);
    }
    if (eq.ellipsis == Ellipsis::kTrailing) bias_shape.insert(bias_shape.end(), elided, 1);
  }
  return {weight_shape, bias_shape, output};
}

}  // namespace autoshard
