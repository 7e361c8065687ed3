fn main() { eprintln!("k3-run: not yet implemented"); std::process::exit(2); }
