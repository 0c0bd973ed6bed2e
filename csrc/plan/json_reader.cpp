#include "plan/json_reader.h"

#include <algorithm>
#include <cctype>

#include <c10/util/Exception.h>

namespace autoshard::plan {
namespace {

class Reader {
 public:
  Reader(const std::string& text, const std::string& document) : text_(text), document_(document) {}

  JsonValue document() {
    JsonValue value = read();
    skip_space();
    check(pos_ == text_.size(), "text after the document");
    return value;
  }

 private:
  const std::string& text_;
  const std::string& document_;
  size_t pos_ = 0;

  void check(bool ok, const char* what) const {
    TORCH_CHECK_VALUE(ok, document_, " is not valid JSON (", what, " at character ", pos_, ")");
  }

  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }

  bool take(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  bool take_word(const char* word) {
    const std::string w(word);
    if (text_.compare(pos_, w.size(), w) != 0) return false;
    pos_ += w.size();
    return true;
  }

  JsonValue read() {
    skip_space();
    check(pos_ < text_.size(), "unexpected end");
    JsonValue value;
    const char c = text_[pos_];
    if (c == '{') {
      ++pos_;
      value.type = JsonValue::Type::Object;
      if (take('}')) return value;
      do {
        skip_space();
        std::string name = read_string();
        check(take(':'), "expected ':'");
        value.fields.emplace_back(std::move(name), read());
      } while (take(','));
      check(take('}'), "expected '}' or ','");
    } else if (c == '[') {
      ++pos_;
      value.type = JsonValue::Type::Array;
      if (take(']')) return value;
      do {
        value.items.push_back(read());
      } while (take(','));
      check(take(']'), "expected ']' or ','");
    } else if (c == '"') {
      value.type = JsonValue::Type::String;
      value.string = read_string();
    } else if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) {
      value.type = JsonValue::Type::Int;
      value.integer = read_integer();
    } else if (take_word("true")) {
      value.type = JsonValue::Type::Bool;
      value.boolean = true;
    } else if (take_word("false")) {
      value.type = JsonValue::Type::Bool;
    } else {
      check(take_word("null"), "unexpected character");
    }
    return value;
  }

  int64_t read_integer() {
    const bool negative = text_[pos_] == '-';
    if (negative) ++pos_;
    check(pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_])), "expected a digit");
    int64_t value = 0;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      check(value <= (INT64_MAX - 9) / 10, "integer out of range");
      value = value * 10 + (text_[pos_++] - '0');
    }
    check(pos_ >= text_.size() || (text_[pos_] != '.' && text_[pos_] != 'e' && text_[pos_] != 'E'),
          "only integers are read");
    return negative ? -value : value;
  }

  std::string read_string() {
    check(pos_ < text_.size() && text_[pos_] == '"', "expected a string");
    ++pos_;
    std::string out;
    while (true) {
      check(pos_ < text_.size(), "unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      check(pos_ < text_.size(), "unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"': case '\\': case '/': out.push_back(e); break;
        case 'n': out.push_back('\n'); break;
        case 't': out.push_back('\t'); break;
        case 'r': out.push_back('\r'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'u': {
          check(pos_ + 4 <= text_.size() && std::all_of(text_.begin() + pos_, text_.begin() + pos_ + 4,
                                                        [](char h) { return std::isxdigit(static_cast<unsigned char>(h)); }),
                "bad \\u escape");
          const unsigned code = std::stoul(text_.substr(pos_, 4), nullptr, 16);
          pos_ += 4;
          // Labels are ASCII in practice; others are kept as UTF-8 of the code point.
          if (code < 0x80) {
            out.push_back(static_cast<char>(code));
          } else if (code < 0x800) {
            out.push_back(static_cast<char>(0xC0 | (code >> 6)));
            out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
          } else {
            out.push_back(static_cast<char>(0xE0 | (code >> 12)));
            out.push_back(static_cast<char>(0x80 | ((code >> 6) & 0x3F)));
            out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
          }
          break;
        }
        default: check(false, "unknown escape");
      }
    }
  }
};

}  // namespace

const JsonValue* JsonValue::find(const std::string& name) const {
  for (const auto& [key, value] : fields) {
    if (key == name) return &value;
  }
  return nullptr;
}

JsonValue parse_json(const std::string& text, const std::string& document) {
  return Reader(text, document).document();
}

}  // namespace autoshard::plan
