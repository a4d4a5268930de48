// json.h — the little JSON sgm-bench needs: a value tree, a strict parser
// (RFC 8259 minus \u escapes above the BMP being joined into pairs) and a
// writer with stable key order. sgm-bench reads back only files it wrote, yet
// the parser refuses what is not JSON rather than guessing, with the byte
// offset of the first fault.
#ifndef SGM_BENCH_JSON_H
#define SGM_BENCH_JSON_H

#include <string>
#include <utility>
#include <vector>

namespace sgm_bench {

struct Json {
  enum Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = kNull;                                // what this value is
  bool b = false;                                   // kBool
  double num = 0;                                   // kNumber
  std::string str;                                  // kString
  std::vector<Json> arr;                            // kArray
  std::vector<std::pair<std::string, Json>> obj;    // kObject, in insertion order

  static Json Bool(bool v);
  static Json Number(double v);  // NaN and infinities are written as null
  static Json String(std::string v);
  static Json Array();
  static Json Object();

  // Object member k, or nullptr when absent or this is not an object.
  const Json *Get(const std::string &k) const;
  Json *Get(const std::string &k);
  // Set (replace or append) object member k; returns *this.
  Json &Set(const std::string &k, Json v);
  // Append to an array; returns *this.
  Json &Push(Json v);
  // Convenience readers: the member as that type, else def.
  double NumberOr(const std::string &k, double def) const;
  std::string StringOr(const std::string &k, const std::string &def) const;
};

// Parse text; false with *err = "offset N: what" on failure (*out untouched).
bool JsonParse(const std::string &text, Json *out, std::string *err);
// Two-space indented; arrays of numbers on one line.
std::string JsonWrite(const Json &v);
// Read and parse a file; false with *err naming the file.
bool JsonReadFile(const std::string &path, Json *out, std::string *err);

}  // namespace sgm_bench

#endif  // SGM_BENCH_JSON_H
