//! JSON values with Python `json` semantics, for the parts of the chat format that upstream
//! produces with `json.loads` / `json.dumps`.
//!
//! Owns: an order-preserving JSON value ([`PyJson`]), a parser that behaves like Python's
//! `json.loads` (object key order kept; a duplicate key keeps its first position and its last
//! value; integers exact; `NaN`/`Infinity`/`-Infinity` accepted; control characters inside
//! strings rejected), and `json.dumps(ensure_ascii=False)` output with either the default
//! separators (`", "`, `": "`) or the compact ones (`","`, `":"`), floats printed like
//! Python's `repr(float)`.
//!
//! Must not: depend on serde_json's `Value` (which sorts keys) or reorder anything.
//!
//! Follows upstream `encoding_k3.py`: typed tool-call argument values are
//! `json.dumps(value, ensure_ascii=False)`; the tool declaration and the response schema are
//! `json.dumps(..., ensure_ascii=False, separators=(",", ":"))` after a deep key sort.
//!
//! Known differences from CPython, all outside what a chat transcript can reasonably hold: a
//! lone UTF-16 surrogate escape (`"\ud800"`) becomes U+FFFD (CPython keeps the surrogate in
//! the `str`; tiktoken then replaces it with U+FFFD when encoding, so token ids agree); an
//! integer of more than 4,300 digits or nesting deeper than 900 levels is a parse error here,
//! while CPython raises a non-`JSONDecodeError` exception (so upstream fails to render where
//! the renderer here falls back to a raw `json` block).

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// CPython's default `sys.int_info.default_max_str_digits`: `int()` of a longer digit string
/// raises, so `json.loads` does too.
const PY_MAX_INT_DIGITS: usize = 4300;

/// A JSON value as Python's `json.loads` would build it.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum PyJson {
    #[default]
    Null,
    Bool(bool),
    /// A Python `int`, as its canonical decimal text (`-0` normalised to `0`).
    Int(String),
    Float(f64),
    Str(String),
    Array(Vec<PyJson>),
    /// Keys in insertion order (Python dict order).
    Object(Vec<(String, PyJson)>),
}

/// A JSON parse error with the character position, like Python's `JSONDecodeError`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid JSON at byte {pos}: {msg}")]
pub struct JsonError {
    pub pos: usize,
    pub msg: String,
}

impl PyJson {
    /// Parse like Python `json.loads(text)`.
    pub fn parse(text: &str) -> Result<PyJson, JsonError> {
        let mut p = Parser {
            s: text.as_bytes(),
            src: text,
            i: 0,
            depth: 0,
        };
        p.ws();
        let v = p.value()?;
        p.ws();
        if p.i != p.s.len() {
            return Err(p.err("extra data"));
        }
        Ok(v)
    }

    /// Python's type name for XTML `type=` attributes: boolean, null, number, string, object,
    /// array.
    pub fn xtml_type(&self) -> &'static str {
        match self {
            PyJson::Bool(_) => "boolean",
            PyJson::Null => "null",
            PyJson::Int(_) | PyJson::Float(_) => "number",
            PyJson::Str(_) => "string",
            PyJson::Object(_) => "object",
            PyJson::Array(_) => "array",
        }
    }

    /// `json.dumps(self, ensure_ascii=False)` (separators `", "` and `": "`).
    pub fn dumps(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, ", ", ": ");
        out
    }

    /// `json.dumps(self, ensure_ascii=False, separators=(",", ":"))`.
    pub fn dumps_compact(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, ",", ":");
        out
    }

    /// Upstream `deep_sort_dict`: every object's keys sorted (code point order), recursively
    /// through arrays.
    pub fn deep_sorted(&self) -> PyJson {
        match self {
            PyJson::Object(items) => {
                let mut items: Vec<(String, PyJson)> = items
                    .iter()
                    .map(|(k, v)| (k.clone(), v.deep_sorted()))
                    .collect();
                items.sort_by(|a, b| a.0.cmp(&b.0));
                PyJson::Object(items)
            }
            PyJson::Array(items) => PyJson::Array(items.iter().map(PyJson::deep_sorted).collect()),
            other => other.clone(),
        }
    }

    fn write(&self, out: &mut String, item_sep: &str, key_sep: &str) {
        match self {
            PyJson::Null => out.push_str("null"),
            PyJson::Bool(true) => out.push_str("true"),
            PyJson::Bool(false) => out.push_str("false"),
            PyJson::Int(s) => out.push_str(s),
            PyJson::Float(f) => out.push_str(&py_float_repr(*f)),
            PyJson::Str(s) => write_str(out, s),
            PyJson::Array(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    v.write(out, item_sep, key_sep);
                }
                out.push(']');
            }
            PyJson::Object(items) => {
                out.push('{');
                for (i, (k, v)) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    write_str(out, k);
                    out.push_str(key_sep);
                    v.write(out, item_sep, key_sep);
                }
                out.push('}');
            }
        }
    }
}

/// Python `json` string encoding with `ensure_ascii=False`.
fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `repr(float)` (also what `json.dumps` prints, with `NaN`/`Infinity` spelled as
/// JSON-ish literals): the shortest round-trip digits, positional notation when the decimal
/// exponent is in `-4..16`, otherwise `d.ddde±XX`; positional values always show a fraction.
pub fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci
        .split_once('e')
        .expect("Rust LowerExp output always contains 'e'");
    let exp: i32 = exp.parse().expect("Rust LowerExp exponent is an integer");
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else if exp + 1 >= n {
            out.push_str(&digits);
            for _ in 0..(exp + 1 - n) {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            let split = (exp + 1) as usize;
            out.push_str(&digits[..split]);
            out.push('.');
            out.push_str(&digits[split..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.unsigned_abs()));
    }
    out
}

struct Parser<'a> {
    s: &'a [u8],
    src: &'a str,
    i: usize,
    depth: usize,
}

impl Parser<'_> {
    fn err(&self, msg: &str) -> JsonError {
        JsonError {
            pos: self.i,
            msg: msg.to_string(),
        }
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.s[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Result<PyJson, JsonError> {
        // Python's json recursion is bounded by the interpreter's recursion limit (~1000).
        if self.depth > 900 {
            return Err(self.err("nesting too deep"));
        }
        match self.s.get(self.i) {
            None => Err(self.err("expecting value")),
            Some(b'{') => {
                self.depth += 1;
                let v = self.object();
                self.depth -= 1;
                v
            }
            Some(b'[') => {
                self.depth += 1;
                let v = self.array();
                self.depth -= 1;
                v
            }
            Some(b'"') => Ok(PyJson::Str(self.string()?)),
            Some(b'n') if self.eat("null") => Ok(PyJson::Null),
            Some(b't') if self.eat("true") => Ok(PyJson::Bool(true)),
            Some(b'f') if self.eat("false") => Ok(PyJson::Bool(false)),
            Some(b'N') if self.eat("NaN") => Ok(PyJson::Float(f64::NAN)),
            Some(b'I') if self.eat("Infinity") => Ok(PyJson::Float(f64::INFINITY)),
            Some(b'-') if self.s[self.i..].starts_with(b"-Infinity") => {
                self.i += "-Infinity".len();
                Ok(PyJson::Float(f64::NEG_INFINITY))
            }
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.err("expecting value")),
        }
    }

    fn number(&mut self) -> Result<PyJson, JsonError> {
        let start = self.i;
        let digits = |p: &mut Self| {
            let s = p.i;
            while let Some(b'0'..=b'9') = p.s.get(p.i) {
                p.i += 1;
            }
            p.i - s
        };
        if self.s.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match self.s.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                digits(self);
            }
            _ => {
                self.i = start;
                return Err(self.err("expecting value"));
            }
        }
        let int_end = self.i;
        let mut is_float = false;
        if self.s.get(self.i) == Some(&b'.') {
            let save = self.i;
            self.i += 1;
            if digits(self) == 0 {
                self.i = save;
            } else {
                is_float = true;
            }
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            let save = self.i;
            self.i += 1;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            if digits(self) == 0 {
                self.i = save;
            } else {
                is_float = true;
            }
        }
        let text = &self.src[start..self.i];
        if is_float {
            let f: f64 = text.parse().map_err(|_| JsonError {
                pos: start,
                msg: format!("bad number {text:?}"),
            })?;
            Ok(PyJson::Float(f))
        } else {
            let text = &self.src[start..int_end];
            let (neg, mag) = match text.strip_prefix('-') {
                Some(m) => (true, m),
                None => (false, text),
            };
            if mag.len() > PY_MAX_INT_DIGITS {
                return Err(JsonError {
                    pos: start,
                    msg: format!("integer with more than {PY_MAX_INT_DIGITS} digits"),
                });
            }
            let canon = if neg && mag != "0" {
                format!("-{mag}")
            } else {
                mag.to_string()
            };
            Ok(PyJson::Int(canon))
        }
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let h = self
            .src
            .get(self.i..self.i + 4)
            .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| self.err("invalid \\uXXXX escape"))?;
        let v = u32::from_str_radix(h, 16).map_err(|_| self.err("invalid \\uXXXX escape"))?;
        self.i += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<String, JsonError> {
        // At the opening quote.
        self.i += 1;
        let mut out = String::new();
        loop {
            let run_start = self.i;
            while let Some(&b) = self.s.get(self.i) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.i += 1;
            }
            out.push_str(&self.src[run_start..self.i]);
            match self.s.get(self.i) {
                None => return Err(self.err("unterminated string")),
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.i += 1;
                    let esc = *self
                        .s
                        .get(self.i)
                        .ok_or_else(|| self.err("unterminated string"))?;
                    self.i += 1;
                    match esc {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{08}'),
                        b'f' => out.push('\u{0c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let hi = self.hex4()?;
                            let cp = if (0xd800..0xdc00).contains(&hi)
                                && self.s[self.i..].starts_with(b"\\u")
                            {
                                let save = self.i;
                                self.i += 2;
                                let lo = self.hex4()?;
                                if (0xdc00..0xe000).contains(&lo) {
                                    0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00)
                                } else {
                                    self.i = save;
                                    hi
                                }
                            } else {
                                hi
                            };
                            out.push(char::from_u32(cp).unwrap_or(char::REPLACEMENT_CHARACTER));
                        }
                        _ => {
                            self.i -= 1;
                            return Err(self.err("invalid \\escape"));
                        }
                    }
                }
                Some(_) => return Err(self.err("invalid control character in string")),
            }
        }
    }

    fn array(&mut self) -> Result<PyJson, JsonError> {
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.eat("]") {
            return Ok(PyJson::Array(items));
        }
        loop {
            self.ws();
            items.push(self.value()?);
            self.ws();
            if self.eat("]") {
                return Ok(PyJson::Array(items));
            }
            if !self.eat(",") {
                return Err(self.err("expecting ',' delimiter"));
            }
        }
    }

    fn object(&mut self) -> Result<PyJson, JsonError> {
        self.i += 1;
        let mut items: Vec<(String, PyJson)> = Vec::new();
        self.ws();
        if self.eat("}") {
            return Ok(PyJson::Object(items));
        }
        loop {
            self.ws();
            if self.s.get(self.i) != Some(&b'"') {
                return Err(self.err("expecting property name enclosed in double quotes"));
            }
            let key = self.string()?;
            self.ws();
            if !self.eat(":") {
                return Err(self.err("expecting ':' delimiter"));
            }
            self.ws();
            let v = self.value()?;
            // dict semantics: a repeated key keeps its first position and takes the last value.
            match items.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = v,
                None => items.push((key, v)),
            }
            self.ws();
            if self.eat("}") {
                return Ok(PyJson::Object(items));
            }
            if !self.eat(",") {
                return Err(self.err("expecting ',' delimiter"));
            }
        }
    }
}

impl Serialize for PyJson {
    /// Serialised as its compact Python dump, which is valid JSON unless it holds a
    /// non-finite float (then serialisation fails rather than writing invalid JSON).
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let raw = serde_json::value::RawValue::from_string(self.dumps_compact())
            .map_err(|e| S::Error::custom(format!("value is not representable as JSON: {e}")))?;
        raw.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for PyJson {
    /// Only from serde_json (it needs the raw JSON text to keep key order and exact numbers).
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Box::<serde_json::value::RawValue>::deserialize(deserializer)?;
        PyJson::parse(raw.get()).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python_examples() {
        // Values checked against CPython 3.11 `repr(float)`.
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (2.71, "2.71"),
            (2.5e100, "2.5e+100"),
            (5e-324, "5e-324"),
            (100.0, "100.0"),
            (1234.5, "1234.5"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn parse_keeps_order_and_python_duplicate_semantics() {
        let v = PyJson::parse(r#"{"b": 1, "a": [true, null, 2.50], "b": -0}"#).unwrap();
        assert_eq!(v.dumps(), r#"{"b": 0, "a": [true, null, 2.5]}"#);
        assert_eq!(v.dumps_compact(), r#"{"b":0,"a":[true,null,2.5]}"#);
        assert_eq!(
            v.deep_sorted().dumps_compact(),
            r#"{"a":[true,null,2.5],"b":0}"#
        );
    }

    #[test]
    fn strings_escape_like_python_ensure_ascii_false() {
        let v = PyJson::parse(r#""日本\n\u0001\"\\\/é\ud83d\ude00""#).unwrap();
        assert_eq!(v.dumps(), "\"日本\\n\\u0001\\\"\\\\/é😀\"");
        assert!(PyJson::parse("\"a\nb\"").is_err());
        assert!(PyJson::parse("[1,]").is_err());
        assert!(PyJson::parse("01").is_err());
        assert_eq!(PyJson::parse("1E2").unwrap().dumps(), "100.0");
        assert_eq!(PyJson::parse("-Infinity").unwrap().dumps(), "-Infinity");
        let big = "123456789012345678901234567890";
        assert_eq!(PyJson::parse(big).unwrap().dumps(), big);
    }
}
