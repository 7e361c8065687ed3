fn main() -> std::process::ExitCode {
    k3_run::cli::main()
}
