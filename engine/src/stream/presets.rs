//! Memory presets: named (trunk budget, expert-cache budget, ultra-low-memory) triples.
//!
//! Owns: parsing preset TOML files (unknown keys refused), the six built-in presets shipped
//! in `configs/presets/` (embedded at compile time so the binary works from any directory),
//! and the `--list-presets` table.
//! Must not: decide precedence between `--preset` and `--trunk-gb`/`--cache-gb` (the CLI's
//! layering: an explicit budget wins over the preset's), or plan memory (see `plan`).
//! Follows upstream: docs/DESIGN.md §5 (the table of presets with the seeds' numbers).

use std::path::Path;

use super::{StreamError, gb_to_bytes};

/// One preset (a `configs/presets/*.toml` file).
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Preset {
    pub name: String,
    /// Trunk budget (pinned prefix + ring slots), GB (1e9 bytes); fractions allowed.
    pub trunk_gb: f64,
    /// Routed-expert cache budget, GB.
    pub cache_gb: f64,
    /// Stream embedding rows and lm_head chunks instead of keeping them resident.
    #[serde(default)]
    pub ultra_low_memory: bool,
    /// One line for `--list-presets`.
    #[serde(default)]
    pub note: String,
}

impl Preset {
    pub fn trunk_bytes(&self) -> Result<u64, StreamError> {
        gb_to_bytes(self.trunk_gb, &format!("preset {} trunk_gb", self.name))
    }
    pub fn cache_bytes(&self) -> Result<u64, StreamError> {
        gb_to_bytes(self.cache_gb, &format!("preset {} cache_gb", self.name))
    }
}

/// Built-in preset names, smallest first.
pub const PRESET_NAMES: [&str; 6] = ["ultra", "laptop", "desktop", "workstation", "server", "max"];

const BUILTIN: [(&str, &str); 6] = [
    ("ultra", include_str!("../../../configs/presets/ultra.toml")),
    (
        "laptop",
        include_str!("../../../configs/presets/laptop.toml"),
    ),
    (
        "desktop",
        include_str!("../../../configs/presets/desktop.toml"),
    ),
    (
        "workstation",
        include_str!("../../../configs/presets/workstation.toml"),
    ),
    (
        "server",
        include_str!("../../../configs/presets/server.toml"),
    ),
    ("max", include_str!("../../../configs/presets/max.toml")),
];

/// Parse and validate preset text; `origin` names the file in errors.
pub fn parse_preset(text: &str, origin: &str) -> Result<Preset, StreamError> {
    let p: Preset =
        toml::from_str(text).map_err(|e| StreamError::Config(format!("preset {origin}: {e}")))?;
    if p.name.trim().is_empty() {
        return Err(StreamError::Config(format!(
            "preset {origin}: name is empty"
        )));
    }
    gb_to_bytes(p.trunk_gb, &format!("preset {origin}: trunk_gb"))?;
    gb_to_bytes(p.cache_gb, &format!("preset {origin}: cache_gb"))?;
    Ok(p)
}

/// The built-in presets, in [`PRESET_NAMES`] order.
pub fn builtin_presets() -> Result<Vec<Preset>, StreamError> {
    BUILTIN
        .iter()
        .map(|(name, text)| parse_preset(text, &format!("configs/presets/{name}.toml")))
        .collect()
}

/// `--preset VALUE`: a built-in name, or a path to a preset TOML file (contains `/` or ends
/// in `.toml`).
pub fn load_preset(value: &str) -> Result<Preset, StreamError> {
    if value.contains('/') || value.ends_with(".toml") {
        let path = Path::new(value);
        let text = k3_models::load::read_regular_file(path)
            .map_err(|e| StreamError::io("read preset", path, e))?;
        return parse_preset(&text, value);
    }
    match BUILTIN.iter().find(|(n, _)| *n == value) {
        Some((name, text)) => parse_preset(text, &format!("configs/presets/{name}.toml")),
        None => Err(StreamError::Config(format!(
            "unknown preset {value:?}; built-in presets: {} (or give a path to a preset .toml)",
            PRESET_NAMES.join(", ")
        ))),
    }
}

/// The `--list-presets` table.
pub fn list_presets() -> Result<String, StreamError> {
    let mut s = String::from("presets (trunk / expert-cache, in GB):\n");
    for p in builtin_presets()? {
        let ultra = if p.ultra_low_memory {
            " [--ultra-low-memory]"
        } else {
            ""
        };
        s.push_str(&format!(
            "  {:<12} {:>7.2} / {:>6.2}  {}{}\n",
            p.name, p.trunk_gb, p.cache_gb, p.note, ultra
        ));
    }
    s.push_str(
        "All presets stream the trunk, so they need --trunk <packed_dir>; without it the whole \
         trunk is loaded resident and only the expert-cache budget applies (ultra's \
         ultra-low-memory needs --trunk too).\n--trunk-gb / --cache-gb (or a run config's) override the preset's number; \
         a bare preset name is looked for in ./configs/presets/ before these built-in copies.\n",
    );
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_carry_the_seed_numbers() {
        let ps = builtin_presets().expect("built-in presets parse");
        let got: Vec<(String, f64, f64, bool)> = ps
            .iter()
            .map(|p| (p.name.clone(), p.trunk_gb, p.cache_gb, p.ultra_low_memory))
            .collect();
        let want = [
            ("ultra", 2.50, 0.31, true),
            ("laptop", 3.00, 1.00, false),
            ("desktop", 16.00, 10.00, false),
            ("workstation", 60.00, 30.00, false),
            ("server", 110.00, 13.00, false),
            ("max", 110.00, 109.00, false),
        ];
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert_eq!((g.0.as_str(), g.1, g.2, g.3), w);
        }
        assert_eq!(
            load_preset("laptop")
                .expect("laptop")
                .trunk_bytes()
                .expect("bytes"),
            3_000_000_000
        );
        assert_eq!(
            load_preset("ultra")
                .expect("ultra")
                .cache_bytes()
                .expect("bytes"),
            310_000_000
        );
    }

    #[test]
    fn unknown_keys_and_bad_numbers_are_refused() {
        let e = parse_preset("name='x'\ntrunk_gb=1\ncache_gb=1\ncache_size=3\n", "x.toml")
            .expect_err("unknown key");
        assert!(e.to_string().contains("cache_size"), "{e}");
        let e = parse_preset("name='x'\ntrunk_gb=-1\ncache_gb=1\n", "x.toml").expect_err("neg");
        assert!(e.to_string().contains("trunk_gb"), "{e}");
        let e = parse_preset("name='x'\ncache_gb=1\n", "x.toml").expect_err("missing");
        assert!(e.to_string().contains("trunk_gb"), "{e}");
        let e = load_preset("tiny").expect_err("unknown name");
        assert!(e.to_string().contains("laptop"), "{e}");
    }

    #[test]
    fn fractional_budgets_parse() {
        let p = parse_preset("name='t'\ntrunk_gb=0.0005\ncache_gb=0\n", "t.toml").expect("ok");
        assert_eq!(p.trunk_bytes().expect("bytes"), 500_000);
        assert_eq!(p.cache_bytes().expect("bytes"), 0);
    }

    #[test]
    fn list_shows_every_preset() {
        let t = list_presets().expect("list");
        for n in PRESET_NAMES {
            assert!(t.contains(n), "{t}");
        }
        assert!(t.contains("2.50 /   0.31"), "{t}");
        assert!(t.contains("110.00 / 109.00"), "{t}");
    }
}
