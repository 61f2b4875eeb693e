//! Inputs that used to be accepted and silently did something else: each is refused with a clear message
//! before any worker starts.

use std::process::Command;

fn refused(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).env_remove("RANK").output().expect("running the example");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{bin} {args:?} was accepted:\n{text}");
    text
}

#[test]
fn nproc_zero_is_refused_by_every_example() {
    for bin in [env!("CARGO_BIN_EXE_train_mnist"), env!("CARGO_BIN_EXE_accel_mnist"), env!("CARGO_BIN_EXE_ddp_mnist")] {
        let text = refused(bin, &["--nproc", "0"]);
        assert!(text.contains("--nproc") && text.contains("at least 1"), "{bin}:\n{text}");
    }
}

#[test]
fn launch_self_refuses_zero_processes() {
    let err = ddp_core::launcher::launch_self(0).unwrap_err().to_string();
    assert!(err.contains("nproc is 0"), "{err}");
}
