//! Records build facts `accel env` reports: the rustc version and the candle-core version from Cargo.lock.

use std::path::Path;
use std::process::Command;

fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=ACCEL_BUILD_RUSTC_VERSION={rustc_version}");

    // Cargo.lock sits at the workspace root, two levels above this crate; a published crate has none.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let lock = Path::new(&manifest).join("../../Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    println!("cargo:rerun-if-changed=build.rs");
    let candle = std::fs::read_to_string(&lock).ok().and_then(|text| locked_version(&text, "candle-core"));
    println!("cargo:rustc-env=ACCEL_BUILD_CANDLE_VERSION={}", candle.unwrap_or_else(|| "unknown".into()));
}

/// The `version` of the `[[package]]` named `name` in a Cargo.lock.
fn locked_version(lock: &str, name: &str) -> Option<String> {
    let needle = format!("name = \"{name}\"");
    let mut lines = lock.lines();
    while let Some(line) = lines.next() {
        if line.trim() == needle {
            let v = lines.next()?.trim().strip_prefix("version = \"")?.strip_suffix('"')?;
            return Some(v.to_string());
        }
    }
    None
}
