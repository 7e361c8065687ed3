//! Integration test crate; tests live in tests/tests/.
