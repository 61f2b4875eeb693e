//! How the chooser prints numbers: bytes in binary units (`1.50 GiB`), seconds in the unit that keeps them
//! readable (`12.3 ms`), bandwidth in decimal units (`10.0 GB/s`, as link speeds are quoted), counts with a space
//! every three digits (`820 992`).

/// `820 992`.
pub(crate) fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// `512 B`, `3.13 MiB`, `1.50 GiB`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// `850 ns`, `5.0 µs`, `12.3 ms`, `1.25 s`.
pub(crate) fn seconds(s: f64) -> String {
    if s == 0.0 {
        "0 s".into()
    } else if s < 1e-6 {
        format!("{:.0} ns", s * 1e9)
    } else if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// `10.0 GB/s`, `800.0 MB/s`.
pub(crate) fn bandwidth(bytes_per_s: f64) -> String {
    if bytes_per_s >= 1e9 {
        format!("{:.1} GB/s", bytes_per_s / 1e9)
    } else if bytes_per_s >= 1e6 {
        format!("{:.1} MB/s", bytes_per_s / 1e6)
    } else {
        format!("{:.1} kB/s", bytes_per_s / 1e3)
    }
}

/// `1 process`, `4 processes`.
pub(crate) fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}
