//! Errors of manifest parsing, config.json reading and spec validation.
//!
//! Owns: [`SpecError`] (one problem, with where it is: a TOML path in a manifest file, a key
//! path in a config.json file, or both for a contradiction) and [`SpecErrors`] (every problem
//! found in one load, reported together). Must not: decide policy (exit codes belong to the
//! binary: a `SpecErrors` maps to exit code 2 there).

use std::fmt;

/// What kind of problem; lets callers and tests tell problems apart without parsing text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ErrorKind {
    /// A file could not be read.
    Io,
    /// The file is not valid TOML / JSON.
    Syntax,
    /// `schema_version` is missing or not the supported one.
    SchemaVersion,
    /// A manifest key the schema does not know (typo?).
    UnknownField,
    /// A required manifest field or config.json key is absent (or null).
    Missing,
    /// A value has the wrong type or is out of range.
    Invalid,
    /// The manifest and config.json (or two config.json keys) disagree.
    Contradiction,
    /// Valid upstream, but not something k3-run implements.
    Unsupported,
}

/// Where a problem is.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Place {
    /// A whole file (I/O, syntax).
    File { file: String },
    /// A TOML path (`kda.gate`, `tensors.kda_q.name`) in a manifest file.
    Manifest { file: String, path: String },
    /// A key path (`text_config.linear_attn_config.num_heads`) in a config.json file.
    Config { file: String, key: String },
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::File { file } => write!(f, "{file}"),
            Place::Manifest { file, path } => write!(f, "{file}: `{path}`"),
            Place::Config { file, key } => write!(f, "{file}: `{key}`"),
        }
    }
}

/// One problem. `places` has one entry, or two for a contradiction (manifest first).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SpecError {
    pub kind: ErrorKind,
    pub places: Vec<Place>,
    pub message: String,
}

impl SpecError {
    pub fn new(kind: ErrorKind, place: Place, message: impl Into<String>) -> SpecError {
        SpecError {
            kind,
            places: vec![place],
            message: message.into(),
        }
    }

    /// Two places that disagree.
    pub fn contradiction(a: Place, b: Place, message: impl Into<String>) -> SpecError {
        SpecError {
            kind: ErrorKind::Contradiction,
            places: vec![a, b],
            message: message.into(),
        }
    }

    /// True if any place of this error is the given TOML path or config key.
    pub fn mentions(&self, path_or_key: &str) -> bool {
        self.places.iter().any(|p| match p {
            Place::Manifest { path, .. } => path == path_or_key,
            Place::Config { key, .. } => key == path_or_key,
            Place::File { file } => file == path_or_key,
        })
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.places.iter().enumerate() {
            if i > 0 {
                write!(f, " vs ")?;
            }
            write!(f, "{p}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Every problem found while loading a model description.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct SpecErrors(pub Vec<SpecError>);

impl fmt::Display for SpecErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(
            f,
            "{n} problem{} in the model description",
            if n == 1 { "" } else { "s" }
        )?;
        for e in &self.0 {
            write!(f, "\n  - {e}")?;
        }
        Ok(())
    }
}

impl SpecErrors {
    pub fn iter(&self) -> std::slice::Iter<'_, SpecError> {
        self.0.iter()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// The errors of a kind.
    pub fn of_kind(&self, kind: ErrorKind) -> Vec<&SpecError> {
        self.0.iter().filter(|e| e.kind == kind).collect()
    }
}

/// An accumulator: validation pushes here and keeps going.
#[derive(Debug, Default)]
pub struct Errors(pub Vec<SpecError>);

impl Errors {
    pub fn push(&mut self, e: SpecError) {
        self.0.push(e);
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn extend(&mut self, other: SpecErrors) {
        self.0.extend(other.0);
    }
    /// `Err(all pushed errors)` if any were pushed (and empties the accumulator).
    pub fn check(&mut self) -> Result<(), SpecErrors> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(SpecErrors(std::mem::take(&mut self.0)))
        }
    }
    /// `Ok(v)` if nothing was pushed, else every pushed error.
    pub fn finish<T>(self, v: T) -> Result<T, SpecErrors> {
        if self.0.is_empty() {
            Ok(v)
        } else {
            Err(SpecErrors(self.0))
        }
    }
}
