// json.cc — parser and writer for json.h. Recursive descent, depth-limited
// (64 levels: sgm-bench's files nest 4 deep), no allocation beyond the tree.
#include "json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace sgm_bench {

Json Json::Bool(bool v) {
  Json j;
  j.type = kBool;
  j.b = v;
  return j;
}
Json Json::Number(double v) {
  Json j;
  if (std::isfinite(v)) {
    j.type = kNumber;
    j.num = v;
  }
  return j;
}
Json Json::String(std::string v) {
  Json j;
  j.type = kString;
  j.str = std::move(v);
  return j;
}
Json Json::Array() {
  Json j;
  j.type = kArray;
  return j;
}
Json Json::Object() {
  Json j;
  j.type = kObject;
  return j;
}

const Json *Json::Get(const std::string &k) const {
  if (type != kObject) return nullptr;
  for (const auto &kv : obj)
    if (kv.first == k) return &kv.second;
  return nullptr;
}
Json *Json::Get(const std::string &k) {
  return const_cast<Json *>(static_cast<const Json *>(this)->Get(k));
}
Json &Json::Set(const std::string &k, Json v) {
  if (Json *x = Get(k))
    *x = std::move(v);
  else
    obj.emplace_back(k, std::move(v));
  return *this;
}
Json &Json::Push(Json v) {
  arr.push_back(std::move(v));
  return *this;
}
double Json::NumberOr(const std::string &k, double def) const {
  const Json *x = Get(k);
  return x && x->type == kNumber ? x->num : def;
}
std::string Json::StringOr(const std::string &k, const std::string &def) const {
  const Json *x = Get(k);
  return x && x->type == kString ? x->str : def;
}

namespace {

constexpr int kMaxDepth = 64;  // far past sgm-bench's own nesting; bounds the recursion

struct Parser {
  const std::string &s;  // the text
  size_t i = 0;          // next byte
  std::string err;       // first fault

  bool Fail(const std::string &what) {
    if (err.empty()) err = "offset " + std::to_string(i) + ": " + what;
    return false;
  }
  void Space() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
  }
  bool Literal(const char *w) {
    size_t n = std::char_traits<char>::length(w);
    if (s.compare(i, n, w) != 0) return Fail(std::string("expected ") + w);
    i += n;
    return true;
  }
  static void Utf8(std::string *o, unsigned cp) {
    if (cp < 0x80) {
      *o += static_cast<char>(cp);
    } else if (cp < 0x800) {
      *o += static_cast<char>(0xC0 | (cp >> 6));
      *o += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      *o += static_cast<char>(0xE0 | (cp >> 12));
      *o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *o += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  bool Str(std::string *o) {
    if (i >= s.size() || s[i] != '"') return Fail("expected a string");
    i++;
    while (i < s.size() && s[i] != '"') {
      unsigned char c = static_cast<unsigned char>(s[i]);
      if (c < 0x20) return Fail("control character in a string");
      if (c != '\\') {
        *o += static_cast<char>(c);
        i++;
        continue;
      }
      if (++i >= s.size()) break;
      char e = s[i++];
      switch (e) {
        case '"': *o += '"'; break;
        case '\\': *o += '\\'; break;
        case '/': *o += '/'; break;
        case 'b': *o += '\b'; break;
        case 'f': *o += '\f'; break;
        case 'n': *o += '\n'; break;
        case 'r': *o += '\r'; break;
        case 't': *o += '\t'; break;
        case 'u': {
          if (i + 4 > s.size()) return Fail("short \\u escape");
          unsigned cp = 0;
          for (int k = 0; k < 4; k++) {
            char h = s[i++];
            cp <<= 4;
            if (h >= '0' && h <= '9') cp |= static_cast<unsigned>(h - '0');
            else if (h >= 'a' && h <= 'f') cp |= static_cast<unsigned>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') cp |= static_cast<unsigned>(h - 'A' + 10);
            else return Fail("bad hex digit in \\u escape");
          }
          Utf8(o, cp);
          break;
        }
        default: return Fail("bad escape");
      }
    }
    if (i >= s.size()) return Fail("unterminated string");
    i++;
    return true;
  }
  bool Num(Json *o) {
    size_t start = i;
    if (i < s.size() && s[i] == '-') i++;
    if (i >= s.size() || !(s[i] >= '0' && s[i] <= '9')) return Fail("expected a value");
    while (i < s.size() && ((s[i] >= '0' && s[i] <= '9') || s[i] == '.' || s[i] == 'e' ||
                            s[i] == 'E' || s[i] == '+' || s[i] == '-'))
      i++;
    std::string t = s.substr(start, i - start);
    char *end = nullptr;
    double v = std::strtod(t.c_str(), &end);
    if (!end || *end) {
      i = start;
      return Fail("bad number");
    }
    *o = Json::Number(v);
    return true;
  }
  bool Value(Json *o, int depth) {
    if (depth > kMaxDepth) return Fail("nested too deep");
    Space();
    if (i >= s.size()) return Fail("unexpected end");
    char c = s[i];
    if (c == '{') {
      i++;
      *o = Json::Object();
      Space();
      if (i < s.size() && s[i] == '}') return ++i, true;
      for (;;) {
        Space();
        std::string k;
        if (!Str(&k)) return false;
        Space();
        if (i >= s.size() || s[i] != ':') return Fail("expected ':'");
        i++;
        Json v;
        if (!Value(&v, depth + 1)) return false;
        o->obj.emplace_back(std::move(k), std::move(v));
        Space();
        if (i < s.size() && s[i] == ',') { i++; continue; }
        if (i < s.size() && s[i] == '}') return ++i, true;
        return Fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      i++;
      *o = Json::Array();
      Space();
      if (i < s.size() && s[i] == ']') return ++i, true;
      for (;;) {
        Json v;
        if (!Value(&v, depth + 1)) return false;
        o->arr.push_back(std::move(v));
        Space();
        if (i < s.size() && s[i] == ',') { i++; continue; }
        if (i < s.size() && s[i] == ']') return ++i, true;
        return Fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      *o = Json::String("");
      return Str(&o->str);
    }
    if (c == 't') return Literal("true") && (*o = Json::Bool(true), true);
    if (c == 'f') return Literal("false") && (*o = Json::Bool(false), true);
    if (c == 'n') return Literal("null") && (*o = Json(), true);
    return Num(o);
  }
};

void Escape(std::string *o, const std::string &v) {
  *o += '"';
  for (unsigned char c : v) {
    switch (c) {
      case '"': *o += "\\\""; break;
      case '\\': *o += "\\\\"; break;
      case '\n': *o += "\\n"; break;
      case '\r': *o += "\\r"; break;
      case '\t': *o += "\\t"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          *o += b;
        } else {
          *o += static_cast<char>(c);
        }
    }
  }
  *o += '"';
}

bool Flat(const Json &v) {
  for (const Json &x : v.arr)
    if (x.type == Json::kArray || x.type == Json::kObject) return false;
  return true;
}

void Write(std::string *o, const Json &v, int indent) {
  std::string pad(static_cast<size_t>(indent) + 2, ' ');
  switch (v.type) {
    case Json::kNull: *o += "null"; break;
    case Json::kBool: *o += v.b ? "true" : "false"; break;
    case Json::kNumber: {
      char b[32];
      // %.10g: ten significant digits, far below any figure's noise, and
      // exact for the integers (bytes, counts) the files hold.
      if (v.num == std::floor(v.num) && std::fabs(v.num) < 1e15)
        std::snprintf(b, sizeof b, "%.0f", v.num);
      else
        std::snprintf(b, sizeof b, "%.10g", v.num);
      *o += b;
      break;
    }
    case Json::kString: Escape(o, v.str); break;
    case Json::kArray:
      if (v.arr.empty()) {
        *o += "[]";
      } else if (Flat(v)) {
        *o += '[';
        for (size_t k = 0; k < v.arr.size(); k++) {
          if (k) *o += ", ";
          Write(o, v.arr[k], indent);
        }
        *o += ']';
      } else {
        *o += "[\n";
        for (size_t k = 0; k < v.arr.size(); k++) {
          *o += pad;
          Write(o, v.arr[k], indent + 2);
          *o += k + 1 < v.arr.size() ? ",\n" : "\n";
        }
        *o += std::string(static_cast<size_t>(indent), ' ') + "]";
      }
      break;
    case Json::kObject:
      if (v.obj.empty()) {
        *o += "{}";
        break;
      }
      *o += "{\n";
      for (size_t k = 0; k < v.obj.size(); k++) {
        *o += pad;
        Escape(o, v.obj[k].first);
        *o += ": ";
        Write(o, v.obj[k].second, indent + 2);
        *o += k + 1 < v.obj.size() ? ",\n" : "\n";
      }
      *o += std::string(static_cast<size_t>(indent), ' ') + "}";
      break;
  }
}

}  // namespace

bool JsonParse(const std::string &text, Json *out, std::string *err) {
  Parser p{text, 0, ""};
  Json v;
  if (!p.Value(&v, 0)) {
    *err = p.err;
    return false;
  }
  p.Space();
  if (p.i != text.size()) {
    p.Fail("trailing characters after the value");
    *err = p.err;
    return false;
  }
  *out = std::move(v);
  return true;
}

std::string JsonWrite(const Json &v) {
  std::string o;
  Write(&o, v, 0);
  o += '\n';
  return o;
}

bool JsonReadFile(const std::string &path, Json *out, std::string *err) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *err = path + ": cannot be read";
    return false;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string e;
  if (!JsonParse(ss.str(), out, &e)) {
    *err = path + ": not JSON (" + e + ")";
    return false;
  }
  return true;
}

}  // namespace sgm_bench
