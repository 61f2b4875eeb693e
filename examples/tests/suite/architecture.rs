//! The boundary invariants of `docs/ARCHITECTURE.md` that a reading of the sources can hold: each test here
//! fails when the code crosses a line the document draws.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every `.rs` file below `dir` (relative to the workspace root), as workspace-relative paths.
fn rust_files(dir: &str) -> Vec<String> {
    fn walk(d: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root().join(dir), &mut out);
    let mut rel: Vec<String> =
        out.iter().map(|p| p.strip_prefix(root()).unwrap().to_string_lossy().into_owned()).collect();
    rel.sort();
    rel
}

/// The package names under `[dependencies]` of a crate's `Cargo.toml` (not dev- or build-dependencies).
fn dependencies(manifest: &str) -> BTreeSet<String> {
    let text = read(manifest);
    let mut in_deps = false;
    let mut deps = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
        } else if in_deps && !line.is_empty() && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once(['=', '.']) {
                deps.insert(name.trim().to_string());
            }
        }
    }
    deps
}

/// Source text without comment lines (docs may name anything).
fn code_of(text: &str) -> String {
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

#[test]
fn crate_dependencies_point_down_the_layers() {
    let ours = ["accel-nn", "ddp-core", "accel", "trainer"];
    let of = |krate: &str| -> BTreeSet<String> {
        let deps = dependencies(&format!("crates/{krate}/Cargo.toml"));
        deps.into_iter().filter(|d| ours.contains(&d.as_str())).collect()
    };
    let set = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(of("accel-nn"), set(&[]), "accel-nn depends on candle only");
    assert_eq!(of("ddp-core"), set(&[]), "ddp-core depends on candle only");
    assert_eq!(of("accel"), set(&["accel-nn", "ddp-core"]));
    assert_eq!(of("trainer"), set(&["accel"]), "the Trainer reaches the lower levels through accel only");
    // The kernels' dependencies are accel-nn's alone.
    let ddp = dependencies("crates/ddp-core/Cargo.toml");
    for gone in ["gemm", "safetensors", "serde_json"] {
        assert!(!ddp.contains(gone), "ddp-core depends on {gone}, which only the computation (accel-nn) needs");
    }
}

#[test]
fn ddp_core_communicates_and_accel_nn_does_not() {
    for file in rust_files("crates/ddp-core/src") {
        let code = code_of(&read(&file));
        for word in ["gemm::", "safetensors::", "serde_json::", "accel_nn", "accel::", "trainer::"] {
            assert!(!code.contains(word), "{file} uses {word}: ddp-core only communicates");
        }
    }
    for file in rust_files("crates/accel-nn/src") {
        let code = code_of(&read(&file));
        for word in ["ddp_core", "ProcessGroup", "accel::", "trainer::"] {
            assert!(!code.contains(word), "{file} uses {word}: accel-nn communicates with nothing");
        }
    }
}

/// The top-level module of `crates/accel/src` a file belongs to (`step/gradients.rs` → `step`).
fn top_module(file: &str) -> String {
    let rel = file.strip_prefix("crates/accel/src/").unwrap();
    rel.split('/').next().unwrap().trim_end_matches(".rs").to_string()
}

/// Which top-level modules of accel each module names (`crate::x`, or an item the crate root re-exports from
/// `x`), test modules excluded.
fn accel_module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let lib = code_of(&read("crates/accel/src/lib.rs"));
    let modules: BTreeSet<String> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim().trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            l.strip_prefix("mod ").map(|m| m.trim_end_matches(';').to_string())
        })
        .collect();
    // `pub use module::{A, B};` at the root: A and B lead to `module`.
    let mut reexported = BTreeMap::new();
    for l in lib.lines().map(str::trim) {
        let Some(rest) = l.strip_prefix("pub use ").or_else(|| l.strip_prefix("pub(crate) use ")) else { continue };
        let Some((module, items)) = rest.split_once("::") else { continue };
        if !modules.contains(module) {
            continue;
        }
        for item in items.split(|c: char| !c.is_alphanumeric() && c != '_').filter(|s| !s.is_empty()) {
            reexported.insert(item.to_string(), module.to_string());
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for file in rust_files("crates/accel/src") {
        let from = top_module(&file);
        if !modules.contains(&from) || file.ends_with("/tests.rs") {
            continue;
        }
        let text = read(&file);
        let code = code_of(text.split("#[cfg(test)]\nmod tests {").next().unwrap());
        let mut named = BTreeSet::new();
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let inner = &group[..group.find('}').unwrap_or(group.len())];
                named.extend(inner.split(',').map(|p| p.trim().split("::").next().unwrap().to_string()));
            } else {
                named.insert(rest.split(|c: char| !c.is_alphanumeric() && c != '_').next().unwrap().to_string());
            }
        }
        for name in named {
            let to = if modules.contains(&name) { Some(name) } else { reexported.get(&name).cloned() };
            if let Some(to) = to.filter(|t| *t != from) {
                graph.get_mut(&from).unwrap().insert(to);
            }
        }
    }
    graph
}

#[test]
fn accel_modules_import_no_circle() {
    let graph = accel_module_graph();
    // Depth-first search for a back edge; the path to it is the circle.
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_string());
            return Some(circle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in &graph[m] {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        if let Some(circle) = visit(m, &graph, &mut Vec::new(), &mut done) {
            panic!("accel's modules import each other in a circle: {}", circle.join(" → "));
        }
    }
    // The layering the document states: the model and its strategies below the step owner, the step owner
    // below the Accelerator.
    assert!(graph["step"].contains("model") && !graph["model"].contains("step"));
    assert!(graph["accelerator"].contains("step") && !graph["step"].contains("accelerator"));
    assert!(!graph["model"].contains("accelerator") && !graph["optim"].contains("accelerator"));
}

#[test]
fn the_circle_check_sees_a_circle() {
    // The checker itself: the graph it builds has the edges the code has (accelerator → step → model), so
    // a reversed edge would close a circle.
    let graph = accel_module_graph();
    assert!(graph["accelerator"].contains("model"));
    assert!(graph["step"].contains("model"));
    assert!(graph["optim"].contains("step"), "AcceleratedOptimizer takes its gradients from the step owner");
}

#[test]
fn only_binaries_and_the_trainer_arguments_know_clap() {
    let allowed = |f: &str| {
        f.starts_with("crates/accel-cli/")
            || f.starts_with("examples/src/bin/")
            || f.starts_with("benches/")
            || f == "crates/trainer/src/args.rs"
    };
    for dir in ["crates", "examples/src", "benches/src"] {
        for file in rust_files(dir) {
            if allowed(&file) || file.contains("/tests/") {
                continue;
            }
            let code = code_of(&read(&file));
            assert!(
                !code.contains("clap"),
                "{file} uses clap: only the binaries and trainer::args parse command lines"
            );
        }
    }
    for krate in ["accel-nn", "ddp-core", "accel", "trainer"] {
        let deps = dependencies(&format!("crates/{krate}/Cargo.toml"));
        assert!(!deps.contains("anyhow"), "{krate} depends on anyhow: libraries return their own error type");
        assert!(krate == "trainer" || !deps.contains("clap"), "{krate} depends on clap");
    }
}

#[test]
fn every_file_the_architecture_document_names_exists() {
    let doc = read("docs/ARCHITECTURE.md");
    let files: BTreeSet<String> = ["crates", "examples", "benches"]
        .iter()
        .flat_map(|d| rust_files(d))
        .chain(
            std::fs::read_dir(root().join("scripts"))
                .unwrap()
                .flatten()
                .map(|e| format!("scripts/{}", e.file_name().to_string_lossy())),
        )
        .collect();
    let mut checked = 0;
    for token in doc.split('`').skip(1).step_by(2) {
        let name = token.trim_end_matches(['/', ')']);
        if !(name.ends_with(".rs") || name.ends_with(".sh")) || name.contains(' ') || name.contains('{') {
            continue;
        }
        checked += 1;
        assert!(files.iter().any(|f| f.ends_with(name)), "docs/ARCHITECTURE.md names `{name}`, which no file is");
    }
    assert!(checked > 40, "only {checked} file names found in docs/ARCHITECTURE.md: the parser lost them");
}

/// Values every process must hash alike (a parameter's random stream, a fingerprint compared across ranks) go
/// through `ddp_core::fingerprint`: FNV-1a is written once, recognised by its offset basis.
#[test]
fn fnv_1a_is_written_once() {
    let basis = ["cbf2_9ce4_8422_2325", "cbf29ce484222325"];
    let mut holders = Vec::new();
    for dir in ["crates", "examples/src", "benches/src"] {
        for file in rust_files(dir) {
            let code = code_of(&read(&file)).to_lowercase();
            if basis.iter().any(|b| code.contains(b)) && !file.contains("/tests/") {
                holders.push(file);
            }
        }
    }
    assert_eq!(holders, ["crates/ddp-core/src/fingerprint.rs"], "FNV-1a's offset basis outside ddp_core::fingerprint");
}
